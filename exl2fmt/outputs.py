"""What may be replaced: the rules for an existing output path (``--force``) and for DST names.

``--force`` replaces an output *of the same kind*, never anything else (git refuses to clobber untracked files,
``huggingface-cli download --local-dir`` writes only into a model folder):

* a model directory or a GGUF file (a conversion's DST): ``exl2fmt.container.publish.replaceable`` (checked by
  ``check_paths``);
* a single-file side output (``file_output_error``: ``dequantize -o`` a ``.npy``, ``--save-measurement`` a
  ``measurement.json``) replaces only a regular file of its own kind (the NumPy magic; a JSON object whose first
  key is ``measurement`` or ``last_module_idx``), and never one in or under the model being read, or
  (``--save-measurement``) any path in the source, the destination or the work directory (issue 41).

``name_warning(dst, target)`` says when the DST name contradicts the target (``out.gguf`` for a directory
target, a GGUF file named without ``.gguf``); ``infer_target(dst)`` gives ``gguf`` for a ``.gguf`` DST.
"""

from __future__ import annotations

import os
from pathlib import Path

from .container.regular import is_within, real_path
from .errors import ErrorCode, Exl2Error

__all__ = ["kind_of", "name_warning", "infer_target", "file_output_error", "FILE_KINDS"]

def kind_of(target: str) -> str:
    return "gguf" if target == "gguf" else "dir"


def name_warning(dst: str | os.PathLike, target: str) -> str | None:
    """A warning when the DST name contradicts the target, else None."""
    name = Path(os.fspath(dst)).name.lower()
    if target == "gguf":
        if not name.endswith(".gguf"):
            return (f"--to gguf writes one file, and {os.fspath(dst)} does not end in .gguf (llama.cpp and the "
                    "Hub look for *.gguf)")
        return None
    if name.endswith((".gguf", ".safetensors", ".bin", ".npy")):
        return (f"--to {target} writes a model directory, but {os.fspath(dst)} is named like a file; it will be "
                "a directory")
    return None


def infer_target(dst: str | os.PathLike) -> str | None:
    """The target a DST name implies when --to is omitted: ``gguf`` for ``*.gguf``, else None."""
    return "gguf" if Path(os.fspath(dst)).name.lower().endswith(".gguf") else None


#: single-file outputs: kind -> (what it is, for messages; a test of the file's first bytes)
FILE_KINDS = {
    "npy": ("a .npy file", lambda head: head.startswith(b"\x93NUMPY")),
    "measurement": ("a measurement.json", lambda head: _starts_like_measurement(head)),
}


def _starts_like_measurement(head: bytes) -> bool:
    import re

    return re.match(rb'\A\s*\{\s*"(measurement|last_module_idx)"\s*:', head) is not None




def file_output_error(path: str | os.PathLike, force: bool, kind: str, flag: str, *,
                      never_inside: tuple = (), no_replace_inside: tuple = ()) -> Exl2Error | None:
    """The error for writing the single file ``path`` (given by ``flag``), or None when it may be written.

    ``never_inside``: (path, what) pairs no output may lie in or under, new or not (``USAGE``: the source of a
    conversion, its destination, the work directory); ``no_replace_inside``: pairs under which an *existing*
    file is never replaced, even with ``force`` (the model ``dequantize`` reads).  An existing path is replaced
    only with ``force``, and only when it is a regular file of ``kind`` (``FILE_KINDS``): never a directory, a
    symbolic link, a FIFO or a file of another kind (``OUTPUT_EXISTS``)."""
    p = Path(os.fspath(path))
    rp = real_path(p)
    for where, what in never_inside:
        if where is None:
            continue
        rw = real_path(where)
        if is_within(rp, rw):
            return Exl2Error(ErrorCode.USAGE, f"{flag} {os.fspath(path)} lies in {what} {os.fspath(where)}: "
                             f"{flag} must name a file outside it (nothing is ever written into {what})",
                             file=os.fspath(path))
    if not os.path.lexists(p):
        return None
    label, matches = FILE_KINDS[kind]
    for where, what in no_replace_inside:
        if where is not None and is_within(rp, real_path(where)):
            return Exl2Error(ErrorCode.OUTPUT_EXISTS, f"{flag}: the file exists and is part of {what} "
                             f"{os.fspath(where)}; it is never replaced, even with --force: choose another path",
                             file=os.fspath(path))
    import stat as _stat

    try:
        st = os.lstat(p)
    except OSError as e:
        return Exl2Error(ErrorCode.OUTPUT_EXISTS, f"{flag}: the output path exists and cannot be examined "
                         f"({e.strerror or e})", file=os.fspath(path))
    if _stat.S_ISLNK(st.st_mode):
        why = "a symbolic link"
    elif _stat.S_ISDIR(st.st_mode):
        why = "a directory"
    elif not _stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    else:
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
            try:
                head = os.read(fd, 256)
            finally:
                os.close(fd)
        except OSError as e:
            head, why = b"", f"unreadable ({e.strerror or e})"
        else:
            why = None if matches(head) else f"a file that is not {label}"
    if why is None:
        if force:
            return None
        return Exl2Error(ErrorCode.OUTPUT_EXISTS, f"{flag}: the output file exists; pass --force to replace it",
                         file=os.fspath(path))
    return Exl2Error(ErrorCode.OUTPUT_EXISTS, f"{flag}: the output path exists and is {why}; --force replaces "
                     f"only {label}: remove it yourself or choose another path", file=os.fspath(path))
