"""Publishing outputs atomically: temp file + rename for one file, a marked working directory + rename for a
model directory, and the path rules around them.

* ``atomic_write`` writes one file through a temp file in the same directory, fsync, ``os.replace`` (the
  writer's ``write_safetensors`` / ``write_sharded`` use it).
* A conversion or a quantization builds its whole output in ``make_partial_dir(DST)`` (a hidden sibling with an
  owner marker, see ``exl2fmt.container.partials``) and ``publish``-es it by renaming; ``check_paths`` refuses a
  DST that is, contains or lies inside SRC and an existing DST without ``force``; ``remove_path`` cleans up.
* ``naming_write_errors`` / ``name_unnamed_os_error`` turn an ``OSError`` (a full disk, EIO) into ``IO_ERROR``
  naming the file or the working directory.

``--force`` replaces an output *of the same kind*, never anything else (git refuses to clobber untracked files,
``huggingface-cli download --local-dir`` writes only into a model folder; ``replaceable``):

* a model directory (``kind="dir"``: the fp16/bf16/gptq/exl2 targets) replaces only a directory that is empty
  or that exl2fmt (or any Hugging Face tool) could have written: it holds ``config.json`` or
  ``exl2fmt-manifest.json`` and at least one ``.safetensors`` file (sub-directories are allowed: a converter
  copies the source's, e.g. a tokenizer folder);
* a GGUF file (``kind="gguf"``) replaces only a regular file that starts with the GGUF magic.

(The single-file side outputs have their rule in ``exl2fmt.outputs``.)  Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from ..errors import ErrorCode, Exl2Error

__all__ = [
    "atomic_write", "write_text", "naming_write_errors", "name_unnamed_os_error", "check_paths", "make_partial_dir",
    "stale_note", "remove_path", "fsync_dir", "publish", "copy_side_files", "lower_shield", "replaceable",
    "existing_output_error",
]

# Files of SRC that are never copied: weights (rewritten), indexes (regenerated; a stale one breaks loaders),
# quantization side files (rewritten by the converter when the target needs one), and the artefacts of a
# quantized source that are not true of any other output (exl2fmt's manifest, ExLlamaV2's measurement, a
# separate quantization_config.json): issue 41.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
_SKIP_NAMES = {"config.json", "quantize_config.json", "quant_config.json", "quantization_config.json",
               "exl2fmt-manifest.json", "measurement.json"}
_SKIP_DIRS = {".git", ".cache", "__pycache__", ".huggingface"}
_INDEX_RE = re.compile(r".*\.(safetensors|bin)\.index\.json$")


def atomic_write(path: Path, write: Callable[[BinaryIO], None], *, durable: bool = True) -> None:
    """Write via a temp file in the same directory, fsync, os.replace; the temp file never survives.
    ``durable=False`` skips both fsyncs (still atomic): for scratch files that a crash makes worthless anyway."""
    parent = path.parent if str(path.parent) else Path(".")
    tmp = None
    for _ in range(100):
        cand = parent / f".{path.name[:180]}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(cand, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise Exl2Error(ErrorCode.IO_ERROR, f"cannot create a temp file next to the output: {e.strerror or e}",
                            file=str(path)) from None
        tmp = cand
        break
    if tmp is None:  # pragma: no cover
        raise Exl2Error(ErrorCode.IO_ERROR, "cannot create a temp file next to the output", file=str(path))
    done = False
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        done = True
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot write: {e.strerror or e}", file=str(path)) from None
    finally:
        if not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    if durable:
        fsync_dir(parent)  # make the rename durable (best effort; not possible on every platform)


def write_text(path: Path, text: str) -> None:
    """Write a new text file (never replacing one: mode ``x``) and fsync it; OSError -> IO_ERROR naming it."""
    with naming_write_errors(path):
        with open(path, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def naming_write_errors(path):
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
    when it is an output of the same ``kind`` (``replaceable``)."""
    rs, rd = _resolve(src), _resolve(dst)
    # a directory source: nothing may be written inside it; any source: DST must not be it or contain it
    # (replacing DST with --force would delete it)
    if rd == rs or (rs.is_dir() and _is_within(rd, rs)) or _is_within(rs, rd):
        raise Exl2Error(ErrorCode.USAGE, f"the destination {dst} must lie outside the source {src} (and not "
                        "contain it): a conversion never writes into or replaces its source", file=str(dst))
    err = existing_output_error(dst, force, kind)
    if err is not None:
        raise err


