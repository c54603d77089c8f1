"""The one gate for the source's side files (tokenizer files, model card, license, generation config, custom
code...) that a converter or the quantizer copies into its output or reads to write the output's metadata.

A side file is used only when it is a **regular file whose real path lies inside the source directory**: a
symbolic link that leads elsewhere (``LICENSE -> /proc/self/environ``, ``README.md -> ~/.cache/huggingface/token``),
a FIFO, a device, a socket, a broken or looping link are skipped with a warning that names the file and why,
and are never opened for reading.  The one exception is the Hugging Face cache's own layout: a model directory
``.../models--ORG--NAME/snapshots/REV`` whose files are links to ``.../models--ORG--NAME/blobs/HASH`` (the blob's
real path must lie inside that ``blobs`` directory, so a blob that is itself a link to elsewhere is still refused).

Every use is bounded by a cap per kind (``cap_for``): the size is checked with ``fstat`` on the opened file
before anything is read and enforced again while reading or copying (a file that grows, or one whose size the
kernel does not report), so a multi-GB sparse ``README.md`` is skipped with a warning, never read whole.

``copy_side_file`` copies one file, ``read_side_text`` reads one into a string, ``stage_side_files`` copies a
chosen few into a private temporary directory for a third-party reader that opens files by name (gguf-py's
``Metadata.load`` and ``SpecialVocab``).  Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import ErrorCode, Exl2Error
from .regular import is_within

__all__ = ["CARD_CAP", "TEXT_CAP", "TOKENIZER_CAP", "OTHER_CAP", "cap_for", "side_file_problem", "copy_side_file",
           "read_side_text", "stage_side_files", "skip_message"]

#: a model card read into the output's card (and copied): a few MB is far beyond any real card
CARD_CAP = 4 << 20
#: small text side files: JSON configs, license and notice files, custom code, chat templates
TEXT_CAP = 16 << 20
#: tokenizer files (a tokenizer.json of a 256k vocabulary is ~35 MB; SentencePiece models a few MB)
TOKENIZER_CAP = 128 << 20
#: anything else a dense output carries over (images of a card, a tokenizer sub-folder's files...)
OTHER_CAP = 64 << 20

_TOKENIZER_SUFFIXES = (".model", ".tiktoken", ".txt")
_TOKENIZER_NAMES = {"tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json"}
_TEXT_SUFFIXES = (".json", ".jinja", ".py", ".yaml", ".yml")
_CHUNK = 1 << 20


def cap_for(name: str) -> int:
    """The byte cap for a side file called ``name`` (its base name decides the kind)."""
    base = os.path.basename(name)
    low = base.lower()
    if low.endswith(".md"):
        return CARD_CAP
    if base in _TOKENIZER_NAMES or low.startswith(("tokenizer", "spiece", "sentencepiece", "vocab", "merges")) \
            or low.endswith(_TOKENIZER_SUFFIXES):
        return TOKENIZER_CAP
    if low.endswith(_TEXT_SUFFIXES) or low.startswith(("license", "licence", "notice", "use_policy")):
        return TEXT_CAP
    return OTHER_CAP


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} bytes"


def skip_message(rel: str, why: str) -> str:
    """The warning for a side file that was left out."""
    return f"{rel}: not copied or read ({why})"




def _kind(mode: int) -> str:
    """Short words for the skip warning (``regular.file_kind`` is the longer form of error messages)."""
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return what
    return "not a regular file"


def _allowed_roots(src_root: Path) -> list[str]:
    """The real source directory, plus the ``blobs`` folder of a Hugging Face cache snapshot."""
    real = os.path.realpath(src_root)
    roots = [real]
    snap = Path(real)
    if snap.parent.name == "snapshots" and snap.parent.parent.name.startswith(("models--", "datasets--")):
        roots.append(os.path.realpath(snap.parent.parent / "blobs"))
    return roots


def _open_checked(src_root: Path, path: Path, cap: int | None) -> tuple[int | None, str | None]:
    """(an open read-only fd, None) for a side file that may be used, else (None, why not).  Nothing that is
    not a regular file inside the source is opened."""
    cap = cap_for(path.name) if cap is None else cap
    try:
        st = os.lstat(path)
    except OSError as e:
        return None, f"cannot stat it: {e.strerror or e}"
    link = stat.S_ISLNK(st.st_mode)
    try:
        real = os.path.realpath(path, strict=True)
    except (OSError, RuntimeError, ValueError):
        return None, "a broken or looping symbolic link"
    if not any(is_within(Path(real), Path(r)) for r in _allowed_roots(src_root)):
        what = f"a symbolic link to {real}" if link else f"its real path {real}"
        return None, f"{what} lies outside the source directory"
    try:
        st = os.stat(real)
    except OSError as e:
        return None, f"cannot stat it: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return None, _kind(st.st_mode) + (" (through a symbolic link)" if link else "")
    if st.st_size > cap:
        return None, f"{st.st_size} bytes, over the {_mib(cap)} limit for this kind of file"
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_BINARY", 0))
    except OSError as e:
        return None, f"cannot open it: {e.strerror or e}"
    try:
        fst = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        return None, f"cannot stat it: {e.strerror or e}"
    if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or fst.st_size > cap:
        os.close(fd)
        return None, "it changed while it was being checked"
    return fd, None


def side_file_problem(src_root: str | os.PathLike, path: str | os.PathLike, cap: int | None = None) -> str | None:
    """None when ``path`` may be used as a side file of the source ``src_root``; else why not."""
    fd, why = _open_checked(Path(os.fspath(src_root)), Path(os.fspath(path)), cap)
    if fd is not None:
        os.close(fd)
    return why


def read_side_text(src_root: str | os.PathLike, path: str | os.PathLike, cap: int | None = None,
                   warnings: list[str] | None = None, rel: str | None = None) -> str | None:
    """The text of a side file (UTF-8, undecodable bytes replaced), or None when it is absent or may not be
    used (the reason appended to ``warnings`` when given, unless the file is simply absent)."""
    p = Path(os.fspath(path))
    if not os.path.lexists(p):
        return None
    cap = cap_for(p.name) if cap is None else cap
    fd, why = _open_checked(Path(os.fspath(src_root)), p, cap)
    if fd is None:
        if warnings is not None:
            warnings.append(skip_message(rel or p.name, why))
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(cap + 1)
        except OSError as e:
            if warnings is not None:
                warnings.append(skip_message(rel or p.name, f"cannot read it: {e.strerror or e}"))
            return None
    if len(data) > cap:
        if warnings is not None:
            warnings.append(skip_message(rel or p.name, f"more than the {_mib(cap)} limit for this kind of file"))
        return None
    return data.decode("utf-8", errors="replace")


def copy_side_file(src_root: str | os.PathLike, path: str | os.PathLike, out: str | os.PathLike,
                   cap: int | None = None) -> str | None:
    """Copy the side file ``path`` of the source ``src_root`` to ``out``, at most ``cap`` bytes (the kind's cap
    by default).  Returns None when copied, else why it was skipped (``out`` is then absent).  A failure to
    write ``out`` is ``IO_ERROR`` naming it."""
    p, o = Path(os.fspath(path)), Path(os.fspath(out))
    cap = cap_for(p.name) if cap is None else cap
    fd, why = _open_checked(Path(os.fspath(src_root)), p, cap)
    if fd is None:
        return why
    n = 0
    with os.fdopen(fd, "rb") as f:
        try:
            fo = open(o, "wb")
        except OSError as e:
            raise Exl2Error(ErrorCode.IO_ERROR, f"cannot write a copy of {p.name}: {e.strerror or e}",
                            file=str(o)) from None
        with fo:
            while True:
                try:
                    b = f.read(_CHUNK)
                except OSError as e:
                    why = f"cannot read it: {e.strerror or e}"
                    break
                if not b:
                    break
                n += len(b)
                if n > cap:
                    why = f"more than the {_mib(cap)} limit for this kind of file"
                    break
                try:
                    fo.write(b)
                except OSError as e:
                    raise Exl2Error(ErrorCode.IO_ERROR, f"cannot write a copy of {p.name}: {e.strerror or e}",
                                    file=str(o)) from None
    if why is not None:
        with contextlib.suppress(OSError):
            os.unlink(o)
    return why


@contextlib.contextmanager
def stage_side_files(src_root: str | os.PathLike, names: Iterable[str], warnings: list[str] | None = None
                     ) -> Iterator[Path]:
    """A private temporary directory named like ``src_root`` holding copies of those of ``names`` (top-level
    files of the source) that pass the gate, for readers that open files by name.  Removed on exit."""
    src = Path(os.fspath(src_root))
    base = tempfile.mkdtemp(prefix="exl2fmt-side-")
    try:
        d = Path(base) / (src.name or "model")
        d.mkdir()
        for name in names:
            p = src / name
            if not os.path.lexists(p):
                continue
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            why = copy_side_file(src, p, d / name)
            if why is not None and warnings is not None:
                warnings.append(skip_message(name, why))
        yield d
    finally:
        shutil.rmtree(base, ignore_errors=True)
