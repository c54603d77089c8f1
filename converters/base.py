"""The conversion pipeline every converter shares: plan, run, verify.

A converter turns one model directory (SRC) into another (DST).  It is a ``Converter`` subclass that

* ``plan()``   lists, in write order, the *units* of the output: one unit per linear layer or per plain
  tensor, each with the exact names, safetensors dtypes and shapes of the tensors it will produce (so the
  shard layout, the index and every header are known before any data is read);
* ``produce``  (per unit) reads the unit's source tensors and returns its output arrays;
* ``verify``   (per unit) decodes the written output and compares it with the source: bit for bit where the
  conversion is lossless, against the error it reported where it is lossy.

``run_conversion`` drives it:

1. refuses an existing DST without ``force`` (``OUTPUT_EXISTS``) and any DST that is, contains or lies inside
   SRC (``USAGE``): SRC is only ever read;
2. writes everything into a temporary sibling directory ``.<DST name>.exl2fmt-partial-<random>`` next to DST
   (a staged output: ``exl2fmt.container.staging``, which every driver uses for steps 2 and 6);
3. streams unit by unit: the shard writer knows every header in advance, so it writes each tensor's bytes as
   soon as the unit that produces it has run and keeps nothing else.  A background thread writes (and
   checksums, and periodically ``fdatasync``-s) while the next unit is produced, with at most two produced
   units waiting; peak memory is a few layers (source tensors are read with ``pread`` into private buffers
   rather than memory-mapped, so the model's pages never accumulate in the resident set);
4. copies every other file of SRC (tokenizer, generation config, ...) except weights, stale indexes and the
   source's quantization side files, and writes the converter's ``config.json`` and side files;
5. verifies the temporary directory: the structural validator (``exl2fmt.validate.validate_model``) must
   report no failure, the tensor set, dtypes and shapes must be the planned ones, every tensor's bytes are
   re-read and must match the checksum of what was produced from SRC, and units whose claim needs more
   (the re-packing conversions, or every unit with ``verify="full"``) are decoded and compared with SRC;
6. renames the temporary directory to DST (with ``force``, the old DST is first moved aside and removed
   after the rename).  An exception or Ctrl-C at any point removes the temporary directory; a hard kill
   leaves only the hidden ``.exl2fmt-partial-`` sibling, never a half-written DST, and the next run for the
   same DST removes it (its owner marker says whose it is: exl2fmt/container/partials.py).  From the rename on,
   SIGINT / SIGTERM are noted, not raised: a published result is reported as the success it is.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..container import (BackgroundWriter, OutSpec, ShardWriter, SourceReader, bf16_bits_to_f32, f32_to_bf16_bits,
                         plan_shards)
from ..container.checksums import checksum_of_file_range
from ..container.dtypes import f32_to_f16
from ..container.publish import copy_side_files, write_text
from ..container.staging import staged_output
from ..errors import ErrorCode, Exl2Error, Severity
from ..names import natural_key
from .options import DEFAULT_SHARD_SIZE

__all__ = [
    "TARGETS", "DEFAULT_SHARD_SIZE", "Options", "OutSpec", "Unit", "LayerReport", "TensorReport",
    "ConversionReport", "Converter", "run_conversion", "parse_size", "error_stats", "Progress",
]

#: Conversion targets (``--to``).
TARGETS = ("fp16", "bf16", "gptq", "exl2", "gguf")

Progress = Callable[[int, int, str], None]

# ------------------------------------------------------------------------------------------------ numerics


def error_stats(w: np.ndarray, ref: np.ndarray) -> dict:
    """Relative Frobenius error ||w - ref|| / ||ref||, max |w - ref| and the number of differing elements."""
    a = np.asarray(w, dtype=np.float32)
    b = np.asarray(ref, dtype=np.float32)
    d = a - b
    num = float(np.sqrt(np.dot(d.ravel().astype(np.float64), d.ravel().astype(np.float64))))
    den = float(np.sqrt(np.dot(b.ravel().astype(np.float64), b.ravel().astype(np.float64))))
    rel = 0.0 if num == 0 else (num / den if den > 0 else math.inf)
    return {"rel_error": rel, "max_abs_error": float(np.max(np.abs(d))) if d.size else 0.0,
            "mismatches": int(np.count_nonzero(d))}


def parse_size(text: str | int) -> int:
    """'5GB' (10^9), '500MB', '2GiB' (2^30), '1048576' -> bytes.  Raises Exl2Error(USAGE)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise Exl2Error(ErrorCode.USAGE, f"shard size must be positive, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise Exl2Error(ErrorCode.USAGE, f"cannot read shard size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    num = float(m.group(1))
    unit = m.group(2).lower().rstrip("b")
    mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}.get(unit)
    if mult is None:
        raise Exl2Error(ErrorCode.USAGE, f"unknown unit in shard size {text!r}")
    n = int(num * mult)
    if n <= 0:
        raise Exl2Error(ErrorCode.USAGE, f"shard size must be positive, got {text!r}")
    return n


