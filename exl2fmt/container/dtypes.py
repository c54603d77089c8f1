"""The safetensors dtype table: the one place that maps safetensors dtypes to numpy and back, and bf16 bit math.

``SAFETENSORS_DTYPES`` lists every dtype safetensors 0.8 accepts (taken from the ``Dtype`` enum of the Rust
crate and confirmed against the installed library), as ``DtypeSpec(bits, numpy)``.  ``numpy`` is the
little-endian numpy dtype a reader returns, or ``None`` for the sub-byte dtypes.  Dtypes that numpy cannot
represent are exposed *as raw unsigned integers of the same width* (listed in ``RAW_DTYPES``): ``BF16 ->
uint16`` and every ``F8_*`` -> ``uint8``; the caller reinterprets the bits (for BF16 with
``bf16_bits_to_f32`` / ``f32_to_bf16_bits`` below).  The sub-byte dtypes ``F4`` (4 bits) and
``F6_E2M3``/``F6_E3M2`` (6 bits) have ``numpy=None``: readers return their packed bytes as a 1-D ``uint8``
array.  Besides the dtypes named in the safetensors README, 0.8 also accepts ``F8_E4M3FNUZ`` and
``F8_E5M2FNUZ``; they are included.

The other direction, ``numpy_to_safetensors_dtype``, covers ``BOOL, I8..I64, U8..U64, F16, F32, F64, C64``.

Only numpy is imported here.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

from ..lazynp import np  # numpy on first use: parsing a header needs only DTYPE_BITS

__all__ = ["f32_to_f16", "count_bit_pattern", "count_nonfinite", "DtypeSpec", "SAFETENSORS_DTYPES", "DTYPE_BITS", "RAW_DTYPES", "DTYPE_RANK", "numpy_to_safetensors_dtype",
           "f32_to_bf16_bits", "f16_to_bf16_bits", "bf16_bits_to_f32"]

class DtypeSpec(NamedTuple):
    """``bits`` per element and the little-endian numpy dtype ``get`` returns (None: sub-byte, raw bytes)."""

    bits: int
    numpy: np.dtype | None


# Every dtype safetensors 0.8 accepts, in the reference's enum order (increasing alignment): name, bits, the
# little-endian numpy dtype a reader returns (None: sub-byte).  ``SAFETENSORS_DTYPES`` maps each name to
# ``DtypeSpec(bits, numpy dtype)``; it is built on first use (module ``__getattr__``), so parsing a header
# (``DTYPE_BITS``) does not import numpy.
_TABLE = (
    ("BOOL", 8, '?'),
    ("F4", 4, None),
    ("F6_E2M3", 6, None),
    ("F6_E3M2", 6, None),
    ("U8", 8, 'u1'),
    ("I8", 8, 'i1'),
    ("F8_E5M2", 8, 'u1'),
    ("F8_E4M3", 8, 'u1'),
    ("F8_E8M0", 8, 'u1'),
    ("F8_E4M3FNUZ", 8, 'u1'),
    ("F8_E5M2FNUZ", 8, 'u1'),
    ("I16", 16, '<i2'),
    ("U16", 16, '<u2'),
    ("F16", 16, '<f2'),
    ("BF16", 16, '<u2'),
    ("I32", 32, '<i4'),
    ("U32", 32, '<u4'),
    ("F32", 32, '<f4'),
    ("C64", 64, '<c8'),
    ("F64", 64, '<f8'),
    ("I64", 64, '<i8'),
    ("U64", 64, '<u8'),
)

DTYPE_BITS: Mapping[str, int] = MappingProxyType({name: bits for name, bits, _ in _TABLE})
"""Bits per element of every dtype safetensors 0.8 accepts, in the reference's enum order (no numpy needed)."""


def __getattr__(name: str):
    # SAFETENSORS_DTYPES holds numpy dtypes: built (and numpy imported) on first use
    if name == "SAFETENSORS_DTYPES":
        table = MappingProxyType({n: DtypeSpec(bits, None if dt is None else np.dtype(dt)) for n, bits, dt in _TABLE})
        globals()[name] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


