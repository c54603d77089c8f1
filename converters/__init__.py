"""Converters between weight formats (``exl2fmt.converters``).

A converter is registered for one (source format, target) pair with ``@register``; ``get`` looks a pair up
and, for an unknown pair, raises ``Exl2Error(USAGE)`` listing the pairs that exist.  Registration of the same
pair twice is a programming error and raises at import time.  No dynamic plugin loading.

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

if TYPE_CHECKING:  # annotations only: importing base here would load numpy and the codecs
    from ..quant.report import QuantReport
    from .base import ConversionReport, Progress

__all__ = ["register", "get", "registered", "convert", "quantize", "ConversionReport", "LayerReport", "TARGETS",
           "DEFAULT_SHARD_SIZE", "VERIFY_MODES"]


def _load() -> None:
    """Import the converter modules (they register themselves).  Deferred so that importing this package, or
    ``exl2fmt.converters.cli`` for the CLI, costs nothing: numba, the codecs and the converters load on first
    use."""
    from . import exl2_to_gptq, gptq_to_exl2, to_dense  # noqa: F401


def registered() -> list[tuple[str, str]]:
    """Every (source, target) pair with a registered converter (the driver paths are in ``DRIVER_PATHS``)."""
    from .registry import registered_pairs

    _load()
    return registered_pairs()


def get(source: str, target: str) -> Callable:
    """The converter of (``source``, ``target``), or ``Exl2Error(USAGE)`` listing the pairs that exist."""
    from .registry import lookup

    _load()
    fn = lookup(source, target)
    if fn is None:
        have = ", ".join(f"{s}->{t}" for s, t in sorted(set(registered()) | set(DRIVER_PATHS))) or "none yet"
        raise Exl2Error(ErrorCode.USAGE, f"no converter from {source} to {target}; available: {have}")
    return fn


#: the paths with their own driver, not in the registry: the quantizer (dense -> exl2 / gptq), and the GGUF bridge
#: (any safetensors format -> one .gguf file; a .gguf file -> a Hugging Face directory, quantized through FP16)
DRIVER_PATHS = [("dense", "exl2"), ("dense", "gptq"), ("exl2", "gguf"), ("gptq", "gguf"), ("dense", "gguf"), ("gguf", "fp16"), ("gguf", "bf16"),
              ("gguf", "exl2"), ("gguf", "gptq")]


_LAZY = {"ConversionReport": "base", "LayerReport": "base", "TARGETS": "base", "DEFAULT_SHARD_SIZE": "base",
         "Options": "base", "register": "registry"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ALIASES = {"float16": "fp16", "half": "fp16", "f16": "fp16", "bfloat16": "bf16"}
#: ``convert(verify=...)``: ``auto`` (the default checks) or ``full`` (every unit decoded again from SRC)
VERIFY_MODES = ("auto", "full")
#: Test seam, not an option: with ``EXL2FMT_TEST_FAIL_AFTER=N`` in the environment a conversion raises
#: ``RuntimeError("injected ...")`` after writing N units (tests of the no-partial-output promise).
FAIL_AFTER_ENV = "EXL2FMT_TEST_FAIL_AFTER"
_DEFAULT_SHARD_SIZE = 5_000_000_000  # = base.DEFAULT_SHARD_SIZE (kept here so the signature needs no import)


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, force: bool = False,
            shard_size: int | str = _DEFAULT_SHARD_SIZE, dtype: str | None = None, bits: int | None = None,
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
    from ..container import open_model
    from ..detect import Verdict, detect_model
    from ..layout import Format
    from ..extras import require
    from ..container.publish import check_paths
    from .base import ConversionReport as Report
    from .base import parse_size, run_conversion

    from .base import TARGETS, Options

    if verify not in VERIFY_MODES:
        raise Exl2Error(ErrorCode.USAGE, f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    _fail_after = _test_fail_after()
    target = str(to).strip().lower()
    target = _ALIASES.get(target, target)
    if target not in TARGETS:
        raise Exl2Error(ErrorCode.USAGE, f"unknown target {to!r}; expected one of {', '.join(TARGETS)}")
    size = parse_size(shard_size)
    # every argument is checked before DST is looked at (an invalid --bits is reported as such, not as
    # OUTPUT_EXISTS), and the optional packages a path needs before any work (exit 3 with the pip command)
    _check_arguments(target, bits, group_size, sym, dtype, gguf_type)
    if target not in ("exl2", "gptq"):
        _no_quantizer_options(quant, f"--to {target} does not quantize")
    if dtype is not None:
        dtype = _ALIASES.get(str(dtype).lower(), str(dtype).lower())
    from ..inspect import is_gguf

    src_gguf = os.path.isfile(src) and is_gguf(src)
    if not os.path.lexists(src) and os.fspath(src).lower().endswith(".gguf"):
        raise Exl2Error(ErrorCode.PATH_NOT_FOUND, "no such GGUF file", file=os.fspath(src))
    if src_gguf and target == "gguf":
        raise Exl2Error(ErrorCode.USAGE, "converting a GGUF file into another GGUF file (re-quantizing) is not "
                        "supported: use llama.cpp's llama-quantize for that, or decode it to a model directory "
                        f"first (exl2fmt convert {os.fspath(src)} DIR --to fp16) and convert DIR --to gguf")
    if target == "gguf" or src_gguf:  # the GGUF bridge has its own driver
        require("gguf", "converting to GGUF" if target == "gguf" else "reading a GGUF file")
        if target == "gguf":
            _no_quantizer_options(quant, "the target is gguf")
            from .gguf_write import convert_to_gguf

            return convert_to_gguf(src, dst, gguf_type=gguf_type, force=force, progress=progress, verify=verify,
                                   _fail_after=_fail_after)
        from .gguf_read import convert_from_gguf

        if target in ("exl2", "gptq"):
            require("quant", f"quantizing to {target.upper()}")
            return _gguf_to_quantized(src, dst, target, bits, group_size, sym, size, force, progress, quant)
        _no_quantizer_options(quant, "a GGUF file is decoded, not quantized")
        return convert_from_gguf(src, dst, target, force=force, shard_size=size, progress=progress, verify=verify,
                                 _fail_after=_fail_after)
    model = open_model(src)
    try:
        config = model.config
        from ..config_values import config_value_issues
        from ..detect import quantization_config

        bad_numbers = config_value_issues(config, quantization_config(config, model.root)[0], str(model.config_path))
        if bad_numbers:  # checked before any arithmetic on them (issue 11)
            raise bad_numbers[0].to_error()
        det = detect_model(model.tensors, config, root=model.root)
        fatal = [i for i in det.issues if i.code is ErrorCode.FORMAT_AMBIGUOUS]
        if fatal:
            raise fatal[0].to_error()
        fmt = det.format
        if fmt is Verdict.UNKNOWN:
            raise Exl2Error(ErrorCode.FORMAT_UNKNOWN, "no linear layer of a known format found", file=str(src))
        if fmt is Format.DENSE and target in ("exl2", "gptq"):
            require("quant", f"quantizing to {target.upper()}")
            model.close()
            from ..inspect import layer_order_key   # model order, blocks 0, 1, 2, ... 10 (not string order)

            return _quantize(src, dst, target, bits, group_size, sym, size, force, progress, quant,
                             linear_layers=sorted(det.layers, key=layer_order_key))
        _no_quantizer_options(quant, f"the source is {fmt.value}, not an FP16/BF16 model to quantize")
        if bits is not None and not float(bits).is_integer():
            raise Exl2Error(ErrorCode.USAGE, f"bits must be an integer for {fmt.value} -> {target}, got {bits!r}")
        if target == "exl2" and bits is not None and int(bits) not in (2, 3, 4, 5, 6, 8):
            raise Exl2Error(ErrorCode.USAGE, f"--bits for {fmt.value} -> exl2 must be 2, 3, 4, 5, 6 or 8, got {bits!r}")
        bits = None if bits is None else int(bits)
        cls = get(fmt.value, target)
        check_paths(_path(src), _path(dst), force)
    except BaseException:
        model.close()
        raise
    opts = Options(target=target, shard_size=size, dtype=dtype, bits=bits, group_size=group_size, sym=sym)
    report = Report(source=str(src), destination=str(dst), source_format=fmt.value, target=target,
                    options={"shard_size": size, "dtype": dtype, "bits": bits, "group_size": group_size, "sym": sym,
                             "force": force, "verify": verify})
    if fmt is Format.DENSE:
        report.linear_layers = len(det.layers)
    for i in det.issues:
        report.warnings.append(f"detect: [{i.code.value}] {i.message}")
    return run_conversion(cls, src, dst, opts, force=force, progress=progress, model=model, detection=det,
                          report=report, verify=verify, _fail_after=_fail_after)


def quantize(src: str | os.PathLike, dst: str | os.PathLike, to: str = "exl2", *, bits: float | None = None,
             group_size: int | None = None, sym: bool | None = None, force: bool = False,
             shard_size: int | str = _DEFAULT_SHARD_SIZE, progress: Progress | None = None,
             **options) -> "QuantReport":
    """Quantize the FP16/BF16 Hugging Face model at ``src`` into a new EXL2 or GPTQ model directory ``dst``
    (``exl2fmt convert --to exl2|gptq``): calibration, measurement, the bit budget, sequential GPTQ.

    ``to``          ``exl2`` (default) or ``gptq``
    ``bits``        EXL2: average bits per weight of the decoder linears (default 4.125); GPTQ: 2/3/4/8 (default 4)
    ``group_size``  GPTQ group size (default 128; -1 = one group); ``sym``: GPTQ symmetric (default True)
    ``options``     the quantizer's other options (``QUANT_FLAGS``: ``head_bits``, ``calibration``, ``rows``,
                    ``length``, ``measurement``, ``save_measurement``, ``device``, ``seed``, ``resume``,
                    ``act_order``, ``work_dir``, ``extended``, ``refine_scales``)

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
    if not (os.path.isfile(src) and str(src).lower().endswith(".gguf")):
        from ..container import open_model
        from ..detect import detect_model
        from ..layout import Format

        model = open_model(src)
        try:
            fmt = detect_model(model.tensors, model.config, root=model.root).format
        finally:
            model.close()
        if fmt is not Format.DENSE:
            raise Exl2Error(ErrorCode.USAGE, f"quantize needs an FP16/BF16 model; the source is {fmt.value} "
                            f"(convert re-packs quantized models)", file=str(src))
    return convert(src, dst, target, force=force, shard_size=shard_size, bits=bits, group_size=group_size,
                   sym=sym, progress=progress, quant=options or None)


