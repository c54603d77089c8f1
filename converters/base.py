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
2. writes everything into a temporary sibling directory ``.<DST name>.exl2fmt-partial-<random>`` next to DST;
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
   same DST removes it (its owner marker says whose it is: converters/partials.py).  From the rename on,
   SIGINT / SIGTERM are noted, not raised: a published result is reported as the success it is.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import queue
import re
import secrets
import shutil
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from numba import njit

from ..errors import ErrorCode, Exl2Error, Issue, Severity
from .partials import fault_point

__all__ = [
    "TARGETS", "DEFAULT_SHARD_SIZE", "Options", "OutSpec", "Unit", "LayerReport", "TensorReport",
    "ConversionReport", "Converter", "SourceReader", "run_conversion", "parse_size", "f16_to_bf16_bits",
    "f32_to_bf16_bits", "bf16_bits_to_f32", "error_stats", "natural_key", "Progress",
]

#: Conversion targets (``--to``).
TARGETS = ("fp16", "bf16", "gptq", "exl2", "gguf")
#: Default maximum tensor bytes per output shard (Hugging Face's "5GB").
DEFAULT_SHARD_SIZE = 5_000_000_000

Progress = Callable[[int, int, str], None]

# Files of SRC that are never copied: weights (rewritten), indexes (regenerated; a stale one breaks loaders),
# quantization side files (rewritten by the converter when the target needs one).
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
_SKIP_NAMES = {"config.json", "quantize_config.json", "quant_config.json"}
_SKIP_DIRS = {".git", ".cache", "__pycache__", ".huggingface"}
_INDEX_RE = re.compile(r".*\.(safetensors|bin)\.index\.json$")


# ------------------------------------------------------------------------------------------------ numerics


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


def natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


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


@dataclass(frozen=True)
class OutSpec:
    """One output tensor: name, safetensors dtype, shape (C order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        from ..container import SAFETENSORS_DTYPES

        n = SAFETENSORS_DTYPES[self.dtype].bits
        for d in self.shape:
            n *= d
        return n // 8


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
            lines.append(f"worst layer: {s['worst_layer']} relative error {s['worst_rel_error']:.3e}")
        lines.append(f"verified ({self.verify_mode})" if self.verified else "not verified")
        return lines


# ------------------------------------------------------------------------------------------------ reading


class SourceReader:
    """Reads tensors of an open ``ModelFiles`` with ``pread`` into private arrays.

    Unlike the memory map of ``ModelFiles.get``, what is read here is freed with the array, so a conversion
    never accumulates the model's pages in its resident set.  Headers were validated by ``open_model``.
    """

    def __init__(self, model):
        self.model = model
        self._files: dict = {}
        self.bytes_read = 0

    def info(self, name: str):
        return self.model.info(name)

    def read(self, name: str) -> np.ndarray:
        from ..container import SAFETENSORS_DTYPES

        t = self.model.info(name)
        spec = SAFETENSORS_DTYPES[t.dtype]
        if spec.numpy is None:
            raise Exl2Error(ErrorCode.DTYPE_UNKNOWN, f"sub-byte dtype {t.dtype} cannot be converted", tensor=name,
                            file=t.file)
        arr = np.empty(t.shape, dtype=spec.numpy)
        self._pread_into(arr, t, t.abs_begin, name)
        return arr

    def read_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0:r1`` (first axis) of a tensor, read like ``read`` (only those bytes)."""
        from ..container import SAFETENSORS_DTYPES

        t = self.model.info(name)
        spec = SAFETENSORS_DTYPES[t.dtype]
        if spec.numpy is None or not t.shape:
            raise Exl2Error(ErrorCode.DTYPE_UNKNOWN, f"{t.dtype} rows cannot be read", tensor=name, file=t.file)
        r0, r1 = max(0, min(r0, t.shape[0])), max(0, min(r1, t.shape[0]))
        arr = np.empty((max(0, r1 - r0), *t.shape[1:]), dtype=spec.numpy)
        self._pread_into(arr, t, t.abs_begin + r0 * (arr[0:1].nbytes if arr.size else 0), name)
        return arr

    def _pread_into(self, arr: np.ndarray, t, offset: int, name: str) -> None:
        nbytes = arr.nbytes
        if nbytes:
            buf = memoryview(arr.reshape(-1).view(np.uint8))
            f = self._file(t.file)
            off, done = offset, 0
            try:
                while done < nbytes:
                    if _HAVE_PREADV:
                        n = os.preadv(f.fileno(), [buf[done:]], off + done)
                    else:  # pragma: no cover - platforms without preadv
                        f.seek(off + done)
                        n = f.readinto(buf[done:])
                    if not n:
                        raise Exl2Error(ErrorCode.TRUNCATED, "the file ended while reading (changed on disk?)",
                                        tensor=name, file=t.file)
                    done += n
            except OSError as e:
                raise Exl2Error(ErrorCode.IO_ERROR, f"cannot read: {e.strerror or e}", tensor=name,
                                file=t.file) from None
        self.bytes_read += nbytes

    def _file(self, path: str):
        f = self._files.get(path)
        if f is None:
            try:
                f = open(path, "rb", buffering=0)
            except OSError as e:
                raise Exl2Error(ErrorCode.IO_ERROR, f"cannot open: {e.strerror or e}", file=path) from None
            self._files[path] = f
        return f

    def close_files(self) -> None:
        """Close the reader's own file handles (the model stays open)."""
        while self._files:
            _, f = self._files.popitem()
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        self.close_files()
        self.model.close()


