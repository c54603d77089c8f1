"""Regular files only: ``stat_regular`` / ``open_regular`` (moved here from ``reader`` so that the guarded JSON
loader, ``jsonload``, and the safetensors reader share them without an import cycle; ``reader`` re-exports them).

Opening a FIFO blocks until a writer appears and a character device never ends: every reader of a file the user
named (a shard, config.json, the index, a side input) stats it first and opens it non-blocking, checking the kind
again on the open descriptor.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import ErrorCode, Exl2Error

__all__ = ["file_kind", "stat_regular", "open_regular", "real_path", "is_within"]


def _err(code: ErrorCode, msg: str, path: str) -> Exl2Error:
    return Exl2Error(code, msg, file=path)


def file_kind(st: os.stat_result) -> str:
    """What a stat result describes, for messages: "a regular file", "a FIFO (named pipe)", ..."""
    m = st.st_mode
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(m):
            return what
    return "a special file"  # pragma: no cover - no other kinds on Linux


def stat_regular(path: str) -> os.stat_result:
    """``os.stat`` of a file that must be regular: PATH_NOT_FOUND / IO_ERROR naming what is there instead.
    Called before any ``open``: opening a FIFO blocks until a writer appears, a device never ends."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise _err(ErrorCode.IO_ERROR, "expected a regular file, found a symlink to nothing", path) from None
        raise _err(ErrorCode.PATH_NOT_FOUND, "expected an existing file, found nothing at this path", path) from None
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot stat: {e.strerror or e}", path) from None
    if not stat.S_ISREG(st.st_mode):
        raise _err(ErrorCode.IO_ERROR, f"expected a regular file, found {file_kind(st)}", path)
    return st


def open_regular(path: str):
    """Open ``path`` for binary reading only if it is a regular file (checked on the open descriptor, so a
    file swapped for a FIFO after ``stat_regular`` cannot block: the open itself is non-blocking)."""
    stat_regular(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _err(ErrorCode.IO_ERROR, f"expected a regular file, found {file_kind(st)}", path)
        return open(fd, "rb")  # noqa: SIM115 - the caller closes it
    except BaseException:
        os.close(fd)
        raise


def real_path(p: "str | os.PathLike") -> Path:
    """The path with every link resolved (``os.path.realpath``); the absolute path where that fails."""
    try:
        return Path(os.path.realpath(os.fspath(p)))
    except (OSError, ValueError):
        return Path(os.path.abspath(os.fspath(p)))


def is_within(child: Path, parent: Path) -> bool:
    """``child`` is ``parent`` or lies below it (plain path comparison: resolve both first)."""
    return child == parent or parent in child.parents
