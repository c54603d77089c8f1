"""The on-disk layouts of a quantized linear layer, as data.

This module is the single place that spells the per-layer tensor names (``q_weight``, ``qweight``,
``weight`` ...).  Reader, writer, validator, detector, inspector and bpw accounting all read the
tables below; ``spec/layout.json`` is generated from them (``python -m exl2fmt.layout``) and a test
fails when the checked-in copy drifts.

Conventions (see spec/exl2.md):

* ``K`` = in_features, ``N`` = out_features, ``N_pad`` = N rounded up to a multiple of 32.
* EXL2 stores a K x N_pad matrix (input rows x output columns), the transpose of ``nn.Linear.weight``.
* Row ``k`` of an EXL2 layer is a *stored* (act-order permuted) row; ``q_invperm[j]`` is the stored row of
  original input feature ``j``.
"""

from __future__ import annotations

import collections
import enum
import itertools
import json
import math
import operator
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "Format", "SlotStatus", "TensorSlot", "SlotName", "Exl2Slot", "GptqSlot", "DenseSlot",
    "AwqSlot", "Exl3Slot", "BitWidth", "BIT_WIDTHS", "EXL2_BITS", "GPTQ_BITS",
    "Exl2Geometry", "GptqGeometry", "DenseGeometry", "LAYOUTS", "Tier", "plan_rows", "plan_desc",
    "stored_bits", "bpw", "exl2_total_bits", "pad32", "scale_ratio", "SCALE_DIVISOR",
    "ROW_MULTIPLE", "N_PAD_MULTIPLE", "MAX_K", "MAX_INT16", "FORMAT_VERSION", "layout_document",
    "AwqGeometry", "Exl3Geometry", "RECOGNISED_LAYOUTS", "ALL_LAYOUTS", "SLOT_NAMES", "slot", "marker_slot",
    "slot_names", "DETECTION_ORDER", "STAYS_16BIT", "stays_16bit", "counts_in_decoder_bpw",
    "EXL3_PAD", "EXL3_RATES", "EXL3_HALF_RATES", "EXL3_RATE_OF_LAST_DIM", "EXL3_MARKER_VALUES", "EXL3_CODEBOOKS",
    "pad128",
]

#: Version of the format description in this module (spec/exl2.md "Versioning").  Independent of the
#: tool's version: it changes only when the set of recognised layouts changes.
FORMAT_VERSION = "1.0"

#: Every EXL2 group holds a multiple of this many input rows (spec rule G4).
ROW_MULTIPLE = 32
#: q_weight / q_scale / bias columns are N padded to a multiple of this.
N_PAD_MULTIPLE = 32
#: Permutations are uint16 on the GPU, so K <= 65536 (spec rule L1).
MAX_K = 65536
#: q_groups values are int16 in the file and handled with signed 16-bit arithmetic by the loader.
MAX_INT16 = 32767
#: Dequantization scale s = (c + 1)^2 * q_scale_max / SCALE_DIVISOR.
SCALE_DIVISOR = 256
#: Number of bits in one scale code c.
SCALE_CODE_BITS = 4


class Format(str, enum.Enum):
    """Storage format of one linear layer.  Values are stable strings used in JSON output.

    EXL2, GPTQ, DENSE and EXL3 are decoded (``LAYOUTS``); AWQ is recognised and named only
    (``RECOGNISED_LAYOUTS``).  A member hashes like its value, so ``"exl2"`` finds ``Format.EXL2`` in a dict."""

    EXL2 = "exl2"
    """ExLlamaV2 mixed-bitrate GPTQ: q_weight / q_scale / q_scale_max / q_groups / q_invperm."""
    GPTQ = "gptq"
    """GPTQ (AutoGPTQ / GPTQModel): qweight packed along K, qzeros packed along N, scales, g_idx."""
    DENSE = "dense"
    """Unquantized ``weight`` [N, K] in F16 / BF16 / F32 (``nn.Linear`` orientation)."""
    AWQ = "awq"
    """AWQ (AutoAWQ "GEMM"): recognised only, never decoded."""
    EXL3 = "exl3"
    """EXL3 (ExLlamaV3): trellis-coded 16x16 tiles, suh / svh (or legacy su / sv), codebook markers mcg / mul1."""

    __hash__ = str.__hash__