def replaceable(dst: str | os.PathLike, kind: str) -> str | None:
    """None when ``dst`` (which exists) may be replaced by an output of ``kind``; otherwise what it is, for the
    message ("a regular file", "a directory without config.json and .safetensors files", ...)."""
    p = Path(os.fspath(dst))
    if p.is_symlink():
        return "a symbolic link"
    if kind == "gguf":
        if p.is_dir():
            return "a directory"
        if not p.is_file():
            return "not a regular file"
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            return f"unreadable ({e.strerror or e})"
        return None if magic == b"GGUF" else "a file that is not GGUF (no GGUF magic)"
    if not p.is_dir():
        return "a regular file" if p.is_file() else "not a directory"
    try:
        entries = list(os.scandir(p))
    except OSError as e:
        return f"an unreadable directory ({e.strerror or e})"
    if not entries:
        return None
    names = {e.name for e in entries}
    has_meta = bool(names & {"config.json", "exl2fmt-manifest.json"})
    has_weights = any(n.endswith(".safetensors") for n in names)
    if not (has_meta and has_weights):
        return "a directory that holds no model (no config.json and .safetensors files)"
    return None


def existing_output_error(dst: str | os.PathLike, force: bool, kind: str) -> Exl2Error | None:
    """The error for an existing ``dst`` (None when it does not exist, or ``force`` may replace it)."""
    p = Path(os.fspath(dst))
    if not os.path.lexists(p):
        return None
    what = "directory" if p.is_dir() and not p.is_symlink() else "file"
    why = replaceable(p, kind)
    if why is None:
        if force:
            return None
        return Exl2Error(ErrorCode.OUTPUT_EXISTS, f"the output {what} exists; pass --force to replace it",
                         file=str(dst))
    wants = "a GGUF file" if kind == "gguf" else "a model directory (or an empty one)"
    return Exl2Error(ErrorCode.OUTPUT_EXISTS, f"the output path exists and is {why}; --force replaces only "
                     f"{wants}: remove it yourself or choose another output path", file=str(dst))


def make_partial_dir(dst: Path, removed: list[str] | None = None) -> Path:
    """A new working directory ``.<DST name>.exl2fmt-partial-<hex>`` next to DST, with an owner marker
    (exl2fmt/container/partials.py); first removes the partials that dead earlier runs left for this same DST (their
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


def remove_path(path: Path) -> None:
    """Remove a file, a symlink or a directory tree if it is there (best effort: errors are ignored)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            path.unlink()
    except OSError:
        pass


def fsync_dir(path: Path) -> None:
    """fsync a directory, making a rename in it durable (best effort; not possible on every platform)."""
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
    fsync_dir(dst.parent if str(dst.parent) else Path("."))
    if old is not None:
        remove_path(old)


def copy_side_files(src_dir: Path, tmp: Path, extra_skip: Iterable[str] = (),
                    warnings: list[str] | None = None) -> list[str]:
    """Copy every file of SRC that is not a weight, an index or a quantization artefact of the source
    (recursively; hidden tool directories skipped) through the side-file gate (``sidefiles``: a regular file
    inside SRC, under its kind's size cap; a link out of SRC, a FIFO or device, an over-cap file is skipped and
    named in ``warnings``).  Returns the relative paths copied."""
    from .sidefiles import copy_side_file, skip_message

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
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                why = copy_side_file(src_dir, src, out)
            except OSError as e:  # pragma: no cover - copy_side_file names its own errors
                raise Exl2Error(ErrorCode.IO_ERROR, f"cannot copy {src}: {e.strerror or e}",
                                file=str(e.filename or out)) from None
            if why is not None:
                if warnings is not None:
                    warnings.append(skip_message(str(rel), why))
                if rel_root != Path("."):
                    with contextlib.suppress(OSError):
                        out.parent.rmdir()   # only when nothing else was copied there
                continue
            copied.append(str(rel))
    return copied


# ------------------------------------------------------------------------------------------------ driver



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