#: the quantizer's options (``quant=``) by the command-line flag that sets them, for messages
QUANT_FLAGS = {"head_bits": "--head-bits", "calibration": "--calibration", "rows": "--rows", "length": "--length",
               "measurement": "--measurement", "save_measurement": "--save-measurement", "device": "--device",
               "seed": "--seed", "resume": "--resume", "act_order": "--act-order/--no-act-order",
               "work_dir": "--work-dir", "extended": "--upstream-tables",
               "refine_scales": "--refine-scales/--upstream-scales"}


def _no_quantizer_options(quant: dict | None, why: str) -> None:
    given = sorted(k for k, v in (quant or {}).items() if v is not None)
    if given:
        flags = ", ".join(QUANT_FLAGS.get(k, k) for k in given)
        raise Exl2Error(ErrorCode.USAGE, f"{flags} only appl{'ies' if len(given) == 1 else 'y'} when quantizing an "
                        f"FP16/BF16 model (--to exl2 or gptq); {why}")


def _check_arguments(target: str, bits, group_size, sym, dtype, gguf_type) -> None:
    """The checks that need no file: types, ranges, and options that do not apply to ``target``."""
    if bits is not None:
        if isinstance(bits, bool) or not isinstance(bits, (int, float)):
            raise Exl2Error(ErrorCode.USAGE, f"bits must be a number, got {bits!r}")
        if target not in ("exl2", "gptq"):
            raise Exl2Error(ErrorCode.USAGE, f"--bits applies only to --to exl2 or gptq, not --to {target}")
        if target == "gptq" and float(bits) not in (2.0, 3.0, 4.0, 8.0):
            raise Exl2Error(ErrorCode.USAGE, f"--bits for --to gptq must be 2, 3, 4 or 8, got {bits!r}")
        if target == "exl2" and not (2.0 <= float(bits) <= 8.5):
            raise Exl2Error(ErrorCode.USAGE, f"--bits for --to exl2 must lie in [2, 8.5], got {bits!r}")
    if group_size is not None:
        if target not in ("exl2", "gptq"):
            raise Exl2Error(ErrorCode.USAGE, f"--group-size applies only to --to exl2 or gptq, not --to {target}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or \
                (group_size != -1 and (group_size <= 0 or group_size % 32)) or (target == "exl2" and group_size == -1):
            raise Exl2Error(ErrorCode.USAGE, f"--group-size must be a positive multiple of 32"
                            f"{' or -1' if target == 'gptq' else ''}, got {group_size!r}")
    if sym is not None and target != "gptq":
        raise Exl2Error(ErrorCode.USAGE, f"--sym/--asym applies only to --to gptq, not --to {target}")
    if dtype is not None:
        d = _ALIASES.get(str(dtype).lower(), str(dtype).lower())
        if d not in ("fp16", "bf16"):
            raise Exl2Error(ErrorCode.USAGE, f"dtype must be fp16 or bf16, got {dtype!r}")
        if target not in ("exl2", "gptq"):
            raise Exl2Error(ErrorCode.USAGE, f"--dtype applies only to --to exl2 or gptq (the unquantized tensors); "
                            f"--to {target} already names the dtype")
    if gguf_type not in (None, "auto") and target != "gguf":
        raise Exl2Error(ErrorCode.USAGE, f"--gguf-type applies only to --to gguf, not --to {target}")


def validate_quantized_output(path) -> None:
    """The quantizer's staged output must pass the deep validator (``quantize_model(verify_output=)``): the first
    failing check is ``Exl2Error(REFERENCE_MISMATCH)`` naming it."""
    from ..validate import validate_model

    rep = validate_model(path, deep=True)
    if rep.failed:
        first = next(c for c in rep.checks if c.status.value == "FAIL")
        raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the quantized output fails validation: [{first.code}] "
                        f"{first.message}", file=str(path))


