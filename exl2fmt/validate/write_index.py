"""``validate --fix-index``: the one part of validation that writes a file (``model.safetensors.index.json``,
atomically: temporary sibling + fsync + rename).  Tensor files are never touched."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ErrorCode, Exl2Error

__all__ = ["fix_index"]


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot write: {e.strerror or e}", file=str(path)) from None


def fix_index(path: str | os.PathLike) -> dict:
    """Write a correct ``model.safetensors.index.json`` for the model directory ``path``, atomically.

    The weight map is built from the headers of every ``*.safetensors`` file in the directory (what ExLlamaV2
    loads); ``metadata.total_size`` is the sum of tensor bytes.  Tensor files are never touched.  Raises
    ``DUPLICATE_TENSOR`` when a name occurs in two shards (no correct index exists), or the header error of a
    broken shard.  Returns {"path", "tensors", "shards", "total_size", "replaced"}.
    """
    from ..container import INDEX_NAME, read_header

    d = Path(os.fspath(path))
    if not d.is_dir():
        raise Exl2Error(ErrorCode.USAGE, "--fix-index needs a model directory, not a file", file=str(d))
    try:
        files = sorted(q for q in d.glob("*.safetensors") if q.is_file())
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot list the directory: {e.strerror or e}", file=str(d)) from None
    if not files:
        raise Exl2Error(ErrorCode.NO_SAFETENSORS, "expected at least one .safetensors file, found none", file=str(d))
    weight_map: dict[str, str] = {}
    total = 0
    for f in files:
        hdr = read_header(f)
        for name, t in hdr.tensors.items():
            if name in weight_map:
                raise Exl2Error(ErrorCode.DUPLICATE_TENSOR, f"in both {weight_map[name]} and {f.name}; remove one "
                                "copy before writing an index", tensor=name, file=str(f))
            weight_map[name] = f.name
            total += t.nbytes
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    out = d / INDEX_NAME
    replaced = out.exists()
    _atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    return {"path": str(out), "tensors": len(weight_map), "shards": len(files), "total_size": total,
            "replaced": replaced}