_HAVE_PREADV = hasattr(os, "preadv")


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
        self.config = self._config()

    def _config(self) -> dict | None:
        try:
            return self.model.config
        except Exl2Error:
            raise

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
        with np.errstate(over="ignore", invalid="ignore"):
            out = x.astype(np.float16)
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


# ------------------------------------------------------------------------------------------------ shard writer


def plan_shards(specs: list[OutSpec], max_bytes: int) -> list[list[OutSpec]]:
    """First-fit in write order: a new shard when the next tensor would overflow ``max_bytes``."""
    shards: list[list[OutSpec]] = [[]]
    cur = 0
    for s in specs:
        if shards[-1] and cur + s.nbytes > max_bytes:
            shards.append([])
            cur = 0
        shards[-1].append(s)
        cur += s.nbytes
    return shards


def shard_names(n: int, prefix: str = "model") -> list[str]:
    if n == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _header_bytes(specs: list[OutSpec], metadata: dict[str, str]) -> bytes:
    hdr: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    off = 0
    for s in specs:
        hdr[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    hb = json.dumps(hdr, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hb + b" " * (-len(hb) % 8)


class ShardWriter:
    """Writes planned shards tensor by tensor: each file's header is written first (every shape is known),
    then each tensor's bytes as they are fed, in the planned order.  Holds no tensor data itself.

    ``checksums`` records the checksum of every tensor's bytes as written (the verify pass compares it with the file).
    Every ``sync_every`` bytes the shard is ``fdatasync``-ed, so writeback proceeds while later layers are being
    produced and the final fsync has little left to do.
    """

    def __init__(self, directory: Path, shards: list[list[OutSpec]], metadata: dict[str, str], prefix="model",
                 sync_every: int = 256 << 20, index_name: str = "model.safetensors.index.json"):
        self.dir = directory
        self.shards = shards
        self.names = shard_names(len(shards), prefix)
        self.index_name = index_name
        self.metadata = metadata
        self._order = [(i, s) for i, shard in enumerate(shards) for s in shard]
        self._pos = 0
        self._file = None
        self._shard = -1
        self._unsynced = 0
        self.sync_every = sync_every
        self.bytes_written = 0
        self.checksums: dict[str, tuple] = {}
        self._path: Path | None = None

    def _open(self, i: int) -> None:
        self._close()
        path = self.dir / self.names[i]
        self._path = path
        with _naming_write_errors(path):
            self._file = open(path, "xb", buffering=0)
            hb = _header_bytes(self.shards[i], self.metadata)
            self._file.write(struct.pack("<Q", len(hb)))
            self._file.write(hb)
        self._shard = i
        self._unsynced = 0

    def _close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            with _naming_write_errors(getattr(self, "_path", self.dir)):
                try:
                    os.fsync(f.fileno())
                finally:
                    f.close()

    def check(self, name: str, arr: np.ndarray) -> np.ndarray:
        """Check ``arr`` against the next planned tensor (name, dtype, shape); returns it C-contiguous LE."""
        from ..container import SAFETENSORS_DTYPES

        if self._pos >= len(self._order):
            raise RuntimeError(f"converter produced an unplanned tensor {name!r}")
        i, spec = self._order[self._pos]
        if spec.name != name:
            raise RuntimeError(f"converter produced {name!r} where the plan has {spec.name!r}")
        want_np = SAFETENSORS_DTYPES[spec.dtype].numpy
        a = np.asarray(arr)
        if a.dtype != want_np or tuple(a.shape) != spec.shape:
            raise RuntimeError(f"{name}: produced {a.dtype} {a.shape}, planned {spec.dtype} {spec.shape}")
        a = np.ascontiguousarray(a)
        if a.dtype.byteorder == ">":  # pragma: no cover - big-endian hosts
            a = a.astype(a.dtype.newbyteorder("<"))
        return a

    def feed(self, name: str, arr: np.ndarray) -> None:
        a = self.check(name, arr)
        i, _ = self._order[self._pos]
        if i != self._shard:
            self._open(i)
        mv = memoryview(a.reshape(-1).view(np.uint8))
        # one write call per tensor: the GIL is released for the whole copy into the page cache
        done = 0
        with _naming_write_errors(self._path):
            while done < len(mv):
                done += self._file.write(mv[done:])
        self.checksums[name] = checksum(mv)
        self.bytes_written += a.nbytes
        self._unsynced += a.nbytes
        if self._unsynced >= self.sync_every:
            with _naming_write_errors(self._path):
                os.fdatasync(self._file.fileno())
            self._unsynced = 0
        self._pos += 1
        if self._pos == len(self._order) or self._order[self._pos][0] != i:
            self._close()

    def finish(self) -> list[str]:
        if self._pos != len(self._order):
            raise RuntimeError(f"only {self._pos} of {len(self._order)} planned tensors were produced")
        self._close()
        written = list(self.names)
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for sh in self.shards for s in sh)},
                     "weight_map": {s.name: self.names[i] for i, sh in enumerate(self.shards) for s in sh}}
            _write_text(self.dir / self.index_name, json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append(self.index_name)
        return written

    def abort(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


@njit(nogil=True, cache=True)
def _fletcher_words(words, state):
    """state: uint64[2] = (a, b), updated in place (uint64 arithmetic wraps mod 2^64)."""
    a = state[0]
    b = state[1]
    for i in range(words.shape[0]):
        a += words[i]
        b += a
    state[0] = a
    state[1] = b


class Checksum:
    """Fletcher-style checksum of a byte string: two running sums mod 2^64 over its little-endian 64-bit words
    (the last word zero-padded), a = sum(w_i), b = sum(a_i), plus the length.  Any changed word changes a, any
    moved word changes b; it runs at memory speed (Numba, GIL released) and identically over a tensor produced
    in memory and over the same bytes re-read from the file in windows."""

    __slots__ = ("state", "n", "_tail")

    def __init__(self):
        self.state, self.n, self._tail = np.zeros(2, dtype=np.uint64), 0, b""

    def update(self, data) -> "Checksum":
        d = np.frombuffer(data, dtype=np.uint8)
        if self._tail:
            d = np.concatenate([np.frombuffer(self._tail, dtype=np.uint8), d])
            self.n -= len(self._tail)
        k = d.size // 8 * 8
        if k:
            _fletcher_words(d[:k].view(np.uint64), self.state)
        self._tail = d[k:].tobytes()
        self.n += d.size
        return self

    def digest(self) -> tuple[int, int, int]:
        st = self.state.copy()
        if self._tail:
            _fletcher_words(np.frombuffer(self._tail + b"\0" * (8 - len(self._tail)), dtype=np.uint64), st)
        return int(st[0]), int(st[1]), self.n


def checksum(data) -> tuple[int, int, int]:
    return Checksum().update(data).digest()


class BackgroundWriter:
    """Runs ``ShardWriter.feed`` in a thread so that writing (and checksumming) one unit overlaps producing the
    next.  At most ``depth`` produced units wait in the queue; exceptions surface in the producing thread."""

    def __init__(self, writer: ShardWriter, depth: int = 2):
        self.writer = writer
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="exl2fmt-shard-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is not None:
                continue
            try:
                for name, arr in item:
                    self.writer.feed(name, arr)
            except BaseException as e:  # noqa: BLE001 - re-raised in the producer
                self._error = e

    def put(self, items: list[tuple[str, np.ndarray]]) -> None:
        if self._error is not None:
            raise self._error
        while True:
            try:
                self._q.put(items, timeout=0.5)
                return
            except queue.Full:
                if self._error is not None:
                    raise self._error from None

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        self._error = self._error or RuntimeError("aborted")
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._q.put(None)
        self._thread.join(timeout=60)
        self.writer.abort()


def checksum_of_file_range(path: str, offset: int, length: int, window: int = 64 << 20) -> tuple[int, int, int]:
    """``checksum`` of ``length`` bytes of ``path`` at ``offset``, read through short-lived memory maps (no
    copy, and the mapped pages leave the resident set with each window)."""
    c = Checksum()
    if length == 0:
        return c.digest()
    gran = mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        pos, end = offset, offset + length
        while pos < end:
            base = pos - pos % gran
            n = min(end, base + window) - base
            with mmap.mmap(f.fileno(), n, offset=base, access=mmap.ACCESS_READ) as mm:
                mv = memoryview(mm)
                try:
                    c.update(mv[pos - base:n])
                finally:
                    mv.release()
            pos = base + n
    return c.digest()


def _write_text(path: Path, text: str) -> None:
    with _naming_write_errors(path):
        with open(path, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def _naming_write_errors(path):
    """An OSError while writing ``path`` (a full disk, a quota, EIO) becomes IO_ERROR naming the file."""
    try:
        yield
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot write: {e.strerror or e}", file=str(path)) from None


def name_unnamed_os_error(e: BaseException, where: Path | None) -> BaseException:
    """A bare OSError without a file name (``No space left on device`` from a flush or a library's write)
    becomes IO_ERROR naming the working directory it happened in; anything else is returned unchanged."""
    if isinstance(e, OSError) and not getattr(e, "filename", None) and where is not None \
            and not isinstance(e, BrokenPipeError):
        hint = "" if e.errno is not None else " (is the disk full?)"
        return Exl2Error(ErrorCode.IO_ERROR, f"cannot write the output: {e.strerror or e}{hint}", file=str(where))
    return e


# ------------------------------------------------------------------------------------------------ paths


def _resolve(p: Path) -> Path:
    try:
        return p.resolve(strict=False)
    except (OSError, RuntimeError):
        return Path(os.path.abspath(p))


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_paths(src: Path, dst: Path, force: bool, kind: str = "dir") -> None:
    """DST must lie outside SRC; an existing DST is an error without ``force``, and with it is replaced only
    when it is an output of the same ``kind`` (see ``exl2fmt.outputs.replaceable``)."""
    from ..outputs import existing_output_error

    rs, rd = _resolve(src), _resolve(dst)
    # a directory source: nothing may be written inside it; any source: DST must not be it or contain it
    # (replacing DST with --force would delete it)
    if rd == rs or (rs.is_dir() and _is_within(rd, rs)) or _is_within(rs, rd):
        raise Exl2Error(ErrorCode.USAGE, f"the destination {dst} must lie outside the source {src} (and not "
                        "contain it): a conversion never writes into or replaces its source", file=str(dst))
    err = existing_output_error(dst, force, kind)
    if err is not None:
        raise err


def make_partial_dir(dst: Path, removed: list[str] | None = None) -> Path:
    """A new working directory ``.<DST name>.exl2fmt-partial-<hex>`` next to DST, with an owner marker
    (converters/partials.py); first removes the partials that dead earlier runs left for this same DST (their
    paths are appended to ``removed`` when given)."""
    from .partials import make_owned_dir, remove_stale_partials

    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot create the parent directory: {e.strerror or e}",
                        file=str(parent)) from None
    gone = remove_stale_partials(dst)
    if removed is not None:
        removed.extend(gone)
    try:
        return make_owned_dir(dst)
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot create a working directory next to the output: "
                        f"{e.strerror or e}", file=str(e.filename or parent)) from None


def stale_note(removed: list[str]) -> list[str]:
    return [f"removed {p}: a working directory an interrupted earlier run left for this destination"
            for p in removed]


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            path.unlink()
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def publish(tmp: Path, dst: Path, force: bool) -> None:
    """Rename the finished working directory to DST (moving an existing DST aside first with ``force``).
    From here on SIGINT / SIGTERM are noted, not raised (``partials.SHIELD``; the caller lowers it)."""
    from .partials import MARKER, SHIELD

    SHIELD.raise_shield()
    old = None
    if tmp.is_dir() and not tmp.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp / MARKER)
    try:
        if os.path.lexists(dst):
            if not force:
                raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "the destination appeared during the conversion; pass "
                                "--force to replace it", file=str(dst))
            old = dst.parent / f".{dst.name[:150]}.exl2fmt-old-{secrets.token_hex(6)}"
            os.rename(dst, old)
        os.rename(tmp, dst)
    except OSError as e:
        if old is not None and not os.path.lexists(dst):
            try:
                os.rename(old, dst)
            except OSError:
                pass
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot move the result into place: {e.strerror or e}",
                        file=str(dst)) from None
    _fsync_dir(dst.parent if str(dst.parent) else Path("."))
    if old is not None:
        _remove(old)