# ------------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Options:
    """What the caller asked for (``None`` = the converter's default)."""

    target: str
    shard_size: int = DEFAULT_SHARD_SIZE
    dtype: str | None = None
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None


@dataclass
class LayerReport:
    """What happened to one linear layer.

    ``exact``: the output decodes to exactly the source's reconstruction (for a bf16 target: to the bf16
    rounding of the fp16 reconstruction).  ``rel_error`` / ``max_abs_error`` compare the output's decoded
    weight with the source's (float32 arithmetic).  ``verified``: the verify pass re-read the output and
    confirmed the claim.
    """

    key: str
    source_format: str
    target_format: str
    shape: tuple[int, int]                      # (out_features, in_features)
    source_plan: str = ""
    target_plan: str = ""
    exact: bool = True
    rel_error: float = 0.0
    max_abs_error: float = 0.0
    rows_requantized: int = 0
    verified: bool | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"key": self.key, "source_format": self.source_format, "target_format": self.target_format,
                "shape": list(self.shape), "source_plan": self.source_plan, "target_plan": self.target_plan,
                "exact": self.exact, "rel_error": _finite(self.rel_error), "max_abs_error": _finite(self.max_abs_error),
                "rows_requantized": self.rows_requantized, "verified": self.verified, "notes": list(self.notes)}


@dataclass
class TensorReport:
    """A non-layer tensor (embedding, norm, ...): copied unchanged or cast."""

    name: str
    source_dtype: str
    target_dtype: str
    exact: bool = True
    max_abs_error: float = 0.0
    nonfinite: int = 0
    verified: bool | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "source_dtype": self.source_dtype, "target_dtype": self.target_dtype,
                "exact": self.exact, "max_abs_error": _finite(self.max_abs_error), "nonfinite": self.nonfinite,
                "verified": self.verified}


def _finite(x: float):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