RAW_DTYPES = frozenset({"BF16", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
"""Dtypes numpy cannot represent: ``get`` returns their bits as unsigned ints of the same width."""

DTYPE_RANK = {name: i for i, (name, _, _) in enumerate(_TABLE)}
"""Position of each dtype in the reference's enum (its alignment order; the writer's ``order="safetensors"``)."""

_NUMPY_TO_ST = {
    ("b", 1): "BOOL",
    ("i", 1): "I8", ("i", 2): "I16", ("i", 4): "I32", ("i", 8): "I64",
    ("u", 1): "U8", ("u", 2): "U16", ("u", 4): "U32", ("u", 8): "U64",
    ("f", 2): "F16", ("f", 4): "F32", ("f", 8): "F64",
    ("c", 8): "C64",
}


def numpy_to_safetensors_dtype(dtype: Any) -> str | None:
    """The safetensors dtype string of a numpy dtype (None if safetensors has no equivalent)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    return _NUMPY_TO_ST.get((dt.kind, dt.itemsize))


# ------------------------------------------------------------------------------------------------
# bfloat16 <-> float32 bit patterns (BF16 travels as uint16 bits, see RAW_DTYPES)
# ------------------------------------------------------------------------------------------------

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays a (quiet) NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def f16_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float16 -> bfloat16 bits: the fp16 value (exact in float32) rounded once to 8 mantissa bits, RNE."""
    return f32_to_bf16_bits(np.asarray(x, dtype=np.float16).astype(np.float32))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 array -> float16, round to nearest even; values beyond the fp16 range become +-inf silently (the
    converters count the non-finite results and refuse or report them)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float16)


#: (mask, pattern) of the bits of a stored float that is NaN or +-inf: the exponent field all ones
_NONFINITE_BITS = {"F16": (0x7C00, 0x7C00, "uint16"), "BF16": (0x7F80, 0x7F80, "uint16"),
                   "F32": (0x7F800000, 0x7F800000, "uint32"), "F64": (0x7FF0000000000000, 0x7FF0000000000000, "uint64")}


def count_bit_pattern(a: np.ndarray, mask: int, pattern: int, chunk: int = 1 << 22) -> int:
    """How many elements of ``a`` (any shape; an unsigned integer array or one reinterpreted as one) have
    ``bits & mask == pattern``; in chunks of ``chunk`` elements, so at most a chunk's temporaries (a float16
    tensor's float32 copy for ``isfinite`` costs 2x the tensor and, as NumPy's float16 is emulated, far more time)."""
    flat = np.ascontiguousarray(a).reshape(-1)
    buf = np.empty(min(chunk, flat.size), dtype=flat.dtype)
    m, p = flat.dtype.type(mask), flat.dtype.type(pattern)
    n = 0
    for s in range(0, flat.size, chunk):
        b = buf[:min(chunk, flat.size - s)]
        np.bitwise_and(flat[s:s + chunk], m, out=b)
        n += int(np.count_nonzero(b == p))
    return n


def count_nonfinite(a: np.ndarray, st_dtype: str, chunk: int = 1 << 22) -> int:
    """NaN and +-inf values of a stored tensor (``st_dtype`` its safetensors dtype; BF16 held as its uint16 bits),
    in chunks of ``chunk`` elements: F16 / BF16 / F32 / F64 from their bit patterns, any other dtype by
    ``isfinite`` (0 for integers)."""
    if st_dtype in _NONFINITE_BITS:
        mask, pattern, bits = _NONFINITE_BITS[st_dtype]
        return count_bit_pattern(np.ascontiguousarray(a).view(bits), mask, pattern, chunk)
    flat = np.asarray(a).reshape(-1)
    return sum(int(c.size - np.count_nonzero(np.isfinite(c)))
               for c in (flat[i:i + chunk] for i in range(0, flat.size, chunk)))