def copy_side_files(src_dir: Path, tmp: Path, extra_skip: Iterable[str] = ()) -> list[str]:
    """Copy every file of SRC that is not a weight, an index or a quantization side file (recursively;
    symlinks are followed, hidden tool directories skipped).  Returns the relative paths copied."""
    skip = set(_SKIP_NAMES) | set(extra_skip)
    copied = []
    for root, dirs, files in os.walk(src_dir, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and ".exl2fmt-" not in d)
        rel_root = Path(root).relative_to(src_dir)
        for fname in sorted(files):
            rel = rel_root / fname
            if rel_root == Path(".") and fname in skip:
                continue
            if fname.endswith(_SKIP_SUFFIXES) or _INDEX_RE.fullmatch(fname):
                continue
            src = Path(root) / fname
            if not src.is_file():
                continue
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(src, out)
            except OSError as e:  # the file that failed: the source (unreadable) or the copy (disk full)
                raise Exl2Error(ErrorCode.IO_ERROR, f"cannot copy {src}: {e.strerror or e}",
                                file=str(e.filename or out)) from None
            copied.append(str(rel))
    return copied


# ------------------------------------------------------------------------------------------------ driver


def run_conversion(converter_cls, src: str | os.PathLike, dst: str | os.PathLike, options: Options, *,
                   force: bool, progress: Progress | None, model, detection, report: ConversionReport,
                   verify: str = "auto", _fail_after: int | None = None) -> ConversionReport:
    """Plan, run and verify ``converter_cls`` on an open source model (see the module docstring)."""
    t_start = time.perf_counter()
    src_p, dst_p = Path(os.fspath(src)), Path(os.fspath(dst))
    reader = SourceReader(model)
    conv = converter_cls(reader, detection, options, report)
    tmp = None
    writer = bg = None
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
        removed: list[str] = []
        tmp = make_partial_dir(dst_p, removed)
        report.warnings.extend(stale_note(removed))
        fault_point("partial")
        writer = ShardWriter(tmp, shards, {"format": "pt"})
        bg = BackgroundWriter(writer)
        done = 0
        with _leave_a_core_for_the_writer():
            for ui, unit in enumerate(units):
                if _fail_after is not None and ui >= _fail_after:
                    raise RuntimeError("injected failure (test hook)")
                arrays = unit.produce()
                bg.put([(spec.name, arrays[spec.name]) for spec in unit.outputs])
                del arrays
                done += sum(spec.nbytes for spec in unit.outputs)
                if progress is not None:
                    progress(done, 2 * total, unit.key)
        bg.close()
        bg = None
        report.shards = writer.finish()
        report.bytes_written = writer.bytes_written
        conv.finish()
        cfg = conv.output_config()
        written = []
        if cfg is not None:
            _write_text(tmp / "config.json", json.dumps(cfg, indent=2) + "\n")
            written.append("config.json")
        for name, text in conv.side_files().items():
            _write_text(tmp / name, text)
            written.append(name)
        report.files_written = written + report.shards
        left_out = None
        if src_p.is_dir() and options.target in ("gptq", "exl2"):   # a quantized output: its own card (issue 12)
            from ..modelcard import copy_model_files

            report.files_copied, left_out = copy_model_files(src_p, tmp)
        elif src_p.is_dir():
            report.files_copied = copy_side_files(src_p, tmp, extra_skip=conv.side_files().keys())
        report.seconds["write"] = time.perf_counter() - t0

        fault_point("written")
        t0 = time.perf_counter()
        _verify(tmp, units, report, progress, writer.checksums, verify)
        report.seconds["verify"] = time.perf_counter() - t0
        if left_out is not None:
            from ..modelcard import write_conversion_card

            write_conversion_card(tmp, src_p, reader.model.config, report, left_out)
            report.files_written.append("README.md")
        fault_point("verified")
        publish(tmp, dst_p, force)
        tmp = None
        fault_point("published")
    except BaseException as e:
        if bg is not None:
            bg.abort()
        elif writer is not None:
            writer.abort()
        raise name_unnamed_os_error(e, tmp)
    finally:
        reader.close()
        if tmp is not None:
            _remove(tmp)
        interrupts = lower_shield()
    report.warnings.extend(interrupts)
    report.seconds["total"] = time.perf_counter() - t_start
    return report


def lower_shield() -> list[str]:
    """End of a driver: lower ``partials.SHIELD`` (unless the CLI holds it) and say which interrupts arrived
    after DST was published (they were ignored: the output is complete and verified)."""
    from .partials import SHIELD

    got = list(SHIELD.received) if SHIELD.up else []
    SHIELD.lower()
    if not got:
        return []
    import signal as _signal

    names = ", ".join(sorted({_signal.Signals(s).name for s in got}))
    return [f"{names} arrived after the output was published: it is complete and verified, so the run finished"]


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


VERIFY_MODES = ("auto", "full", "checksum")


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


def is_issue_error(i: Issue) -> bool:
    return i.severity is Severity.ERROR