def _quantize(src, dst, target, bits, group_size, sym, size, force, progress, quant, linear_layers=None):
    """Dense source -> EXL2 / GPTQ: the calibrated quantizer (``exl2fmt.quant.pipeline``).  ``linear_layers``:
    the source's linear layers as ``inspect`` counts them; those the quantizer keeps unquantized are named in a
    warning, so the two counts can be reconciled."""
    from ..quant.options import QuantOptions
    from ..quant.pipeline import quantize_model

    q = {k: v for k, v in dict(quant or {}).items() if v is not None}
    if group_size is not None:
        q["group_size"] = group_size
    if sym is not None:
        q["sym"] = sym
    unknown = set(q) - set(QuantOptions.__dataclass_fields__)
    if unknown:
        raise Exl2Error(ErrorCode.USAGE, f"unknown quantizer option(s): {', '.join(sorted(unknown))}")
    opts = QuantOptions(target=target, bits=bits, shard_size=size, **q)
    if progress is not None:   # at once: tokenizing and embedding the calibration set takes a while
        progress(0, 1, "calibrate: calibrating (tokenizing and embedding the calibration set)")
    cb = None if progress is None else (lambda phase, done, total, what: progress(done, total, f"{phase}: {what}"))
    rep = quantize_model(src, dst, opts, force=force, progress=cb, verify_output=validate_quantized_output)
    if linear_layers:
        done = {l.key for l in rep.layers}
        kept = [k for k in linear_layers if k not in done and k != "lm_head"]  # GPTQ keeps a dense head
        if kept:
            rep.warnings.append(f"{len(done)} of the source's {len(linear_layers)} linear layers quantized; kept "
                                f"as they are: {', '.join(kept[:8])}{', ...' if len(kept) > 8 else ''}")
    return rep