@dataclass
class ConversionReport:
    """The result of ``convert``: what was written, layer by layer, and what the verify pass found."""

    source: str
    destination: str
    source_format: str
    target: str
    options: dict
    layers: list[LayerReport] = field(default_factory=list)
    tensors: list[TensorReport] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    files_copied: list[str] = field(default_factory=list)
    files_written: list[str] = field(default_factory=list)
    bytes_written: int = 0
    config_changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    compatibility: dict = field(default_factory=dict)
    quantization_config: dict | None = None
    validation: dict | None = None
    verified: bool = False
    verify_mode: str = ""
    seconds: dict = field(default_factory=dict)
    #: a dense source: its linear layers as ``inspect`` counts them (they are cast as tensors, not layers)
    linear_layers: int | None = None

    @property
    def exact(self) -> bool:
        return all(l.exact for l in self.layers) and all(t.exact for t in self.tensors)

    @property
    def lossy_layers(self) -> list[LayerReport]:
        return [l for l in self.layers if not l.exact]

    def as_dict(self) -> dict:
        from .. import __version__

        return {
            "report": "convert", "tool": {"name": "exl2fmt", "version": __version__},
            "source": self.source, "destination": self.destination, "source_format": self.source_format,
            "target": self.target, "options": self.options, "exact": self.exact, "verified": self.verified,
            "summary": self.summary(),
            "layers": [l.as_dict() for l in self.layers], "tensors": [t.as_dict() for t in self.tensors],
            "shards": self.shards, "files_copied": self.files_copied, "files_written": self.files_written,
            "bytes_written": self.bytes_written, "config_changes": self.config_changes, "warnings": self.warnings,
            "compatibility": self.compatibility, "quantization_config": self.quantization_config,
            "validation": self.validation, "verify_mode": self.verify_mode, "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }

    def summary(self) -> dict:
        lossy = self.lossy_layers
        worst = max(lossy, key=lambda l: l.rel_error, default=None)
        return {
            "layers": len(self.layers), "exact_layers": len(self.layers) - len(lossy), "lossy_layers": len(lossy),
            "linear_layers": len(self.layers) if self.linear_layers is None else self.linear_layers,
            "worst_layer": None if worst is None else worst.key,
            "worst_rel_error": None if worst is None else _finite(worst.rel_error),
            # every layer's relative error (an exact one counts 0), averaged: with the worst, the one-line
            # summary of what a lossy conversion cost (issue 40)
            "mean_rel_error": (_finite(sum(float(l.rel_error) for l in self.layers) / len(self.layers))
                               if self.layers else None),
            "tensors": len(self.tensors), "cast_tensors": sum(t.source_dtype != t.target_dtype for t in self.tensors),
            "shards": len(self.shards), "bytes_written": self.bytes_written,
        }

    def summary_lines(self) -> list[str]:
        s = self.summary()
        if self.linear_layers is not None and not self.layers:  # dense -> fp16/bf16: a cast of every tensor
            lines = [f"{self.source_format} -> {self.target}: {self.linear_layers} linear layers and the other "
                     f"tensors, {s['tensors']} tensors in all ({s['cast_tensors']} cast), {s['shards']} shard(s), "
                     f"{s['bytes_written']} bytes"]
        else:
            lines = [f"{self.source_format} -> {self.target}: {s['layers']} linear layers "
                     f"({s['exact_layers']} exact, {s['lossy_layers']} lossy), {s['tensors']} other tensors "
                     f"({s['cast_tensors']} cast), {s['shards']} shard(s), {s['bytes_written']} bytes"]
        if s["lossy_layers"]:
            rel = s["worst_rel_error"]
            mean = s["mean_rel_error"]
            lines.append(f"worst layer: {s['worst_layer']} relative error "
                         f"{'not finite' if rel is None else format(rel, '.3e')}; mean over the "
                         f"{s['layers']} layers {'not finite' if mean is None else format(mean, '.3e')}")
        lines.append(f"verified ({self.verify_mode})" if self.verified else "not verified")
        return lines



# ------------------------------------------------------------------------------------------------ units


@dataclass
class Unit:
    """One piece of the output: a linear layer or a plain tensor.

    ``produce()`` returns ``{name: array}`` for exactly the names of ``outputs`` (arrays of the numpy dtype of
    the declared safetensors dtype; BF16 as uint16 bit patterns).  ``verify(dst_reader)`` compares the written
    output with the source and updates ``report`` (raising ``Exl2Error`` when a claim does not hold).
    """

    key: str
    outputs: list[OutSpec]
    produce: Callable[[], dict[str, np.ndarray]]
    verify: Callable[["SourceReader"], None] | None = None
    report: LayerReport | TensorReport | None = None
    full_verify: bool = False


class Converter:
    """Base class of a registered converter.  Subclasses set ``source``/``target`` and implement ``plan``."""

    source: str = ""
    target: str = ""

    def __init__(self, reader: SourceReader, detection, options: Options, report: ConversionReport):
        self.reader = reader
        self.model = reader.model
        self.detection = detection
        self.options = options
        self.report = report
        self.config = self.model.config

    # --- to override ------------------------------------------------------------------------------------
    def plan(self) -> list[Unit]:
        raise NotImplementedError

    def output_config(self) -> dict | None:
        """The output's config.json (None: none written)."""
        return None

    def side_files(self) -> dict[str, str]:
        """Extra text files to write next to the weights, name -> content (e.g. quantize_config.json)."""
        return {}

    def finish(self) -> None:
        """Called after every unit ran (fill compatibility notes and the like)."""

    def verify_files(self, tmp: Path) -> None:
        """Called by the verify pass with the written (unpublished) output: check the converter's own side files
        (raise ``Exl2Error`` when one is not what it claims to be)."""

    # --- helpers ------------------------------------------------------------------------------------------
    def plain_tensor_names(self, handled: Iterable[str] = ()) -> list[str]:
        """Tensors that belong to no linear layer whose key is in ``handled``, in natural order."""
        owned = set()
        handled = set(handled)
        for info in self.detection.layers.values():
            if info.key in handled:
                owned.update(ti.name for ti in info.slots.values())
                owned.update(f"{info.key}.{slot}" for slot in _all_slots())
        return sorted((n for n in self.model.tensors if n not in owned), key=natural_key)

    def cast_unit(self, name: str, target_dtype: str | None) -> Unit:
        """A plain tensor copied unchanged (``target_dtype`` None or equal) or cast between F16/BF16/F32."""
        info = self.model.info(name)
        src_dt = info.dtype
        floats = ("F16", "BF16", "F32")
        dst_dt = target_dtype if (target_dtype and src_dt in floats) else src_dt
        rep = TensorReport(name, src_dt, dst_dt)
        self.report.tensors.append(rep)
        reader = self.reader

        def produce():
            a = reader.read(name)
            if dst_dt == src_dt:
                return {name: a}
            out, exact, err, bad = cast_float(a, src_dt, dst_dt)
            rep.exact, rep.max_abs_error, rep.nonfinite = exact, err, bad
            if bad:
                self.report.warnings.append(f"{name}: {bad} values are not finite after the cast {src_dt} -> {dst_dt}")
            return {name: out}

        def verify(dst: SourceReader):
            got = dst.read(name)
            want = reader.read(name)
            if dst_dt != src_dt:
                want = cast_float(want, src_dt, dst_dt)[0]
            ok = got.dtype == want.dtype and got.shape == want.shape and np.array_equal(
                got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
            rep.verified = ok
            if not ok:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the written tensor differs from the source "
                                f"({src_dt} -> {dst_dt})", tensor=name)

        return Unit(name, [OutSpec(name, dst_dt, tuple(info.shape))], produce, verify, rep)


def _all_slots() -> frozenset[str]:
    from ..layout import all_slot_names

    return all_slot_names()


def cast_float(a: np.ndarray, src: str, dst: str) -> tuple[np.ndarray, bool, float, int]:
    """Cast between F16 / BF16 (uint16 bits) / F32.  Returns (array, exact, max abs error, non-finite count)."""
    x = bf16_bits_to_f32(a) if src == "BF16" else np.asarray(a, dtype=np.float32)
    if dst == "F32":
        out = x.astype(np.float32)
        back = out
    elif dst == "F16":
        out = f32_to_f16(x)
        back = out.astype(np.float32)
    elif dst == "BF16":
        out = f32_to_bf16_bits(x)
        back = bf16_bits_to_f32(out)
    else:  # pragma: no cover - callers pass only float dtypes
        raise ValueError(dst)
    fin = np.isfinite(x)
    bad = int(np.count_nonzero(fin & ~np.isfinite(back)))
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(np.where(fin & np.isfinite(back), back - x, 0))
    err = float(d.max()) if d.size else 0.0
    exact = bad == 0 and err == 0.0
    return out, exact, err, bad


# ------------------------------------------------------------------------------------------------ driver


def run_conversion(converter_cls, src: str | os.PathLike, dst: str | os.PathLike, options: Options, *,
                   force: bool, progress: Progress | None, model, detection, report: ConversionReport,
                   verify: str = "auto", _fail_after: int | None = None) -> ConversionReport:
    """Plan, run and verify ``converter_cls`` on an open source model (see the module docstring)."""
    t_start = time.perf_counter()
    src_p, dst_p = Path(os.fspath(src)), Path(os.fspath(dst))
    reader = SourceReader(model)
    conv = converter_cls(reader, detection, options, report)
    try:
        units = conv.plan()
        specs = [s for u in units for s in u.outputs]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):  # pragma: no cover - converter bug
            raise RuntimeError("a converter planned the same output tensor twice")
        shards = plan_shards(specs, options.shard_size)
        total = sum(s.nbytes for s in specs)
        report.seconds["plan"] = time.perf_counter() - t_start

        t0 = time.perf_counter()
        with staged_output(dst_p, force, warnings=report.warnings) as stage:
            tmp = stage.path
            writer = ShardWriter(tmp, shards, {"format": "pt"})
            bg = None
            try:
                bg = BackgroundWriter(writer)
                _write_units(units, bg, progress, total, _fail_after)
                bg.close()
                bg = None
                report.shards = writer.finish()
                report.bytes_written = writer.bytes_written
                left_out = _write_files(conv, src_p, tmp, report)
                report.seconds["write"] = time.perf_counter() - t0

                stage.written()
                t0 = time.perf_counter()
                _verify(tmp, units, report, progress, writer.checksums, verify)
                conv.verify_files(tmp)
                report.seconds["verify"] = time.perf_counter() - t0
                if left_out is not None:
                    from ..modelcard import write_conversion_card

                    write_conversion_card(tmp, src_p, reader.model.config, report, left_out)
                    report.files_written.append("README.md")
                stage.publish()
            except BaseException:
                if bg is not None:
                    bg.abort()
                else:
                    writer.abort()
                raise
    finally:
        reader.close()
    report.seconds["total"] = time.perf_counter() - t_start
    return report


