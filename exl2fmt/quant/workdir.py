"""Where the quantizer keeps its resumable state, and how far an interrupted run got (torch-free: the CLI reads it
to say "resuming at block N of M" or where the progress of an interrupted run was saved).

The work directory holds ``job.json`` (see ``exl2fmt.quant.pipeline``): ``measured`` (block key -> rows),
``strategy`` (set once the measurement is done), ``blocks`` (block key -> result, once a block is quantized),
``snapshot`` ({"phase": "measure"|"quant", "next_block": i}: the hidden state saved before block i) and the
``fingerprint`` with the source's ``config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..container import jsonload
from ..container.partials import work_dir_name
from ..errors import Exl2Error

__all__ = ["work_root", "progress_of", "describe"]


def work_root(dst: str | os.PathLike, work_dir: str | os.PathLike | None = None) -> Path:
    """The work directory of a quantization into ``dst``: ``work_dir``, or ``.<DST name>.exl2fmt-work`` next to
    DST."""
    d = Path(os.fspath(dst))
    return Path(os.fspath(work_dir)) if work_dir else d.parent / work_dir_name(d)


def progress_of(root: str | os.PathLike) -> dict | None:
    """How far the run in ``root`` got: {"phase": "measurement"|"quantization", "block": next block (1-based),
    "blocks": M, "done": blocks finished in that phase}; None when there is no readable job.json."""
    p = Path(os.fspath(root)) / "job.json"
    try:  # the guarded loader: a FIFO never blocks, caps and parser errors are an Exl2Error
        job = jsonload.load_json(p, jsonload.JOB)
    except Exl2Error:
        return None
    if not isinstance(job, dict):
        return None

    def obj(v) -> dict:  # a field of the wrong type reads as absent: this only describes progress
        return v if isinstance(v, dict) else {}

    def count(v) -> int:
        return len(v) if isinstance(v, (dict, list)) else 0

    fp = obj(job.get("fingerprint"))
    n = obj(fp.get("source_config")).get("num_hidden_layers")
    blocks = 2 * n if type(n) is int and 0 < n < 1 << 20 else None
    snap = obj(job.get("snapshot"))
    if job.get("strategy") is None and fp.get("target") == "exl2":
        done = count(job.get("measured"))
        return {"phase": "measurement", "done": done, "block": done + 1, "blocks": blocks}
    done = count(job.get("blocks"))
    nb = snap.get("next_block", 0)
    start = nb if snap.get("phase") == "quant" and type(nb) is int and 0 <= nb < 1 << 20 else 0
    return {"phase": "quantization", "done": done, "block": start + 1, "blocks": blocks}


def describe(root: str | os.PathLike) -> str | None:
    """One line for people: "the measurement at block 3 of 8 (2 blocks done)"; None without a job."""
    pr = progress_of(root)
    if pr is None:
        return None
    of = f" of {pr['blocks']}" if pr["blocks"] else ""
    if pr["blocks"] and pr["block"] > pr["blocks"]:
        return f"the {pr['phase']} (all {pr['blocks']} blocks done; the head and the output remain)"
    return f"the {pr['phase']} at block {pr['block']}{of} ({pr['done']} block{'s' if pr['done'] != 1 else ''} done)"