def _gguf_to_quantized(src, dst, target, bits, group_size, sym, size, force, progress, quant):
    """GGUF -> EXL2 / GPTQ: decode to a temporary FP16 directory next to DST (verified like any conversion),
    quantize that, remove it.  The quantizer's calibration needs the rebuilt tokenizer.json (byte-level BPE and,
    with transformers 5, SentencePiece vocabularies) or ``--calibration`` token ids.

    The staging directory is a marked working directory of DST (``make_partial_dir``): removed when the run ends
    or is interrupted, and by a later run for the same DST once its process is gone (after a SIGKILL).  Its
    publish is no end of the run: the interrupt shield it raises is lowered when the FP16 copy is in place
    (``SHIELD.intermediate``), so Ctrl-C / SIGTERM stop the quantization that follows."""
    import shutil

    from ..container.partials import SHIELD
    from ..container.publish import check_paths, make_partial_dir, stale_note
    from .gguf_read import convert_from_gguf

    from ..quant.options import QuantOptions
    from ..quant.pipeline import check_side_paths

    q0 = {k: v for k, v in dict(quant or {}).items() if v is not None and k in QuantOptions.__dataclass_fields__}
    o = QuantOptions(target=target, bits=bits, shard_size=size, **q0).resolved()   # the options, before DST
    d = _path(dst)
    check_paths(_path(src), d, force)
    check_side_paths(_path(src), d, o, force)       # --work-dir, --save-measurement, a leftover job: before decoding
    removed: list[str] = []
    tmp = make_partial_dir(d, removed)
    try:
        mid = tmp / "fp16"
        with SHIELD.intermediate():
            convert_from_gguf(src, mid, "fp16", shard_size=size, progress=progress)
        q = dict(quant or {})
        if q.get("calibration") is None and not (mid / "tokenizer.json").exists():
            raise Exl2Error(ErrorCode.CALIBRATION_INVALID, "the GGUF's tokenizer could not be rebuilt as "
                            "tokenizer.json, so the built-in calibration text cannot be tokenized: pass "
                            "--calibration with token ids (.npy, .json, .safetensors input_ids)", file=str(src))
        rep = _quantize(mid, dst, target, bits, group_size, sym, size, force, progress, q)
        rep.warnings.extend(stale_note(removed))
        return rep
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _path(p):
    from pathlib import Path

    return Path(os.fspath(p))


def _test_fail_after() -> int | None:
    """``FAIL_AFTER_ENV`` as an int (None when unset); one environment lookup per conversion."""
    v = os.environ.get(FAIL_AFTER_ENV)
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise Exl2Error(ErrorCode.USAGE, f"{FAIL_AFTER_ENV} must be an integer, got {v!r}") from None
