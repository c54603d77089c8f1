"""Reading safetensors files and model directories: the header check on open, then two ways to the data.

* ``SafetensorsFile`` / ``ModelFiles.get`` hand out read-only, zero-copy views of a memory map (inspect,
  validate: touching a few tensors of a large model costs only the pages touched).
* ``SourceReader`` reads whole tensors (or row ranges) with ``pread`` into private arrays, so a pass over every
  tensor of a model (a conversion, the quantizer's forward) never accumulates the model's pages in the
  resident set: what was read is freed with the array.

Both read only files whose headers ``open_model`` / ``read_header`` validated (``exl2fmt.container.parse``),
and only regular files (``open_regular``: a FIFO or a device never blocks a reader).

Model directories (``open_model``)
----------------------------------
``model.safetensors.index.json`` is used when present (else a single ``*.safetensors.index.json``);
otherwise every ``*.safetensors`` in the directory, sorted, as ExLlamaV2 does.  All shard headers are
parsed when the model is opened (a shard whose header fails raises its ``Exl2Error``); shards are
memory-mapped lazily on ``get`` and at most ``MAX_OPEN_SHARDS`` stay mapped (each mapping holds one file
descriptor).  The index must be a JSON object whose ``weight_map`` maps each tensor (once) to a plain
file name in the directory (no separators, no ``..``), else ``INDEX_INVALID`` (fatal).  Index <-> shard
problems are not fatal: ``ModelFiles.index_issues()`` returns them as ``Issue`` records:

* ``INDEX_MISSING_SHARD``   (error)   the index names a shard file that does not exist;
* ``INDEX_MISSING_TENSOR``  (error)   an indexed tensor is not in the shard the index names;
* ``INDEX_UNLISTED_TENSOR`` (error) a tensor of an indexed shard is not in the index (loaders that follow
  the weight_map never load it); (warning) a ``*.safetensors`` file in the directory is not referenced by
  the index at all (``tensor=None``; its tensors are not loaded, but ExLlamaV2 - which ignores the index -
  would load them);
* ``INDEX_TOTAL_SIZE``      (warning) ``metadata.total_size`` is present and is not a number equal to
  the sum of the tensors' bytes;
* ``DUPLICATE_TENSOR``      (error)   a tensor name is in two shards (also reported without an index).
  ``tensors``/``get`` then use the shard the index names, else the last file in sorted order (like
  ExLlamaV2, which fills its tensor map file by file).

An index whose shards are all missing still opens (with no tensors; the issues say why); a directory
with neither an index nor a ``*.safetensors`` file raises ``NO_SAFETENSORS``.

``config.json`` is parsed lazily on first access of ``ModelFiles.config``, which raises
``CONFIG_INVALID`` if it is not a JSON object (``None`` if there is no config.json); opening the model
never fails because of config.json.
"""

from __future__ import annotations

import collections
import mmap
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..lazynp import np  # numpy on first use: inspect reads headers only

from ..errors import ErrorCode, Exl2Error, Issue, Severity
from . import dtypes  # its SAFETENSORS_DTYPES (numpy dtypes) is built on first use
from . import jsonload
from .parse import SafetensorsHeader, TensorInfo, check_prefix, json_repr, json_type, parse_header_bytes, shorten
from .regular import file_kind, open_regular, stat_regular

__all__ = [
    "MAX_INDEX_BYTES", "MAX_CONFIG_BYTES", "MAX_OPEN_SHARDS", "INDEX_NAME", "file_kind", "open_regular",
    "stat_regular", "read_header", "is_plain_file_name", "SafetensorsFile", "ModelFiles", "open_model",
    "SourceReader",
]

MAX_INDEX_BYTES = jsonload.INDEX.max_bytes
"""Largest ``*.safetensors.index.json`` read."""
MAX_CONFIG_BYTES = jsonload.CONFIG.max_bytes
"""Largest ``config.json`` read."""
MAX_OPEN_SHARDS = 32
"""Most shards a ``ModelFiles`` keeps memory-mapped at once (each holds one file descriptor)."""
INDEX_NAME = "model.safetensors.index.json"


def _err(code: ErrorCode, msg: str, path: str, tensor: str | None = None) -> Exl2Error:
    return Exl2Error(code, msg, file=path, tensor=tensor)


# ------------------------------------------------------------------------------------------------
# one header
# ------------------------------------------------------------------------------------------------

