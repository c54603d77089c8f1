"""The state of one quantization run inside its work directory (``workdir``: where that directory is, whose it
is, how far an interrupted run got), and what the run writes: ``Work`` keeps ``job.json`` (options fingerprint,
measurement, strategy, progress), the hidden-state snapshot ``hidden.safetensors`` and the quantized layers
``out/<layer>.safetensors``; the quantize pass parks its large Hessians here (``spilled`` / ``unspilled``); and
before any work ``disk_needed`` / ``check_disk`` compare what the run will write with the free space."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..container import SourceReader, jsonload, open_model, write_safetensors
from ..errors import ErrorCode, Exl2Error
from .common import block_linears, model_blocks
from .options import QuantOptions
from .report import LayerResult
from .workdir import make_work_dir

__all__ = ["Work", "WORK_VERSION", "SNAPSHOT_SECONDS", "save_tensors", "load_tensors", "spilled", "unspilled",
           "SPILL_HESSIANS", "SPILL_MIN_BYTES", "disk_needed", "check_disk"]

WORK_VERSION = 2        # 2: the quantization pass snapshots the FP16 hidden state too
#: The hidden state is snapshotted at most this often (seconds; a test sets 0 to snapshot after every layer).
SNAPSHOT_SECONDS = 180.0


def _atomic_json(path: Path, doc) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_tensors(path: Path, tensors: dict[str, np.ndarray], durable: bool = True) -> None:
    """``durable=False`` for scratch that dies with its block (parked candidates): no fsync."""

    write_safetensors(path, tensors, durable=durable)


def load_tensors(path: Path) -> dict[str, np.ndarray]:

    m = open_model(path)
    try:
        return {n: np.array(m.get(n)) for n in m.names()}
    finally:
        m.close()


def _check_job_shape(job, path: str) -> None:
    """The types this module relies on in a job.json it reads back (an edited or damaged one is
    CHECKPOINT_INVALID naming the key, not a TypeError deep in the run)."""
    K = jsonload.JOB
    jsonload.expect(job, "object", K, file=path)
    jsonload.expect_dict_of(job.get("measured", {}), "array", K, file=path, where="measured")
    jsonload.expect_list_of(job.get("quantized", []), "string", K, file=path, where="quantized")
    for key in ("snapshot", "strategy"):
        jsonload.expect(job.get(key), ("object", "null"), K, file=path, where=key)
    jsonload.expect_dict_of(job.get("blocks", {}), "object", K, file=path, where="blocks")
    fields_ = set(LayerResult.__dataclass_fields__)
    for k, v in jsonload.expect_dict_of(job.get("layers", {}), "object", K, file=path, where="layers").items():
        if set(v) != fields_:
            raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"job.json: layers[{k!r}]: expected the fields "
                            f"{', '.join(sorted(fields_))}", file=path)


class Work:
    """The work directory: job.json, hidden-state snapshot, per-layer outputs."""

    def __init__(self, root: Path, fingerprint: dict, resume: bool, dst: Path | None = None):
        self.root = root
        self.out = root / "out"
        self.job_path = root / "job.json"
        self.resumed = False          # a job of an earlier run was loaded (progress reports say where it resumed)
        if root.exists() and (root / "job.json").exists():
            if not resume:
                raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "an interrupted quantization left this work directory; "
                                "pass --resume to continue it, or delete it to start over", file=str(root))
            # the guarded loader: regular file, caps, parser errors -> CHECKPOINT_INVALID naming job.json
            self.job = jsonload.load_json(self.job_path, jsonload.JOB)
            _check_job_shape(self.job, str(self.job_path))
            if self.job.get("version") != WORK_VERSION or self.job.get("fingerprint") != fingerprint:
                raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, "the work directory belongs to a run with other "
                                "inputs or options; delete it or repeat the original options", file=str(root))
            self.resumed = True
        else:
            if not root.exists():     # made here, with the work marker: the only kind removed after the run
                try:
                    make_work_dir(root, dst if dst is not None else root)
                except OSError as e:
                    raise Exl2Error(ErrorCode.IO_ERROR, f"cannot create the work directory: {e.strerror or e}",
                                    file=str(root)) from None
            self.job = {"version": WORK_VERSION, "fingerprint": fingerprint, "measured": {}, "strategy": None,
                        "quantized": [], "snapshot": None}
            self.save()
        self.out.mkdir(exist_ok=True)
        self._last_snapshot = time.monotonic()

    def save(self) -> None:
        _atomic_json(self.job_path, self.job)

    def snapshot(self, phase: str, next_block: int, states: dict[str, torch.Tensor], force: bool = False) -> None:
        """Save the hidden states (name -> tensor) before block ``next_block`` of ``phase`` (at most every few
        minutes)."""
        if not force and time.monotonic() - self._last_snapshot < SNAPSHOT_SECONDS:
            return
        save_tensors(self.root / "hidden.safetensors", {k: v.detach().cpu().numpy() for k, v in states.items()})
        self.job["snapshot"] = {"phase": phase, "next_block": next_block}
        self.save()
        self._last_snapshot = time.monotonic()

    def snapshot_due(self) -> bool:
        """Whether ``snapshot`` (without ``force``) would write now."""
        return time.monotonic() - self._last_snapshot >= SNAPSHOT_SECONDS

    def restore(self, phase: str, shape: tuple[int, ...], need: tuple[tuple[str, ...], ...] = (("h",),),
                blocks: int | None = None) -> tuple[int, dict[str, torch.Tensor] | None]:
        """The snapshot of ``phase``: (next block, {name: float32 tensor}), or (0, None) without one.  Every
        state must be float32 of ``shape`` (rows, T, hidden), each tuple of ``need`` must have one of its names
        present, and the block index must lie in 0..``blocks``; anything else (a damaged or edited work
        directory) is ``CHECKPOINT_INVALID`` naming the file and tensor."""
        snap = self.job.get("snapshot")
        path = self.root / "hidden.safetensors"
        if not snap or snap.get("phase") != phase or not path.exists():
            return 0, None
        states = load_tensors(path)
        nb = snap.get("next_block")
        if not isinstance(nb, int) or nb < 0 or (blocks is not None and nb > blocks):
            raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"job.json: snapshot block {nb!r} is not a block index "
                            f"of this model (0..{blocks})", file=str(self.job_path))
        for name, v in states.items():
            if v.dtype != np.float32 or tuple(v.shape) != tuple(shape):
                raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"hidden state {name!r} is {v.dtype} "
                                f"{list(v.shape)}, the run's is float32 {list(shape)}", file=str(path))
        for names in need:
            if not any(n in states for n in names):
                raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"the snapshot lacks the hidden state "
                                f"{' or '.join(map(repr, names))}", file=str(path))
        return nb, {k: torch.from_numpy(v) for k, v in states.items()}

    def layer_path(self, key: str) -> Path:
        return self.out / f"{key}.safetensors"


# ------------------------------------------------------------------------------------------------ parked Hessians

#: The quantize pass parks each Hessian of at least SPILL_MIN_BYTES in the work directory while it is factored
#: and its linears swept (CPU; K x K float32 each: a small model's are not worth the file).
SPILL_HESSIANS = True
SPILL_MIN_BYTES = 4 << 20


def spilled(H: torch.Tensor, path: Path | None) -> torch.Tensor:
    """``H`` float32 [K, K] (CPU), also written to ``path`` (scratch safetensors, no fsync) for ``unspilled``;
    ``H`` itself when ``path`` is None."""
    if path is not None:
        save_tensors(path, {"hessian": H.numpy()}, durable=False)
    return H


def unspilled(path: Path, K: int) -> torch.Tensor:
    """The Hessian ``spilled`` wrote, float32 [K, K], read back bit for bit (pread, not the memory map); the file
    is removed.  A damaged file is refused by the container, one of another shape here."""
    reader = SourceReader(open_model(path))
    try:
        H = reader.read("hessian")
    finally:
        reader.close()
    if H.shape != (K, K) or H.dtype != np.float32:
        raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"expected a float32 {K} x {K} Hessian, found {H.dtype} "
                        f"{list(H.shape)}", file=str(path), tensor="hessian")
    path.unlink()
    return torch.from_numpy(H)


# ------------------------------------------------------------------------------------------------ preflight

#: Stored bits per weight of all distinct candidate settings of one layer, summed (the extended tables give
#: 76-85 with overhead; upstream's alone fewer): what the parked candidates of a block take on disk.
_CANDIDATE_BITS = 88


def disk_needed(spec, src, o: QuantOptions, measuring: bool) -> tuple[int, int]:
    """Bytes the run will write, a slight overestimate, as (output, work directory): the output (decoder linears
    at ``bits``, the head at ~``head_bits`` + overhead, everything else as fp16); in the work directory the
    per-layer copies (the quantized part again), one block's parked candidates while measuring (the quantize
    pass's parked Hessian, at most the largest K x K float32, comes after them), and two hidden-state
    snapshots."""
    lin = sum(K * N for i, kind in model_blocks(spec) for n in block_linears(spec, kind, i)
              for N, K in [spec.linear_shape(n)])
    quant_bits = float(o.bits) + 0.2 if o.target == "exl2" else float(o.bits) + 0.3
    head = spec.vocab_size * spec.hidden_size
    head_bits = (o.head_bits + 1.5) if o.quantized_head else 16      # (a tied head: the fp16 embedding)
    other = sum(int(np.prod(src.shape(n))) for n in src.names()) - lin - head
    headers = 2048 * len(src.names())          # safetensors header entries: ~6 slots x ~200 bytes per weight
    out = lin * quant_bits / 8 + head * head_bits / 8 + max(other, 0) * 2 + headers
    if o.quantized_head and getattr(spec, "tied", False):   # the quantized head beside the fp16 embedding
        out += head * 2
    quantized = lin * quant_bits / 8 + (head * head_bits / 8 if o.quantized_head else 0)
    block = max(sum(K * N for n in block_linears(spec, kind, i) for N, K in [spec.linear_shape(n)])
                for i, kind in model_blocks(spec))
    hessian = max(K * K * 4 for i, kind in model_blocks(spec) for n in block_linears(spec, kind, i)
                  for _, K in [spec.linear_shape(n)]) if SPILL_HESSIANS and torch.device(o.device).type == "cpu" else 0
    hessian = hessian if hessian >= SPILL_MIN_BYTES else 0
    variants = max(block * _CANDIDATE_BITS / 8 if measuring else 0, hessian)
    hidden = 2 * 4 * o.rows * o.length * spec.hidden_size
    return int(out), int(quantized + variants + hidden)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(dst_parent: Path, work_root: Path, need: tuple[int, int]) -> None:
    """Refuse to start when a filesystem has less free space than the run will write to it (``need`` = (output
    bytes, work-directory bytes); both count against one filesystem when DST and the work directory share it)."""
    out_at, work_at = _existing(dst_parent), _existing(work_root)
    try:
        same = os.stat(out_at).st_dev == os.stat(work_at).st_dev
        checks = [(out_at, need[0] + need[1])] if same else [(out_at, need[0]), (work_at, need[1])]
    except OSError:
        return
    for probe, n in checks:
        _check_free(probe, n)


def _check_free(probe: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return                                   # cannot tell: let the writes report what happens
    if free < need:
        raise Exl2Error(ErrorCode.DISK_SPACE, f"the run needs about {need / 1e9:.2f} GB for its work files and "
                        f"the output, and the filesystem has {free / 1e9:.2f} GB free; free some space, or choose a "
                        "destination or --work-dir on another filesystem", file=str(probe))