class SlotStatus(str, enum.Enum):
    REQUIRED = "required"
    """Must be present in the file."""
    OPTIONAL = "optional"
    """May be present (bias, q_perm, g_idx); checked when present."""
    DERIVED = "derived"
    """Never stored: computed by loaders (q_group_map).  Present in a file it is ignored."""
    REFUSED = "refused"
    """A legacy tensor exl2fmt recognises and refuses (EXL3's pre-suh per-tensor ``scale``): a layer that has it
    is not decoded (FORMAT_UNSUPPORTED)."""


# ---------------------------------------------------------------------------------------------------
# Bit widths
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BitWidth:
    """Packing unit of one EXL2 bit width.

    ``rows_per_unit`` consecutive rows of one column are packed into ``words_per_unit`` consecutive int32
    rows of the same column, as a little-endian bit string: row t of the unit occupies bits
    [t*bits, t*bits + bits).  Values of 3, 5 and 6 bits may straddle two words (low bits in the lower word).
    """

    bits: int
    rows_per_unit: int
    words_per_unit: int

    @property
    def zero_point(self) -> int:
        """Implicit zero point z_b = 2^(b-1); codes are unsigned in [0, 2^b - 1]."""
        return 1 << (self.bits - 1)

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1


BIT_WIDTHS: dict[int, BitWidth] = {
    b.bits: b
    for b in (
        BitWidth(2, 16, 1),
        BitWidth(3, 32, 3),
        BitWidth(4, 8, 1),
        BitWidth(5, 32, 5),
        BitWidth(6, 16, 3),
        BitWidth(8, 4, 1),
    )
}
#: EXL2 bit widths, in the order the loader expects tiers (descending).
EXL2_BITS: tuple[int, ...] = (8, 6, 5, 4, 3, 2)
#: GPTQ bit widths exl2fmt reads and writes (32 codes -> b words along the packed axis).
GPTQ_BITS: tuple[int, ...] = (2, 3, 4, 8)


def pad32(n: int) -> int:
    """Round ``n`` up to a multiple of 32 (N_pad)."""
    return (n + N_PAD_MULTIPLE - 1) // N_PAD_MULTIPLE * N_PAD_MULTIPLE


def scale_ratio(code: int) -> float:
    """(c + 1)^2 / 256: the factor a 4-bit scale code c applies to q_scale_max."""
    return (code + 1) ** 2 / SCALE_DIVISOR


# ---------------------------------------------------------------------------------------------------
# Geometries: the numbers a layer's shapes are functions of
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exl2Geometry:
    """K input rows, N_pad padded output columns, G groups, Q packed int32 rows (= sum r_g * b_g / 32)."""

    K: int
    N_pad: int
    G: int
    Q: int


@dataclass(frozen=True)
class GptqGeometry:
    """K input rows, N output columns, ``bits`` per code, G groups."""

    K: int
    N: int
    bits: int
    G: int


@dataclass(frozen=True)
class DenseGeometry:
    K: int
    N: int


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a layer: ``<key>.<name>``.

    ``dtypes``  safetensors dtype strings accepted on read; the first is what writers emit.
    ``shape``   shape as a function of the layer geometry.
    """

    name: SlotName
    dtypes: tuple[str, ...]
    shape: Callable[[object], tuple[int, ...]]
    status: SlotStatus
    description: str
    shape_text: str

    @property
    def write_dtype(self) -> str:
        return self.dtypes[0]


class SlotName(str, enum.Enum):
    """Base of the per-format slot-name enums: a member *is* its tensor suffix (``str``, ``format`` and
    ``==`` all give the plain name), so ``f"{key}.{Exl2Slot.Q_WEIGHT}"`` is the tensor's full name.
    Every other module names a slot through these members, never by a string literal."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__