def _write_units(units: list[Unit], bg: BackgroundWriter, progress: Progress | None, total: int,
                 fail_after: int | None) -> None:
    """Produce every unit and hand its arrays to the background writer."""
    done = 0
    with _leave_a_core_for_the_writer():
        for ui, unit in enumerate(units):
            if fail_after is not None and ui >= fail_after:
                raise RuntimeError("injected failure (test hook)")
            arrays = unit.produce()
            bg.put([(spec.name, arrays[spec.name]) for spec in unit.outputs])
            del arrays
            done += sum(spec.nbytes for spec in unit.outputs)
            if progress is not None:
                progress(done, 2 * total, unit.key)


def _write_files(conv: Converter, src_p: Path, tmp: Path, report: ConversionReport):
    """The files besides the weights: the converter's config.json and side files, and SRC's other files (a
    quantized output gets its own model card: returns what ``copy_model_files`` left out, else None)."""
    conv.finish()
    cfg = conv.output_config()
    written = []
    if cfg is not None:
        write_text(tmp / "config.json", json.dumps(cfg, indent=2) + "\n")
        written.append("config.json")
    for name, text in conv.side_files().items():
        write_text(tmp / name, text)
        written.append(name)
    report.files_written = written + report.shards
    left_out = None
    if src_p.is_dir() and conv.options.target in ("gptq", "exl2"):   # a quantized output: its own card (issue 12)
        from ..modelcard import copy_model_files

        report.files_copied, left_out = copy_model_files(src_p, tmp, report.warnings)
    elif src_p.is_dir():
        skip = set(conv.side_files().keys())
        from ..modelcard import is_generated_card, original_card, read_source_card

        card = read_source_card(src_p)    # copy_side_files warns when it may not be read
        if is_generated_card(card):       # exl2fmt's card of the quantized source: untrue of this output
            skip.add("README.md")
            orig = original_card(card)
            if orig:
                write_text(tmp / "README.md", orig)
                report.files_written.append("README.md")
            report.warnings.append(
                f"README.md: the source's card describes its {report.source_format.upper()} quantization; "
                + ("the original model card it kept is this output's README.md" if orig else "not copied"))
        report.files_copied = copy_side_files(src_p, tmp, extra_skip=skip, warnings=report.warnings)
    return left_out


