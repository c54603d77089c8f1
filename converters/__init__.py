"""Converters between weight formats (``exl2fmt.converters``).

Every conversion is a route of one table (``converters.registry``): a converter class or a driver registered
for one (source format, target) pair with ``register``; ``get`` looks a pair up and, for an unknown pair, raises
``Exl2Error(USAGE)`` listing the pairs that exist.  Registration of the same pair twice is a programming error
and raises at import time.  No dynamic plugin loading.  ``converters.routes`` runs a route
(``dispatch``), ``converters.options`` holds the options of each target and the checks that need no file.

Source formats are detected from the model (``exl2fmt.detect``): ``exl2``, ``gptq`` or ``dense``.  Targets are
``fp16``, ``bf16``, ``gptq`` and ``exl2``.  Registered pairs:

=================  =========================================================================================
``exl2 -> fp16``   bit-exact dequantization (ExLlamaV2's fp16 reconstruction), N/vocab padding removed
``exl2 -> bf16``   the fp16 reconstruction rounded to bfloat16 (round to nearest even)
``gptq -> fp16``   ``fp16(fp16(q - z) * scale)``; 2/3/4/8 bits, v1/v2 zeros, sym/asym, act-order, group -1
``gptq -> bf16``   the fp16 reconstruction rounded to bfloat16
``exl2 -> gptq``   exact wherever the math allows (groups of <= target bits embed with their scales), the rest
                   re-quantized with the best fp16 scale; the EXL2 permutation becomes act-order ``g_idx``
``gptq -> exl2``   the GPTQ integers kept as far as EXL2's 4-bit scale grid allows; error reported per layer
``dense -> fp16``  a cast (F16 kept bit for bit; BF16/F32 rounded, out-of-range values reported); ``-> bf16`` too
``dense -> exl2``  the calibrated quantizer (``exl2fmt.quant``): measurement, bit budget, sequential GPTQ
``dense -> gptq``  the same engine writing GPTQ (2/3/4/8 bits, group size, sym/asym, act-order)
``* -> gguf``      EXL2 / GPTQ / dense (Llama family) -> one GGUF file (``gguf_write``; exact repacks where possible)
``gguf -> fp16``   a ``.gguf`` file -> Hugging Face directory (``gguf_read``); ``-> bf16`` too
=================  =========================================================================================

Library entry point::

    from exl2fmt.converters import convert
    report = convert("Llama-exl2-4.0bpw", "Llama-fp16", "fp16")
    print(report.summary_lines())

Every conversion plans, runs and verifies (see ``exl2fmt.converters.base``): SRC is never modified, DST
appears only complete (temporary sibling + rename), an existing DST is replaced only with ``force``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from ..errors import ErrorCode, Exl2Error
from .options import DEFAULT_SHARD_SIZE, QUANT_FLAGS, VERIFY_MODES

if TYPE_CHECKING:  # annotations only: importing base here would load numpy and the codecs
    from ..quant.pipeline import QuantReport
    from .base import ConversionReport, Progress

__all__ = ["register", "get", "registered", "convert", "quantize", "ConversionReport", "LayerReport", "TARGETS",
           "DEFAULT_SHARD_SIZE", "VERIFY_MODES", "QUANT_FLAGS", "validate_quantized_output"]

_LAZY = {"ConversionReport": "base", "LayerReport": "base", "TARGETS": "base", "Options": "base",
         "register": "registry", "validate_quantized_output": "routes"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def registered() -> list[tuple[str, str]]:
    """Every (source, target) pair of the route table."""
    from .registry import registered_pairs
    from .routes import load_routes

    load_routes()
    return registered_pairs()


def get(source: str, target: str) -> Callable:
    """The converter class or driver of (``source``, ``target``), or ``Exl2Error(USAGE)`` listing the pairs that
    exist."""
    from .routes import get_route

    return get_route(source, target).run


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, force: bool = False,
            shard_size: int | str = DEFAULT_SHARD_SIZE, dtype: str | None = None, bits: int | None = None,
            group_size: int | None = None, sym: bool | None = None, progress: Progress | None = None,
            verify: str = "auto", gguf_type: str = "auto", quant: dict | None = None) -> "ConversionReport":
    """Convert the model at ``src`` (a model directory or one ``.safetensors`` file) into a new model
    directory ``dst`` in format ``to`` (``fp16``, ``bf16``, ``gptq``, ``exl2``).

    ``force``       replace an existing ``dst`` (only after the new one is complete and verified)
    ``shard_size``  maximum tensor bytes per output shard (int, or text such as ``"5GB"``, ``"2GiB"``)
    ``dtype``       dtype of the unquantized tensors of a GPTQ/EXL2 output (``fp16``/``bf16``; default: kept)
    ``bits``        GPTQ target bits (2/3/4/8, default 4) or EXL2 target bits (2/3/4/5/6/8, default: the
                    source's GPTQ bits)
    ``group_size``  GPTQ target group size (default: the largest of 128/64/32 that splits every EXL2 group, so
                    the conversion stays exact; -1 = one group) or EXL2 group size (default: the GPTQ one when
                    it is a multiple of 32, else 128)
    ``sym``         GPTQ target symmetric (default True; False writes v1 zeros clamped to >= 1)
    ``progress``    ``progress(done_bytes, total_bytes, what)``, called per unit written and verified
    ``gguf_type``   ``--to gguf``: ``auto`` (default), ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0`` (see
                    ``converters.gguf_write``); a ``.gguf`` SRC converts to ``fp16``/``bf16`` (``converters.gguf_read``)
    ``verify``      ``auto`` (default): the output is re-read through the reader and the validator, every tensor's
                    bytes are matched (Fletcher-64 checksum) against what was produced from the source, and the re-packing
                    conversions (to GPTQ / EXL2) decode every output layer and compare it with the source's
                    decode; ``full``: every unit is decoded again from SRC and compared element by element

    Returns a ``ConversionReport``; raises ``Exl2Error`` (USAGE for an unknown pair, listing what exists;
    OUTPUT_EXISTS; the reader's and validator's codes; REFERENCE_MISMATCH if the verify pass finds a claimed
    exact layer that is not).

    Example (the bundled sample model, EXL2 -> FP16, bit-exact)::

        >>> import pathlib, tempfile
        >>> from exl2fmt.converters import convert
        >>> from exl2fmt.sample import write_sample
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = write_sample(d / "exl2")
        >>> report = convert(d / "exl2", d / "fp16", "fp16")
        >>> report.source_format, report.target, report.verified
        ('exl2', 'fp16', True)
    """
    return _convert(src, dst, to, force=force, shard_size=shard_size, dtype=dtype, bits=bits, group_size=group_size,
                    sym=sym, progress=progress, verify=verify, gguf_type=gguf_type, quant=quant)


def quantize(src: str | os.PathLike, dst: str | os.PathLike, to: str = "exl2", *, bits: float | None = None,
             group_size: int | None = None, sym: bool | None = None, force: bool = False,
             shard_size: int | str = DEFAULT_SHARD_SIZE, progress: Progress | None = None,
             **options) -> "QuantReport":
    """Quantize the FP16/BF16 Hugging Face model at ``src`` into a new EXL2 or GPTQ model directory ``dst``
    (``exl2fmt convert --to exl2|gptq``): calibration, measurement, the bit budget, sequential GPTQ.

    ``to``          ``exl2`` (default) or ``gptq``
    ``bits``        EXL2: average bits per weight of the decoder linears (default 4.125); GPTQ: 2/3/4/8 (default 4)
    ``group_size``  GPTQ group size (default 128; -1 = one group); ``sym``: GPTQ symmetric (default True)
    ``options``     the quantizer's other options (``options.QUANT_OPTIONS``: ``head_bits``, ``calibration``,
                    ``rows``, ``length``, ``measurement``, ``save_measurement``, ``device``, ``seed``,
                    ``resume``, ``act_order``, ``order``, ``work_dir``, ``extended``, ``refine_scales``,
                    ``batch_tokens``, ``measure_rows``, ``measure_search``, ``measure_precision``)

    Needs the ``quant`` extra (torch, tokenizers).  The same as ``convert(src, dst, to, ..., quant=options)``
    with ``src`` required to be a dense model (or a ``.gguf`` file, decoded through FP16 first).  Returns the
    quantizer's ``QuantReport``; raises ``Exl2Error`` (USAGE for a quantized source or a bad option).

    Example (the trained tiny fixture of the test suite; a couple of minutes on a CPU, so not run as a
    doctest)::

        >>> from exl2fmt import quantize
        >>> rep = quantize("tests/fixtures/tiny-llama", "/tmp/tiny-exl2", "exl2", bits=4.0, rows=8,
        ...                length=128, device="cpu")  # doctest: +SKIP
        >>> rep.verified  # doctest: +SKIP
        True
    """
    target = str(to).strip().lower()
    if target not in ("exl2", "gptq"):
        raise Exl2Error(ErrorCode.USAGE, f"quantize writes exl2 or gptq, not {to!r} (convert changes formats)")
    # SRC is opened and detected once, by the route: a quantized source is refused there (needs_dense)
    return _convert(src, dst, target, force=force, shard_size=shard_size, bits=bits, group_size=group_size,
                    sym=sym, progress=progress, quant=options or None, needs_dense=True)


def _convert(src, dst, to, *, force: bool = False, shard_size: int | str = DEFAULT_SHARD_SIZE,
             dtype: str | None = None, bits=None, group_size=None, sym=None, progress=None, verify: str = "auto", gguf_type: str = "auto",
             quant: dict | None = None, needs_dense: bool = False):
    """Check the arguments (every one before DST is looked at: an invalid --bits is reported as such, not as
    OUTPUT_EXISTS) and run the route."""
    from .base import TARGETS, parse_size
    from .options import ALIASES, check_arguments, no_quantizer_options, normalize_target
    from .routes import Job, dispatch, fail_after_from_env

    if verify not in VERIFY_MODES:
        raise Exl2Error(ErrorCode.USAGE, f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    fail_after = fail_after_from_env()
    target = normalize_target(to)
    if target not in TARGETS:
        raise Exl2Error(ErrorCode.USAGE, f"unknown target {to!r}; expected one of {', '.join(TARGETS)}")
    size = parse_size(shard_size)
    check_arguments(target, bits, group_size, sym, dtype, gguf_type)
    if target not in ("exl2", "gptq"):
        no_quantizer_options(quant, f"--to {target} does not quantize")
    if dtype is not None:
        dtype = ALIASES.get(str(dtype).lower(), str(dtype).lower())
    return dispatch(Job(src, dst, target, force, size, dtype, bits, group_size, sym, progress, verify, gguf_type,
                        quant, fail_after=fail_after, needs_dense=needs_dense))