class Exl2Slot(SlotName):
    Q_WEIGHT = "q_weight"
    Q_SCALE = "q_scale"
    Q_SCALE_MAX = "q_scale_max"
    Q_GROUPS = "q_groups"
    Q_INVPERM = "q_invperm"
    Q_PERM = "q_perm"
    BIAS = "bias"
    Q_GROUP_MAP = "q_group_map"


class GptqSlot(SlotName):
    QWEIGHT = "qweight"
    QZEROS = "qzeros"
    SCALES = "scales"
    G_IDX = "g_idx"
    BIAS = "bias"


class DenseSlot(SlotName):
    WEIGHT = "weight"
    BIAS = "bias"


class AwqSlot(SlotName):
    QWEIGHT = "qweight"
    QZEROS = "qzeros"
    SCALES = "scales"
    BIAS = "bias"


class Exl3Slot(SlotName):
    TRELLIS = "trellis"
    SUH = "suh"
    SVH = "svh"
    SU = "su"
    SV = "sv"
    MCG = "mcg"
    MUL1 = "mul1"
    BIAS = "bias"
    SCALE = "scale"


_R, _O, _D = SlotStatus.REQUIRED, SlotStatus.OPTIONAL, SlotStatus.DERIVED

EXL2_SLOTS: tuple[TensorSlot, ...] = (
    TensorSlot(Exl2Slot.Q_WEIGHT, ("I32",), lambda g: (g.Q, g.N_pad), _R,
               "packed codes, per-column little-endian bit string per unit, stored (permuted) row order, tiers by "
               "descending bits", "(Q, N_pad)"),
    TensorSlot(Exl2Slot.Q_SCALE, ("I32",), lambda g: (g.G, g.N_pad // 8), _R,
               "4-bit scale codes c = qscale - 1, column 8m+i in bits [4i, 4i+4) of word m", "(G, N_pad/8)"),
    TensorSlot(Exl2Slot.Q_SCALE_MAX, ("F16",), lambda g: (g.G,), _R,
               "per-group maximum scale; s = (c + 1)^2 * q_scale_max / 256", "(G,)"),
    TensorSlot(Exl2Slot.Q_GROUPS, ("I16",), lambda g: (2 * g.G,), _R,
               "pairs (bits_g, first q_weight row of group g)", "(2G,)"),
    TensorSlot(Exl2Slot.Q_INVPERM, ("I32", "I16"), lambda g: (g.K,), _R,
               "q_invperm[j] = stored row holding original input feature j", "(K,)"),
    TensorSlot(Exl2Slot.Q_PERM, ("I32", "I16"), lambda g: (g.K,), _O,
               "argsort(q_invperm); never written by ExLlamaV2 and ignored by its loader", "(K,)"),
    TensorSlot(Exl2Slot.BIAS, ("F16",), lambda g: (g.N_pad,), _O, "bias, zero-padded to N_pad", "(N_pad,)"),
    TensorSlot(Exl2Slot.Q_GROUP_MAP, ("I16",), lambda g: (2 * g.K,), _D,
               "load-time (group, rows left) per stored row; never stored", "(2K,)"),
)

GPTQ_SLOTS: tuple[TensorSlot, ...] = (
    TensorSlot(GptqSlot.QWEIGHT, ("I32",), lambda g: (g.K * g.bits // 32, g.N), _R,
               "codes packed along K: 32 consecutive rows -> `bits` words, little-endian bit string", "(K*b/32, N)"),
    TensorSlot(GptqSlot.QZEROS, ("I32",), lambda g: (g.G, g.N * g.bits // 32), _R,
               "zero points packed along N like qweight; v1 ('gptq') stores z-1, v2 ('gptq_v2') stores z",
               "(G, N*b/32)"),
    TensorSlot(GptqSlot.SCALES, ("F16", "BF16", "F32"), lambda g: (g.G, g.N), _R, "per-group, per-column scales", "(G, N)"),
    TensorSlot(GptqSlot.G_IDX, ("I32",), lambda g: (g.K,), _O, "group of each input row (original order)", "(K,)"),
    TensorSlot(GptqSlot.BIAS, ("F16", "BF16", "F32"), lambda g: (g.N,), _O, "bias", "(N,)"),
)

DENSE_SLOTS: tuple[TensorSlot, ...] = (
    TensorSlot(DenseSlot.WEIGHT, ("F16", "BF16", "F32"), lambda g: (g.N, g.K), _R, "nn.Linear weight", "(N, K)"),
    TensorSlot(DenseSlot.BIAS, ("F16", "BF16", "F32"), lambda g: (g.N,), _O, "bias", "(N,)"),
)

# ---------------------------------------------------------------------------------------------------
# EXL3 (ExLlamaV3): QTIP-style trellis codes with Hadamard rotations (spec/exl3.md)
# ---------------------------------------------------------------------------------------------------

#: EXL3 pads both dimensions of a layer to a multiple of this (the 128-wide Hadamard blocks).
EXL3_PAD = 128
#: Every rate (bits per weight of the trellis) exllamav3 reads: whole 1..8 and the half rates 1.5 / 2.5 / 3.5.
EXL3_RATES: tuple[float | int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5)
#: The half rates, which exllamav3 decodes only with the mul1 codebook.
EXL3_HALF_RATES: tuple[float, ...] = (1.5, 2.5, 3.5)
#: trellis last dimension (16 * rate uint16 words per 16 x 16 tile) -> rate.
EXL3_RATE_OF_LAST_DIM: dict[int, float | int] = {int(16 * r): r for r in EXL3_RATES}
#: Codebook marker scalars (I32, shape []): slot -> the value it must hold (the uint32 multiplier viewed as int32).
EXL3_MARKER_VALUES: dict[str, int] = {"mcg": 0xCBAC1FED - (1 << 32), "mul1": 0x83DCD12D - (1 << 32)}
#: Codebook names: no marker -> 3inst, ``mcg`` -> mcg, ``mul1`` -> mul1.
EXL3_CODEBOOKS: tuple[str, ...] = ("3inst", "mcg", "mul1")


def pad128(n: int) -> int:
    """Round ``n`` up to a multiple of 128 (EXL3's padded K_p / N_p)."""
    return (n + EXL3_PAD - 1) // EXL3_PAD * EXL3_PAD


@dataclass(frozen=True)
class Exl3Geometry:
    """EXL3 layer: K input rows, N output columns, K_p / N_p the padded sizes (multiples of 128, less than 128
    above K / N), ``bits`` the trellis rate (an ``EXL3_RATES`` member)."""

    K: int
    N: int
    K_p: int
    N_p: int
    bits: float | int


EXL3_SLOTS: tuple[TensorSlot, ...] = (
    TensorSlot(Exl3Slot.TRELLIS, ("I16",), lambda g: (g.K_p // 16, g.N_p // 16, int(16 * g.bits)), _R,
               "16x16 tiles, each a tail-biting bit ring of 256 * rate bits (rate = last dim / 16: 1..8, 1.5, "
               "2.5, 3.5)", "(K_p/16, N_p/16, 16*rate)"),
    TensorSlot(Exl3Slot.SUH, ("F16",), lambda g: (g.K_p,), _O,
               "input-side signs x scales; required unless the legacy su is present", "(K_p,)"),
    TensorSlot(Exl3Slot.SVH, ("F16",), lambda g: (g.N_p,), _O,
               "output-side signs x scales; required unless the legacy sv is present", "(N_p,)"),
    TensorSlot(Exl3Slot.SU, ("I16",), lambda g: (g.K_p // 16,), _O,
               "legacy input-side signs, 16 per word LSB first, set bit = -1 (instead of suh)", "(K_p/16,)"),
    TensorSlot(Exl3Slot.SV, ("I16",), lambda g: (g.N_p // 16,), _O,
               "legacy output-side signs, packed like su (instead of svh)", "(N_p/16,)"),
    TensorSlot(Exl3Slot.MCG, ("I32",), lambda g: (), _O,
               "codebook marker: mcg, value 0xCBAC1FED as int32; at most one marker", "()"),
    TensorSlot(Exl3Slot.MUL1, ("I32",), lambda g: (), _O,
               "codebook marker: mul1, value 0x83DCD12D as int32; required at the half rates", "()"),
    TensorSlot(Exl3Slot.BIAS, ("F16", "F32"), lambda g: (g.N_p,), _O,
               "bias (F32 is cast to F16), N_p or N long; trimmed to N", "(N_p,) or (N,)"),
    TensorSlot(Exl3Slot.SCALE, ("F16", "F32"), lambda g: (), SlotStatus.REFUSED,
               "pre-suh per-tensor scale of early EXL3 files; exllamav3 1.6.5 ignores it, so its weight is "
               "ambiguous: refused", "()"),
)

#: The layout table: format -> slots.  The first REQUIRED slot is the one that identifies the format.
LAYOUTS: dict[Format, tuple[TensorSlot, ...]] = {
    Format.EXL2: EXL2_SLOTS,
    Format.GPTQ: GPTQ_SLOTS,
    Format.DENSE: DENSE_SLOTS,
    Format.EXL3: EXL3_SLOTS,
}

#: Detection precedence (ExLlamaV2 ``load_weight`` checks q_weight, then qweight, then weight; EXL3's trellis
#: comes before weight, as in the detector).
DETECTION_ORDER: tuple[Format, ...] = (Format.EXL2, Format.GPTQ, Format.EXL3, Format.DENSE)


# ---------------------------------------------------------------------------------------------------
# Recognised-only layouts: named by the detector and the inspector, never decoded
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AwqGeometry:
    """AWQ "GEMM" layer: K input rows, N output columns, ``bits`` per code, G groups of contiguous rows."""

    K: int
    N: int
    bits: int
    G: int


#: AWQ (AutoAWQ "GEMM"): the same tensor names as GPTQ, but qweight is packed along N (interleaved column
#: order 0,2,4,6,1,3,5,7 within a 4-bit word), qzeros stores z (no -1) and there is no g_idx.  Told apart from
#: GPTQ by shapes: AWQ qweight has K rows and N*b/32 columns, GPTQ qweight has K*b/32 rows and N columns.
AWQ_SLOTS: tuple[TensorSlot, ...] = (
    TensorSlot(AwqSlot.QWEIGHT, ("I32",), lambda g: (g.K, g.N * g.bits // 32), _R,
               "codes packed along N, interleaved column order within a word", "(K, N*b/32)"),
    TensorSlot(AwqSlot.QZEROS, ("I32",), lambda g: (g.G, g.N * g.bits // 32), _R,
               "zero points z packed along N like qweight", "(G, N*b/32)"),
    TensorSlot(AwqSlot.SCALES, ("F16", "BF16", "F32"), lambda g: (g.G, g.N), _R, "per-group, per-column scales", "(G, N)"),
    TensorSlot(AwqSlot.BIAS, ("F16", "BF16", "F32"), lambda g: (g.N,), _O, "bias", "(N,)"),
)

#: Layouts exl2fmt recognises and names but does not decode or fully validate, keyed by the stable format
#: string used in JSON output.  The first REQUIRED slot identifies the format (for AWQ it is shared with GPTQ;
#: the shapes decide).
RECOGNISED_LAYOUTS: dict[Format, tuple[TensorSlot, ...]] = {
    Format.AWQ: AWQ_SLOTS,
}

#: Every layout, decoded or recognised: format -> slots.
ALL_LAYOUTS: dict[Format, tuple[TensorSlot, ...]] = {**LAYOUTS, **RECOGNISED_LAYOUTS}

#: Per-format slot-name enum: ``SLOT_NAMES[Format.GPTQ].QWEIGHT``.
SLOT_NAMES: dict[Format, type[SlotName]] = {
    Format.EXL2: Exl2Slot, Format.GPTQ: GptqSlot, Format.DENSE: DenseSlot, Format.AWQ: AwqSlot,
    Format.EXL3: Exl3Slot,
}


def slot(fmt: Format, name: str) -> TensorSlot:
    for s in ALL_LAYOUTS[fmt]:
        if s.name == name:
            return s
    raise KeyError(f"{fmt.value} has no slot {name!r}")


def marker_slot(fmt: Format) -> SlotName:
    """The tensor suffix whose presence identifies ``fmt`` (AWQ shares GPTQ's ``qweight``; shapes decide)."""
    return next(s.name for s in ALL_LAYOUTS[fmt] if s.status is SlotStatus.REQUIRED)


def slot_names(fmt: Format, *, derived: bool = True) -> tuple[SlotName, ...]:
    """The slot names of ``fmt`` in table order; ``derived=False`` leaves out slots that are never stored."""
    return tuple(s.name for s in ALL_LAYOUTS[fmt] if derived or s.status is not SlotStatus.DERIVED)


def all_slot_names() -> frozenset[str]:
    return frozenset(s.name for slots in LAYOUTS.values() for s in slots)


_DTYPE_BITS = {"I32": 32, "I16": 16, "F16": 16, "BF16": 16, "F32": 32}


def stored_bits(fmt: Format, geometry, present: dict[str, str]) -> int:
    """Exact number of bits the stored tensors of one layer occupy.

    ``present`` maps slot name -> safetensors dtype of each slot actually stored (derived slots ignored).
    """
    total = 0
    for s in LAYOUTS[fmt]:
        if s.status in (SlotStatus.DERIVED, SlotStatus.REFUSED) or s.name not in present:
            continue
        total += math.prod(s.shape(geometry)) * _DTYPE_BITS[present[s.name]]
    return total


def bpw(fmt: Format, geometry, present: dict[str, str]) -> float | None:
    """Bits per weight with all overhead, ExLlamaV2's convention (``QParams.total_bits`` / numel).

    numel = K * N_pad (+ N_pad with a bias) for EXL2, K * N (+ N) for GPTQ, dense and EXL3 layers (EXL3's
    padding to K_p x N_p, its suh / svh and markers are overhead; its bias is counted N_p long here).  None for a layer of
    no weights (0 rows or 0 columns: an invalid layer that inspect still lists, issue 41).
    """
    if fmt is Format.EXL2:
        n = geometry.N_pad
    else:  # EXL3: the true N, so that the padding counts as overhead
        n = geometry.N
    numel = geometry.K * n + (n if Exl2Slot.BIAS in present else 0)
    if numel <= 0:
        return None
    return stored_bits(fmt, geometry, present) / numel


# ---------------------------------------------------------------------------------------------------
# Which linears count in the decoder bpw
# ---------------------------------------------------------------------------------------------------

#: Decoder-block modules that stay 16-bit by convention, as dotted name suffixes of the module (the key without
#: ``.weight``).  ExLlamaV2 never quantizes them and leaves them out of its bpw budget (its MoE block's size is
#: the experts' alone); they are a tiny part of a layer at real sizes (a router is E x H).  One definition for
#: the quantizer (never quantized, not in the budget), ``inspect`` (``bpw.decoder`` leaves them out,
#: ``bpw.decoder_incl_16bit`` counts them) and ``validate`` (the ``bits`` check).
STAYS_16BIT: tuple[str, ...] = (
    "block_sparse_moe.gate",            # Mixtral, PhiMoE: the router
    "mlp.gate",                         # Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek: the router
    "mlp.shared_expert_gate",           # Qwen2-MoE: the shared expert's sigmoid gate (N = 1)
    "mlp.router",                       # gpt-oss
    "feed_forward.router",              # Jamba
    "block_sparse_moe.router.layer",    # GraniteMoE
)


def stays_16bit(key: str) -> bool:
    """True when module ``key`` (``model.layers.3.mlp.gate``; no ``.weight``) is one of ``STAYS_16BIT``."""
    return any(key == s or key.endswith("." + s) for s in STAYS_16BIT)


def counts_in_decoder_bpw(key: str, fmt: "Format | str") -> bool:
    """Whether a linear layer inside a decoder block counts in the decoder bpw: every one except a
    ``STAYS_16BIT`` module stored unquantized (``Format.DENSE``; a router some tool did quantize counts)."""
    return not (fmt == Format.DENSE and stays_16bit(key))


# ---------------------------------------------------------------------------------------------------
# Group plans (QParams): bit tiers with proportions and group sizes
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tier:
    """``proportion`` of the K stored rows at ``bits`` bits in groups of ``group_size`` rows."""

    proportion: float
    bits: int
    group_size: int


def plan_rows(K: int, tiers: tuple[Tier, ...] | list[Tier]) -> list[tuple[int, int]]:
    """Split K stored rows into groups, ExLlamaV2's way (``AdaptiveGPTQ.configure``).

    With R_0 = K: g_i = ceil(min(K * p_i, R_i) / gs_i) groups for tier i, R_{i+1} = R_i - g_i * gs_i;
    every group has gs_i rows except the last group of the layer, clipped to end at K.
    Returns [(bits, rows)] per group in stored order.  Raises ValueError if the tiers do not cover K.
    """
    groups: list[tuple[int, int]] = []
    remaining = K
    start = 0
    for t in tiers:
        if t.bits not in BIT_WIDTHS:
            raise ValueError(f"bit width {t.bits} is not one of {sorted(BIT_WIDTHS)}")
        if t.group_size <= 0:
            raise ValueError(f"group size {t.group_size} must be positive")
        count = math.ceil(min(K * t.proportion, remaining) / t.group_size)
        count = max(count, 0)
        for _ in range(count):
            if start >= K:
                break
            rows = min(t.group_size, K - start)
            groups.append((t.bits, rows))
            start += rows
        remaining -= count * t.group_size
    if start != K:
        raise ValueError(f"tiers cover {start} of {K} rows")
    return groups


def exl2_total_bits(K: int, N_pad: int, tiers, has_bias: bool = False) -> int:
    """``QParams.total_bits``: bits of a layer quantized with ``tiers`` (all overhead included)."""
    groups = plan_rows(K, tiers)
    G = len(groups)
    Q = sum(r * b for b, r in groups) // 32
    geom = Exl2Geometry(K=K, N_pad=N_pad, G=G, Q=Q)
    present = {s.name: s.write_dtype for s in EXL2_SLOTS if s.status is SlotStatus.REQUIRED}
    if has_bias:
        present[Exl2Slot.BIAS] = slot(Format.EXL2, Exl2Slot.BIAS).write_dtype
    return stored_bits(Format.EXL2, geom, present)


def plan_desc(bits_rows: list[tuple[int, int]]) -> str:
    """Describe per-group (bits, rows) in ExLlamaV2's notation, e.g. ``0.05:8b_32g/0.95:4b_128g``.

    Proportions are the actual fraction of rows at each width; the group size is the most common group row
    count of that width (the layer's last group may be shorter).
    """
    K = sum(r for _, r in bits_rows)
    if K == 0:
        return ""
    parts = []
    for b, run in itertools.groupby(bits_rows, key=operator.itemgetter(0)):  # consecutive groups of one width
        rs = [r for _, r in run]
        gs = max(collections.Counter(rs).items(), key=lambda kv: (kv[1], kv[0]))[0]
        parts.append(f"{_fmt_prop(sum(rs) / K)}:{b}b_{gs}g")
    return "/".join(parts)


def _fmt_prop(p: float) -> str:
    if p >= 0.9999:
        return "1"
    s = f"{p:.3f}".rstrip("0")
    if s.endswith("."):
        s += "0"
    return s


# ---------------------------------------------------------------------------------------------------
# Machine-readable dump (spec/layout.json)
# ---------------------------------------------------------------------------------------------------


def layout_document() -> dict:
    """The layout table as JSON-able data; ``spec/layout.json`` must equal this."""
    return {
        "format_version": FORMAT_VERSION,
        "conventions": {
            "K": "in_features", "N": "out_features", "N_pad": "N rounded up to a multiple of 32",
            "Q": "packed int32 rows of q_weight = sum over groups of rows_g * bits_g / 32",
            "G": "number of groups",
        },
        "bit_widths": [
            {"bits": b.bits, "rows_per_unit": b.rows_per_unit, "words_per_unit": b.words_per_unit,
             "zero_point": b.zero_point}
            for b in (BIT_WIDTHS[x] for x in sorted(BIT_WIDTHS))
        ],
        "exl2_tier_order": list(EXL2_BITS),
        "gptq_bits": list(GPTQ_BITS),
        "exl3": {"pad_multiple": EXL3_PAD, "rates": list(EXL3_RATES), "half_rates_need": "mul1",
                 "trellis_last_dim": {str(d): r for d, r in sorted(EXL3_RATE_OF_LAST_DIM.items())},
                 "marker_values": dict(EXL3_MARKER_VALUES), "codebooks": list(EXL3_CODEBOOKS),
                 "codebook_rule": "no marker: 3inst; mcg: mcg; mul1: mul1; at most one marker",
                 "conventions": {"K_p": "K rounded up to a multiple of 128", "N_p": "N rounded up to a multiple "
                                 "of 128", "rate": "trellis last dim / 16"}},
        "scale_rule": "s[g][n] = (c[g][n] + 1)^2 * q_scale_max[g] / 256, rounded as fp16(fp16((c+1)^2) * fp16(q_scale_max / 256))",
        "dequant_rule": "w = fp16(fp16(q - 2^(b-1)) * s); W[q_perm[k]][n] = w(k, n); nn.Linear.weight = W[:, :N].T",
        "limits": {"row_multiple": ROW_MULTIPLE, "n_pad_multiple": N_PAD_MULTIPLE, "max_K": MAX_K,
                   "max_int16": MAX_INT16, "scale_divisor": SCALE_DIVISOR, "scale_code_bits": SCALE_CODE_BITS},
        "detection_order": [f.value for f in DETECTION_ORDER],
        "stays_16bit": {"modules": list(STAYS_16BIT), "rule": "a dense (16-bit) decoder-block module whose key ends "
                        "with one of these dotted names is left out of the decoder bpw (inspect, validate, the "
                        "quantizer's budget)"},
        "layouts": {
            fmt.value: [
                {"name": s.name, "dtypes": list(s.dtypes), "shape": s.shape_text, "status": s.status.value,
                 "description": s.description}
                for s in slots
            ]
            for fmt, slots in LAYOUTS.items()
        },
        "recognised_only": {
            fmt.value: [
                {"name": s.name, "dtypes": list(s.dtypes), "shape": s.shape_text, "status": s.status.value,
                 "description": s.description}
                for s in slots
            ]
            for fmt, slots in RECOGNISED_LAYOUTS.items()
        },
    }


if __name__ == "__main__":  # python -m exl2fmt.layout > spec/layout.json
    print(json.dumps(layout_document(), indent=2))