@contextlib.contextmanager
def _leave_a_core_for_the_writer():
    """While units are produced, Numba's parallel regions in this thread use one thread fewer than usual, so
    the background writer (page-cache copies, checksums, fdatasync) does not stall them: a parallel region
    waits for its slowest worker, and a worker sharing its core with the writer is the slowest.  Numba's
    thread count is per calling thread; it is restored afterwards."""
    import numba

    before = numba.get_num_threads()
    try:
        numba.set_num_threads(max(1, before - 1))
    except ValueError:  # pragma: no cover
        yield
        return
    try:
        yield
    finally:
        numba.set_num_threads(before)


def _verify(tmp: Path, units: list[Unit], report: ConversionReport, progress: Progress | None,
            sums: dict, mode: str) -> None:
    """Re-read the output: validator (structure, index, config vs shapes), the tensor set, every tensor's
    bytes against the checksum of what was produced, and - per unit, for ``full`` or for units whose claim needs
    it (``Unit.full_verify``) - a decode of the output compared with the source."""
    from ..container import open_model
    from ..validate import validate_model

    rep = validate_model(tmp, deep=False)
    fails = [c for c in rep.checks if c.status.value == "FAIL"]
    warns = [c for c in rep.checks if c.status.value == "WARN"]
    report.validation = {"result": "FAIL" if fails else "PASS", "counts": rep.counts(),
                         "problems": [c.as_dict() for c in fails + warns]}
    for c in warns:
        report.warnings.append(f"validate: [{c.code}] {c.message}")
    if fails:
        c = fails[0]
        raise Exl2Error(ErrorCode(c.code) if c.code in ErrorCode.__members__ else ErrorCode.REFERENCE_MISMATCH,
                        f"the converted model fails validation: {c.message}", tensor=c.tensor, file=c.file)
    dst = SourceReader(open_model(tmp))
    try:
        planned = {s.name for u in units for s in u.outputs}
        have = set(dst.model.tensors)
        if have != planned:
            extra = sorted(have - planned)[:3]
            missing = sorted(planned - have)[:3]
            raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the written model's tensors differ from the plan "
                            f"(missing {missing}, unexpected {extra})", file=str(tmp))
        total = sum(s.nbytes for u in units for s in u.outputs)
        done = total  # progress runs on from the write phase: (written + verified bytes) of 2 x total
        full = 0
        for unit in units:
            for spec in unit.outputs:
                t = dst.info(spec.name)
                if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                    raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"written as {t.dtype} {list(t.shape)}, planned "
                                    f"{spec.dtype} {list(spec.shape)}", tensor=spec.name, file=t.file)
                if checksum_of_file_range(t.file, t.abs_begin, t.nbytes) != sums.get(spec.name):
                    raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the bytes on disk differ from the bytes produced "
                                    "(checksum)", tensor=spec.name, file=t.file)
            if unit.verify is not None and (mode == "full" or unit.full_verify):
                unit.verify(dst)
                full += 1
            elif unit.report is not None:
                unit.report.verified = True
            done += sum(s.nbytes for s in unit.outputs)
            if progress is not None:
                progress(done, 2 * total, f"verify {unit.key}")
    finally:
        dst.close()
    report.verified = True
    n_verifiable = sum(1 for u in units if u.verify is not None)
    if full and full == n_verifiable:
        report.verify_mode = "every tensor re-read and checksummed; every unit decoded again and compared with the source"
    elif full:
        report.verify_mode = (f"every tensor re-read and checksummed; {full} re-packed layer(s) decoded and compared "
                              "with the source")
    else:
        report.verify_mode = "every tensor re-read and checksummed against the bytes decoded from the source"


def layer_issues_or_raise(layer, report: ConversionReport) -> None:
    """Deep-validate a source layer: errors raise, warnings go to the report."""
    for i in layer.validate(deep=True):
        if i.severity is Severity.ERROR:
            raise i.to_error()
        report.warnings.append(f"{i.tensor}: [{i.code.value}] {i.message}")


def build_layer(reader: SourceReader, info, config: dict | None):
    """The core layer object of a detected layer, from arrays read with ``reader`` (not memory-mapped)."""
    from ..formats import build_layer as build

    return build(info.key, info.format, info.slots, lambda ti: reader.read(ti.name), config)