def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file (reads 8 + n bytes, never the data)."""
    p = os.fspath(path)
    try:
        with open_regular(p) as f:
            file_size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            n = check_prefix(first, file_size, p)
            hb = f.read(n)
    except FileNotFoundError:
        raise _err(ErrorCode.PATH_NOT_FOUND, "expected an existing file, found nothing at this path", p) from None
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot read: {e.strerror or e}", p) from None
    if len(hb) < n:
        raise _err(ErrorCode.HEADER_PAST_EOF,
                   f"declared header length {n} bytes, found only {len(hb)} header bytes (file shrank?)", p)
    return parse_header_bytes(hb, n, file_size, p)


# ------------------------------------------------------------------------------------------------
# one file, memory-mapped
# ------------------------------------------------------------------------------------------------

class SafetensorsFile:
    """A validated safetensors file with lazy, read-only, zero-copy access to its tensors.

    The header is validated on construction (no file descriptor is kept); the file is memory-mapped on
    the first ``get``.  Arrays returned by ``get`` are read-only views of the mapping and stay valid after
    ``close()`` (the mapping is then released when the last array is garbage-collected).  As with any
    memory map, truncating the file on disk while arrays are in use makes reading them fault (SIGBUS).
    """

    def __init__(self, path: str | os.PathLike, *, header: SafetensorsHeader | None = None):
        self.path = os.fspath(path)
        self._header = header if header is not None else read_header(self.path)
        self._mm: mmap.mmap | None = None

    # --- header access ---------------------------------------------------------------------------
    @property
    def header(self) -> SafetensorsHeader:
        return self._header

    @property
    def metadata(self) -> dict[str, str]:
        return self._header.metadata

    def names(self) -> list[str]:
        """Tensor names in offset order."""
        return list(self._header.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self._header.tensors.get(name)
        if t is None:
            raise _err(ErrorCode.TENSOR_NOT_FOUND, "expected a tensor of this name, found none in the file",
                       self.path, tensor=name)
        return t

    def __contains__(self, name: object) -> bool:
        return name in self._header.tensors

    def __len__(self) -> int:
        return len(self._header.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._header.tensors)

    # --- data access -----------------------------------------------------------------------------
    def _map(self) -> mmap.mmap:
        if self._mm is not None:
            return self._mm
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self._header.file_size:
                    # the file changed since its header was validated: validate again
                    self._header = read_header(self.path)
                    size = os.fstat(f.fileno()).st_size
                    if size != self._header.file_size:
                        raise _err(ErrorCode.IO_ERROR, "the file changes while being opened", self.path)
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise _err(ErrorCode.PATH_NOT_FOUND, "expected an existing file, found nothing at this path",
                       self.path) from None
        except (OSError, ValueError) as e:
            raise _err(ErrorCode.IO_ERROR, f"cannot memory-map: {getattr(e, 'strerror', None) or e}",
                       self.path) from None
        if len(mm) != self._header.file_size:  # pragma: no cover - race
            mm.close()
            raise _err(ErrorCode.IO_ERROR, "the file changed while being mapped", self.path)
        self._mm = mm
        return mm

    def get_bytes(self, name: str) -> memoryview:
        """The raw little-endian bytes of a tensor (read-only, zero-copy)."""
        t = self.info(name)
        if t.nbytes == 0:
            return memoryview(b"")
        mm = self._map()
        t = self.info(name)
        return memoryview(mm)[t.abs_begin:t.abs_end]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array of its dtype and shape (see ``SAFETENSORS_DTYPES``).

        Sub-byte dtypes (F4, F6_*) come back as a 1-D uint8 array of their packed bytes.
        """
        t = self.info(name)
        spec = dtypes.SAFETENSORS_DTYPES[t.dtype]
        dt = spec.numpy if spec.numpy is not None else np.dtype("u1")
        shape = t.shape if spec.numpy is not None else (t.nbytes,)
        if t.nbytes == 0:
            try:
                arr = np.empty(shape, dtype=dt)
            except (ValueError, OverflowError):
                # A valid header may declare [0, 2**64-1]; numpy cannot represent such a shape.
                raise _err(ErrorCode.SHAPE_INVALID, f"zero-size tensor with shape {list(shape)} has dimensions too "
                           "large for an array", self.path, name) from None
            arr.setflags(write=False)
            return arr
        mm = self._map()
        t = self.info(name)  # the header may have been re-read by _map
        count = t.nbytes // dt.itemsize
        arr = np.frombuffer(mm, dtype=dt, count=count, offset=t.abs_begin)
        return arr.reshape(shape if spec.numpy is not None else (t.nbytes,))

    def release(self, name: str) -> None:
        """Drop this tensor's pages from the process's resident set (``madvise(MADV_DONTNEED)`` on its page range
        of the read-only mapping): arrays from ``get`` stay valid and read the same bytes again, from the page
        cache or the disk, if touched.  A pass that reads each tensor once (the deep validator) stays at the
        size of one tensor instead of growing to the file's.  A no-op where madvise is not available."""
        mm = self._mm
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.info(name)
        page = mmap.PAGESIZE
        a = t.abs_begin // page * page
        b = min(len(mm), -(-t.abs_end // page) * page)
        if b > a:
            try:
                mm.madvise(mmap.MADV_DONTNEED, a, b - a)
            except (OSError, ValueError):
                pass  # a hint only

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # arrays still reference it; it is released with them

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, tensors={len(self)})"


# ------------------------------------------------------------------------------------------------
# model directory
# ------------------------------------------------------------------------------------------------

class _DupDict(dict):
    dups: list


def _dup_hook(pairs: list[tuple[str, Any]]) -> dict:
    d = _DupDict(pairs)
    d.dups = [] if len(d) == len(pairs) else _dups(pairs)
    return d


def _dups(pairs: list[tuple[str, Any]]) -> list[str]:
    seen: set[str] = set()
    out = []
    for k, _ in pairs:
        if k in seen:
            out.append(k)
        seen.add(k)
    return out


def _read_json_file(path: Path, kind: "jsonload.JsonKind") -> Any:
    """config.json / the index through the one guarded loader (size, value-count and depth caps, every parser
    error mapped to the kind's code), keeping duplicate keys visible (``_DupDict.dups``)."""
    return jsonload.load_json(path, kind, object_pairs_hook=_dup_hook)


def _plain_dict(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_dict(v) for v in obj]
    return obj


_BAD_SHARD_CHARS = ("/", "\\", "\x00")


def is_plain_file_name(name: str) -> bool:
    """A shard name an index may use, and a prefix the writer accepts: non-empty, not ``.``/``..``, no path
    separator, no NUL, no drive letter."""
    return (bool(name) and name not in (".", "..") and not any(c in name for c in _BAD_SHARD_CHARS)
            and not (len(name) >= 2 and name[1] == ":"))


class ModelFiles:
    """The safetensors files of one model (one file, a directory with an index, or a glob of shards).

    ``tensors`` maps every tensor name to its ``TensorInfo`` (its ``file`` says which shard).  With an index
    a tensor present in several shards resolves to the shard the index names; without one, to the last
    file in sorted order (as ExLlamaV2, which fills its map file by file).  ``names()`` lists tensors file
    by file in offset order.
    """

    def __init__(self, root: Path, files: list[Path], headers: dict[str, SafetensorsHeader],
                 tensors: dict[str, TensorInfo], index_path: Path | None, issues: list[Issue]):
        self.root = root
        self.files = files
        self.headers = headers
        self.tensors = tensors
        self.index_path = index_path
        self._issues = issues
        self.config_path = root / "config.json"
        self._config_loaded = False
        self._config: dict | None = None
        self._open: "collections.OrderedDict[str, SafetensorsFile]" = collections.OrderedDict()

    # --- config ----------------------------------------------------------------------------------
    @property
    def config(self) -> dict | None:
        """Parsed config.json (None if absent).  Raises ``CONFIG_INVALID`` if it is not a JSON object."""
        if not self._config_loaded:
            if not os.path.exists(self.config_path):
                cfg = None
            else:
                value = _read_json_file(self.config_path, jsonload.CONFIG)
                if not isinstance(value, dict):
                    raise _err(ErrorCode.CONFIG_INVALID,
                               f"expected a JSON object, found {json_type(value)}", str(self.config_path))
                cfg = _plain_dict(value)
            self._config, self._config_loaded = cfg, True
        return self._config

    # --- tensors ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise _err(ErrorCode.TENSOR_NOT_FOUND, "expected a tensor of this name, found none in the model",
                       str(self.root), tensor=name)
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def file(self, path: str | os.PathLike) -> SafetensorsFile:
        """The (cached, lazily mapped) ``SafetensorsFile`` of one shard."""
        key = os.fspath(path)
        f = self._open.get(key)
        if f is not None:
            self._open.move_to_end(key)
            return f
        f = SafetensorsFile(key, header=self.headers.get(key))
        self._open[key] = f
        while len(self._open) > MAX_OPEN_SHARDS:
            _, old = self._open.popitem(last=False)
            old.close()
        return f

    def get(self, name: str) -> np.ndarray:
        t = self.info(name)
        return self.file(t.file).get(name)

    def get_bytes(self, name: str) -> memoryview:
        t = self.info(name)
        return self.file(t.file).get_bytes(name)

    def release(self, name: str) -> None:
        """``SafetensorsFile.release`` on the shard holding ``name``, if that shard is open."""
        f = self._open.get(os.fspath(self.info(name).file))
        if f is not None:
            f.release(name)

    def index_issues(self) -> list[Issue]:
        """Index <-> shard cross-checks and duplicate tensors (see the module docstring)."""
        return list(self._issues)

    def close(self) -> None:
        while self._open:
            _, f = self._open.popitem()
            f.close()

    def __enter__(self) -> "ModelFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ModelFiles({str(self.root)!r}, files={len(self.files)}, tensors={len(self.tensors)})"


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:
        return False


