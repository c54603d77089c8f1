"""Where the quantizer keeps its resumable state, and how far an interrupted run got (torch-free: the CLI reads it
to say "resuming at block N of M" or where the progress of an interrupted run was saved).

The work directory holds ``job.json`` (see ``exl2fmt.quant.job``): ``measured`` (block key -> rows),
``strategy`` (set once the measurement is done), ``blocks`` (block key -> result, once a block is quantized),
``snapshot`` ({"phase": "measure"|"quant", "next_block": i}: the hidden state saved before block i) and the
``fingerprint`` with the source's ``config.json``.

The work directory is always ``.<DST name>.exl2fmt-work``: next to DST, or inside ``--work-dir DIR`` (DIR
itself is the user's and is never removed).  exl2fmt makes it with an owner marker (``.exl2fmt-owner.json``,
``"kind": "work"``) and removes it after a successful run only while that marker is there: a directory it did
not make is never deleted (issue 41).  ``check_work_dir`` runs before any work: ``--work-dir`` must not be, or
lie inside, the source or the destination, the work directory must be ours (or not exist yet), and a leftover
job needs ``--resume``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from ..container import jsonload
from ..container.partials import MARKER, owner_record, read_marker, work_dir_name
from ..container.regular import is_within, real_path
from ..errors import ErrorCode, Exl2Error

__all__ = ["work_root", "progress_of", "describe", "check_work_dir", "make_work_dir", "is_our_work_dir",
           "remove_work_dir"]


def work_root(dst: str | os.PathLike, work_dir: str | os.PathLike | None = None) -> Path:
    """The work directory of a quantization into ``dst``: ``.<DST name>.exl2fmt-work`` inside ``work_dir``, or
    next to DST."""
    d = Path(os.fspath(dst))
    base = Path(os.fspath(work_dir)) if work_dir else (d.parent if str(d.parent) else Path("."))
    return base / work_dir_name(d)




def is_our_work_dir(root: Path) -> bool:
    """True when ``root`` is a real directory (not a link) of this user that carries exl2fmt's work marker."""
    try:
        st = os.lstat(root)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return False
    doc = read_marker(root)
    return doc is not None and doc.get("tool") == "exl2fmt" and doc.get("kind") == "work"


def check_work_dir(src: str | os.PathLike, dst: str | os.PathLike, work_dir: str | os.PathLike | None,
                   resume: bool) -> Path:
    """The work directory of a quantization of ``src`` into ``dst``, checked before any work (``Exl2Error``):

    * ``--work-dir`` must be a directory (or not exist yet) outside the source and outside the destination
      (``USAGE``): the source is never written to, and DST is replaced when the output is published;
    * the work directory itself (``.<DST name>.exl2fmt-work`` there) must not be or hold the source or DST;
      if it exists it must be one exl2fmt made (a real directory with its work marker: ``OUTPUT_EXISTS``
      otherwise, since it would be removed after the run), and a job in it needs ``--resume``
      (``OUTPUT_EXISTS``), refused here rather than after the calibration set is loaded."""
    rs, rd = real_path(Path(os.fspath(src))), real_path(Path(os.fspath(dst)))
    if work_dir is not None:
        w = Path(os.fspath(work_dir))
        rw = real_path(w)
        if os.path.exists(w) and not os.path.isdir(w):
            raise Exl2Error(ErrorCode.USAGE, f"--work-dir {os.fspath(w)} is not a directory: it names the "
                            "directory the quantizer's work directory is made in", file=os.fspath(w))
        if is_within(rw, rs):
            raise Exl2Error(ErrorCode.USAGE, f"--work-dir {os.fspath(w)} is or lies inside the source "
                            f"{os.fspath(src)}: the work directory must lie outside the source (a conversion "
                            "never writes into its source)", file=os.fspath(w))
        if is_within(rw, rd):
            raise Exl2Error(ErrorCode.USAGE, f"--work-dir {os.fspath(w)} is or lies inside the destination "
                            f"{os.fspath(dst)}: the work directory must lie outside it (DST is replaced when "
                            "the output is published)", file=os.fspath(w))
    root = work_root(dst, work_dir)
    rr = real_path(root)
    for p, what in ((rs, "source"), (rd, "destination")):
        if is_within(rr, p) or is_within(p, rr):
            raise Exl2Error(ErrorCode.USAGE, f"the work directory {root} would be, lie in or hold the {what}: "
                            "choose another --work-dir", file=str(root))
    if not os.path.lexists(root):
        return root
    if os.path.islink(root) or not os.path.isdir(root):
        raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "the work directory path exists and is "
                        f"{'a symbolic link' if os.path.islink(root) else 'not a directory'}; the quantizer "
                        "makes its own work directory there: remove it or choose another --work-dir",
                        file=str(root))
    if not is_our_work_dir(root):
        raise Exl2Error(ErrorCode.OUTPUT_EXISTS, f"the work directory exists but exl2fmt did not make it (no "
                        f"{MARKER} work marker), so it would not be removed after the run: remove or rename it, "
                        "or choose another --work-dir", file=str(root))
    if (root / "job.json").exists() and not resume:
        raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "an interrupted quantization left this work directory; pass "
                        "--resume to continue it, or delete it to start over", file=str(root))
    return root


def make_work_dir(root: Path, dst: str | os.PathLike) -> None:
    """Make the work directory ``root`` (its parents as needed) with exl2fmt's work marker; ``root`` must not
    exist (``FileExistsError`` otherwise: a directory made meanwhile is not taken over)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    root.mkdir()
    doc = dict(owner_record(Path(os.fspath(dst))), kind="work")
    try:
        fd = os.open(root / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc) + "\n")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def remove_work_dir(root: Path) -> bool:
    """Remove the work directory ``root`` after a successful run, only if exl2fmt made it (its marker is
    there); True when it was removed."""
    if not is_our_work_dir(root):
        return False
    shutil.rmtree(root, ignore_errors=True)
    return not os.path.lexists(root)


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