def _find_index(directory: Path) -> Path | None:
    p = directory / INDEX_NAME
    try:
        if p.exists():
            return p
    except OSError:
        pass
    try:
        cands = sorted(q for q in directory.glob("*.safetensors.index.json") if _is_file(q))
    except OSError:
        return None
    return cands[0] if len(cands) == 1 else None


def _glob_shards(directory: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``directory``, sorted.  A subdirectory of that name is ignored; any other
    non-regular entry (a FIFO, a device, a socket, a dangling symlink) is IO_ERROR naming it: it is where a
    shard is expected, and skipping it would report a wrong "no .safetensors file"."""
    try:
        cands = sorted(directory.glob("*.safetensors"))
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot list the directory: {e.strerror or e}", str(directory)) from None
    out = []
    for q in cands:
        try:
            if q.is_dir():
                continue
        except OSError:
            pass
        stat_regular(str(q))
        out.append(q)
    return out


def _outside_links(root: Path, files: list[Path]) -> list[Issue]:
    """A WARNING (SHARD_OUTSIDE_MODEL) for each shard that is a symlink resolving outside ``root``: it is read
    (sharing weights by symlink is common), but the model directory is not self-contained and the target is
    named so that nobody publishes a link into someone else's files unknowingly.  One lstat per shard."""
    issues: list[Issue] = []
    real_root = None
    for f in files:
        try:
            if not os.path.islink(f):
                continue
            if real_root is None:
                real_root = root.resolve()
            target = f.resolve()
        except (OSError, RuntimeError):
            continue
        try:
            target.relative_to(real_root)
        except ValueError:
            issues.append(Issue(ErrorCode.SHARD_OUTSIDE_MODEL,
                                f"expected the shard inside the model directory, found a symlink to {target}",
                                file=str(f), severity=Severity.WARNING))
    return issues


def open_model(path: str | os.PathLike) -> ModelFiles:
    """Open a ``.safetensors`` file, a ``*.safetensors.index.json`` or a model directory.

    Raises PATH_NOT_FOUND, UNSUPPORTED_INPUT (not .safetensors), NO_SAFETENSORS (empty directory),
    INDEX_INVALID, IO_ERROR, or the header error of the first shard that fails.
    """
    p = Path(os.fspath(path))
    try:
        exists = p.exists()
        is_dir = p.is_dir()
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot stat: {e.strerror or e}", str(p)) from None
    if not exists:
        raise _err(ErrorCode.PATH_NOT_FOUND, "expected a .safetensors file or a model directory, found nothing", str(p))
    if not is_dir:
        stat_regular(str(p))  # a FIFO / device / dangling link is IO_ERROR whatever its name
        if p.name.endswith(".safetensors.index.json"):
            return _open_indexed(p.parent, p)
        if not p.name.endswith(".safetensors"):
            suffix = p.suffix or "(no extension)"
            raise _err(ErrorCode.UNSUPPORTED_INPUT,
                       f"expected a .safetensors file or a directory of them, found a {suffix} file", str(p))
        hdr = read_header(p)
        tensors = dict(hdr.tensors)
        return ModelFiles(p.parent, [p], {str(p): hdr}, tensors, None, [])
    index = _find_index(p)
    if index is not None:
        return _open_indexed(p, index)
    files = _glob_shards(p)
    if not files:
        raise _err(ErrorCode.NO_SAFETENSORS, "expected at least one .safetensors file, found none", str(p))
    headers: dict[str, SafetensorsHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    where: dict[str, list[str]] = {}
    for f in files:
        hdr = read_header(f)
        headers[str(f)] = hdr
        for name, t in hdr.tensors.items():
            where.setdefault(name, []).append(str(f))
            tensors.pop(name, None)  # keep file-by-file order; the last file wins
            tensors[name] = t
    issues = _duplicate_issues(where) + _outside_links(p, files)
    return ModelFiles(p, files, headers, tensors, None, issues)


def _duplicate_issues(where: dict[str, list[str]], chosen: Mapping[str, str] | None = None) -> list[Issue]:
    issues = []
    for name, files in where.items():
        if len(files) > 1:
            used = chosen.get(name) if chosen else files[-1]
            issues.append(Issue(ErrorCode.DUPLICATE_TENSOR,
                                f"expected the tensor in one shard, found it in {len(files)}: "
                                f"{', '.join(os.path.basename(f) for f in files)} (using {os.path.basename(used or '')})",
                                tensor=name, file=files[0], severity=Severity.ERROR))
    return issues


def _open_indexed(directory: Path, index: Path) -> ModelFiles:
    ip = str(index)
    doc = _read_json_file(index, jsonload.INDEX)
    if not isinstance(doc, dict):
        raise _err(ErrorCode.INDEX_INVALID, f"expected a JSON object, found {json_type(doc)}", ip)
    wm = doc.get("weight_map")
    if not isinstance(wm, dict):
        raise _err(ErrorCode.INDEX_INVALID, f"expected \"weight_map\" to be an object, found {json_type(wm)}", ip)
    if getattr(wm, "dups", None):
        raise _err(ErrorCode.INDEX_INVALID, f"expected each tensor once in weight_map, found {wm.dups[0]!r} twice",
                   ip, tensor=wm.dups[0])
    plain: set[str] = set()  # shard names already checked (a model has a few, named thousands of times)
    for name, shard in wm.items():
        if type(shard) is str and shard in plain:
            continue
        if not isinstance(shard, str):
            raise _err(ErrorCode.INDEX_INVALID, f"expected a shard file name, found {json_type(shard)}", ip, tensor=name)
        plain.add(shard)
        if not is_plain_file_name(shard):
            raise _err(ErrorCode.INDEX_INVALID,
                       f"expected a plain file name inside the model directory, found {shorten(shard)!r}", ip,
                       tensor=name)
    meta = doc.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise _err(ErrorCode.INDEX_INVALID, f"expected \"metadata\" to be an object, found {json_type(meta)}", ip)

    issues: list[Issue] = []
    per_shard: dict[str, int] = collections.Counter(wm.values())  # shard name -> indexed tensors
    shard_names = sorted(per_shard)
    shard_path = {s: str(directory / s) for s in shard_names}
    files: list[Path] = []
    headers: dict[str, SafetensorsHeader] = {}
    for s in shard_names:
        sp = directory / s
        if not _is_file(sp) and not os.path.lexists(sp):
            n = per_shard[s]
            issues.append(Issue(ErrorCode.INDEX_MISSING_SHARD,
                                f"expected shard file {s!r} ({n} indexed tensors), found no such file",
                                file=str(sp), severity=Severity.ERROR))
            continue
        files.append(sp)
        headers[str(sp)] = read_header(sp)

    simple = _single_copies(files, headers, wm, shard_path)
    if simple is not None:  # the usual model: whole-dict operations give what the tensor-by-tensor pass below gives
        tensors, loc = simple
        if len(loc.keys() - wm.keys()):
            for name, sf in loc.items():
                if name not in wm:
                    issues.append(Issue(ErrorCode.INDEX_UNLISTED_TENSOR,
                                        f"expected every shard tensor in the index, found {name!r} in "
                                        f"{os.path.basename(sf)} but not in weight_map (loaders that follow "
                                        f"the index never load it)", tensor=name, file=sf, severity=Severity.ERROR))
        # every tensor of every shard is exposed, and a shard's tensors fill its data buffer without gaps (the
        # header's layout check), so their bytes add up to the data buffers' lengths
        actual = sum(headers[str(f)].data_len for f in files)
    else:
        tensors, actual = _resolve_copies(files, headers, wm, shard_path, issues)
    if isinstance(meta, dict) and "total_size" in meta:
        ts = meta["total_size"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            issues.append(Issue(ErrorCode.INDEX_TOTAL_SIZE,
                                f"expected metadata.total_size to be a number, found {json_type(ts)}",
                                file=ip, severity=Severity.WARNING))
        elif ts != actual:
            issues.append(Issue(ErrorCode.INDEX_TOTAL_SIZE,
                                f"expected metadata.total_size = {actual} (sum of tensor bytes), found {json_repr(ts)}",
                                file=ip, severity=Severity.WARNING))
    # other .safetensors files in the directory the index does not reference
    referenced = {f.name for f in files} | set(shard_names)
    for extra in _glob_shards(directory):
        if extra.name not in referenced:
            issues.append(Issue(ErrorCode.INDEX_UNLISTED_TENSOR,
                                f"expected every .safetensors file in the directory to be referenced by the index, "
                                f"found {extra.name!r} unreferenced (ExLlamaV2 loads every *.safetensors file)",
                                file=str(extra), severity=Severity.WARNING))
    issues.extend(_outside_links(directory, files))
    return ModelFiles(directory, files, headers, tensors, index, issues)


def _single_copies(files: list[Path], headers: dict[str, SafetensorsHeader], wm: dict, shard_path: dict[str, str]
                   ) -> tuple[dict[str, TensorInfo], dict[str, str]] | None:
    """(tensors in file order, tensor -> its shard) when no tensor is in two shards and every indexed tensor is in
    the shard the index names (or that shard is missing); None otherwise, for ``_resolve_copies``."""
    loc: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    total = 0
    for f in files:
        sf = str(f)
        ts = headers[sf].tensors
        total += len(ts)
        loc.update(dict.fromkeys(ts, sf))
        tensors.update(ts)
    if len(loc) != total:
        return None
    indexed = dict(zip(wm, map(shard_path.__getitem__, wm.values())))
    if any(sp in headers for _, sp in indexed.items() - loc.items()):
        return None
    return tensors, loc


def _resolve_copies(files: list[Path], headers: dict[str, SafetensorsHeader], wm: dict, shard_path: dict[str, str],
                    issues: list[Issue]) -> tuple[dict[str, TensorInfo], int]:
    """Tensor by tensor: which copy ``tensors`` exposes (the indexed shard, else the last file), the index's
    unlisted and missing tensors and the duplicates (appended to ``issues``); returns (tensors, their bytes)."""
    where: dict[str, list[str]] = {}
    for f in files:
        for name in headers[str(f)].tensors:
            where.setdefault(name, []).append(str(f))
    chosen: dict[str, str] = {}
    for name, locs in where.items():
        want = wm.get(name)
        want_path = shard_path.get(want) if want is not None else None
        chosen[name] = want_path if want_path in locs else locs[-1]
        if want is None:
            issues.append(Issue(ErrorCode.INDEX_UNLISTED_TENSOR,
                                f"expected every shard tensor in the index, found {name!r} in "
                                f"{os.path.basename(chosen[name])} but not in weight_map (loaders that follow "
                                f"the index never load it)", tensor=name,
                                file=chosen[name], severity=Severity.ERROR))
    for name, shard in wm.items():
        sp = shard_path[shard]
        if sp not in headers:
            continue  # reported as INDEX_MISSING_SHARD
        if name not in headers[sp].tensors:
            elsewhere = [os.path.basename(x) for x in where.get(name, [])]
            also = f" (it is in {', '.join(elsewhere)})" if elsewhere else ""
            issues.append(Issue(ErrorCode.INDEX_MISSING_TENSOR,
                                f"expected the tensor in shard {shard!r} as the index says, found it missing{also}",
                                tensor=name, file=sp, severity=Severity.ERROR))
    # file by file, offset order
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, t in headers[str(f)].tensors.items():
            if chosen[name] == str(f):
                tensors[name] = t
    issues.extend(_duplicate_issues(where, chosen))
    return tensors, sum(t.nbytes for t in tensors.values())



# ------------------------------------------------------------------------------------------------
# whole tensors with pread (no memory map)
# ------------------------------------------------------------------------------------------------

_HAVE_PREADV = hasattr(os, "preadv")


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
        t = self.model.info(name)
        spec = dtypes.SAFETENSORS_DTYPES[t.dtype]
        if spec.numpy is None:
            raise Exl2Error(ErrorCode.DTYPE_UNKNOWN, f"sub-byte dtype {t.dtype} cannot be converted", tensor=name,
                            file=t.file)
        arr = np.empty(t.shape, dtype=spec.numpy)
        self._pread_into(arr, t, t.abs_begin, name)
        return arr

    def read_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0:r1`` (first axis) of a tensor, read like ``read`` (only those bytes)."""
        t = self.model.info(name)
        spec = dtypes.SAFETENSORS_DTYPES[t.dtype]
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

