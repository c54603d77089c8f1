"""Writing safetensors: one header builder, one shard plan and naming, whole files and streamed shards.

``write_safetensors`` writes deterministically (tensors sorted by name by default, or
``order="safetensors"`` for the reference's order - descending dtype alignment, then name - which makes
the output byte-identical to ``safetensors.numpy.save`` when there is at most one metadata key; the
reference writes metadata keys in hash-map order), compact JSON like serde_json, header padded with
spaces to a multiple of 8, little-endian data, streamed tensor by tensor into a temp file in the same
directory, fsync, then ``os.replace`` (the temp file is removed on any failure; the new file's mode follows
the umask, unlike safetensors 0.8's ``save_file``, which leaves 0600 files).  numpy dtypes map to
``BOOL, I8..I64, U8..U64, F16, F32, F64, C64``; anything else (BF16, F8, F4, F6) is given as
``RawTensor(dtype, shape, data)``.  Writer input errors raise ``Exl2Error`` with the code of the matching
reader rule (``DTYPE_UNKNOWN``, ``SHAPE_INVALID``, ``SIZE_MISMATCH``, ``MISALIGNED_SLICE``,
``METADATA_INVALID``, ``TENSOR_ENTRY_INVALID`` for a non-string/``__metadata__``/unencodable name or a
non-array value), so every written file passes ``read_header``.  ``write_sharded`` adds sharding and
the ``{prefix}.safetensors.index.json`` index.

``ShardWriter`` is the streaming form used by the converters and the quantizer: the shard plan and every header
are fixed before any data exists (``plan_shards`` over the planned tensors), then each tensor's bytes are
written as they are produced, so nothing but the tensor in hand is held.  ``BackgroundWriter`` runs it in a
thread.  Both forms share ``plan_shards`` (first fit in write order), ``shard_names`` and the index text, and
build their headers with ``build_header``, so a file streamed by a converter and a file written whole are
laid out by the same code.
"""

from __future__ import annotations

import json
import os
import queue
import re
import struct
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from ..errors import ErrorCode, Exl2Error
from .dtypes import DTYPE_RANK, SAFETENSORS_DTYPES, numpy_to_safetensors_dtype
from .parse import LONE_SURROGATE, MAX_HEADER_BYTES, MAX_NDIM, MAX_TENSORS
from .publish import atomic_write, naming_write_errors, write_text
from .reader import is_plain_file_name

__all__ = [
    "RawTensor", "OutSpec", "TensorPlan", "build_header", "index_text", "plan_shards", "shard_names", "serialize",
    "write_safetensors", "write_sharded", "ShardWriter", "BackgroundWriter",
]

_U64 = 1 << 64


def _err(code: ErrorCode, msg: str, path: str, tensor: str | None = None) -> Exl2Error:
    return Exl2Error(code, msg, file=path, tensor=tensor)


@dataclass(frozen=True)
class RawTensor:
    """A tensor given as raw bytes with a safetensors dtype (for BF16, F8_*, F4, F6_*, ...).

    ``data`` is any contiguous-able array whose bytes are the little-endian element data (multi-byte
    numeric arrays in big-endian order are byte-swapped first); its size must equal shape x dtype bits / 8.
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray = field(repr=False)



class _Prepared(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    array: np.ndarray  # contiguous, little-endian


def _le_contiguous(arr: np.ndarray) -> np.ndarray:
    a = arr if arr.flags.c_contiguous else np.array(arr, order="C")  # (ascontiguousarray makes 0-dim 1-dim)
    if a.dtype.itemsize > 1 and a.dtype.kind in "iufc" and not (
            a.dtype.byteorder == "<" or (a.dtype.byteorder == "=" and sys.byteorder == "little")):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def _prepare_one(name: Any, value: Any, where: str) -> _Prepared:
    if not isinstance(name, str):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected a string tensor name, found {type(name).__name__}", where)
    if name == "__metadata__":
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, "expected a tensor name, found the reserved key __metadata__",
                   where, tensor=name)
    if LONE_SURROGATE.search(name):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, "expected a name encodable as UTF-8, found a lone surrogate",
                   where, tensor=name)
    if isinstance(value, RawTensor):
        spec = SAFETENSORS_DTYPES.get(value.dtype) if isinstance(value.dtype, str) else None
        if spec is None:
            raise _err(ErrorCode.DTYPE_UNKNOWN, f"expected a safetensors dtype, found {value.dtype!r}", where,
                       tensor=name)
        try:
            shape = tuple(value.shape)
        except TypeError:
            raise _err(ErrorCode.SHAPE_INVALID, f"expected a shape tuple, found {value.shape!r}", where,
                       tensor=name) from None
        if len(shape) > MAX_NDIM or not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
                                            and 0 <= int(d) < _U64 for d in shape):
            raise _err(ErrorCode.SHAPE_INVALID,
                       f"expected at most {MAX_NDIM} non-negative integer dims, found {value.shape!r}", where,
                       tensor=name)
        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        nbits = numel * spec.bits
        if nbits >= _U64:
            raise _err(ErrorCode.SIZE_OVERFLOW, "expected numel x bits below 2**64", where, tensor=name)
        if nbits % 8:
            raise _err(ErrorCode.MISALIGNED_SLICE,
                       f"expected {value.dtype} data to end on a byte boundary, found {nbits} bits", where, tensor=name)
        if not isinstance(value.data, np.ndarray):
            raise _err(ErrorCode.TENSOR_ENTRY_INVALID,
                       f"expected RawTensor.data to be a numpy array, found {type(value.data).__name__}", where,
                       tensor=name)
        arr = _le_contiguous(value.data)
        if arr.dtype.hasobject:
            raise _err(ErrorCode.DTYPE_UNKNOWN, "expected raw numeric data, found an object array", where, tensor=name)
        if arr.nbytes != nbits // 8:
            raise _err(ErrorCode.SIZE_MISMATCH,
                       f"expected {nbits // 8} bytes of data for {value.dtype} x {shape}, found {arr.nbytes}",
                       where, tensor=name)
        return _Prepared(name, value.dtype, shape, arr.nbytes, arr)
    if not isinstance(value, np.ndarray):
        if isinstance(value, np.generic):
            value = np.asarray(value)
        else:
            raise _err(ErrorCode.TENSOR_ENTRY_INVALID,
                       f"expected a numpy array or RawTensor, found {type(value).__name__}", where, tensor=name)
    st = numpy_to_safetensors_dtype(value.dtype)
    if st is None:
        raise _err(ErrorCode.DTYPE_UNKNOWN,
                   f"expected a numpy dtype safetensors supports (bool, int/uint 8-64, float16/32/64, complex64), "
                   f"found {value.dtype}", where, tensor=name)
    if value.ndim > MAX_NDIM:
        raise _err(ErrorCode.SHAPE_INVALID, f"expected at most {MAX_NDIM} dims, found {value.ndim}", where,
                   tensor=name)
    arr = _le_contiguous(value)
    return _Prepared(name, st, tuple(int(d) for d in arr.shape), arr.nbytes, arr)


def _check_metadata(metadata: Any, where: str) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise _err(ErrorCode.METADATA_INVALID, f"expected a dict of str -> str, found {type(metadata).__name__}", where)
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise _err(ErrorCode.METADATA_INVALID,
                       f"expected str -> str metadata, found {type(k).__name__} -> {type(v).__name__} for {k!r}", where)
        if LONE_SURROGATE.search(k) or LONE_SURROGATE.search(v):
            raise _err(ErrorCode.METADATA_INVALID, f"expected UTF-8 encodable metadata, found a lone surrogate in {k!r}",
                       where)
    return {k: metadata[k] for k in sorted(metadata)}


def _order(prepared: list[_Prepared], order: str, where: str) -> list[_Prepared]:
    if order == "name":
        return sorted(prepared, key=lambda p: p.name)
    if order == "safetensors":
        return sorted(prepared, key=lambda p: (-DTYPE_RANK[p.dtype], p.name))
    raise _err(ErrorCode.USAGE, f"expected order 'name' or 'safetensors', found {order!r}", where)


@dataclass(frozen=True)
class OutSpec:
    """One planned output tensor: name, safetensors dtype, shape (C order).  The unit of ``plan_shards``,
    ``build_header`` and ``ShardWriter`` (a converter's or the quantizer's plan lists them in write order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = SAFETENSORS_DTYPES[self.dtype].bits
        for d in self.shape:
            n *= d
        return n // 8


class TensorPlan(Protocol):
    """What the header builder and the shard plan read of a tensor (``OutSpec`` and the writer's own prepared
    tensors have these): its name, safetensors dtype, shape and bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def build_header(items: Sequence[TensorPlan], metadata: dict[str, str] | None, where: str) -> bytes:
    """The JSON header of a file holding ``items`` back to back in the given order: compact JSON like serde_json,
    ``__metadata__`` first when ``metadata`` is not None (the caller passes it with sorted keys), padded with
    spaces to a multiple of 8.  HEADER_TOO_LARGE if it would exceed ``MAX_HEADER_BYTES`` (no reader opens that)."""
    hdr: dict[str, Any] = {}
    if metadata is not None:
        hdr["__metadata__"] = metadata
    off = 0
    for p in items:
        hdr[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [off, off + p.nbytes]}
        off += p.nbytes
    hb = json.dumps(hdr, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    if len(hb) > MAX_HEADER_BYTES:
        raise _err(ErrorCode.HEADER_TOO_LARGE,
                   f"expected a header of at most {MAX_HEADER_BYTES} bytes, found {len(hb)}", where)
    return hb


def plan_shards(specs: Sequence[TensorPlan], max_bytes: int) -> list[list]:
    """First fit in write order: a new shard when the next tensor would overflow ``max_bytes`` of tensor data
    (a larger tensor gets a shard of its own).  Always at least one (possibly empty) shard."""
    shards: list[list] = [[]]
    cur = 0
    for s in specs:
        if shards[-1] and cur + s.nbytes > max_bytes:
            shards.append([])
            cur = 0
        shards[-1].append(s)
        cur += s.nbytes
    return shards


def shard_names(n: int, prefix: str = "model") -> list[str]:
    """The file names of ``n`` shards: ``{prefix}.safetensors`` alone, else ``{prefix}-00001-of-0000N.safetensors``."""
    if n == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


_SHARD_RE_CACHE: dict[str, re.Pattern] = {}


def shard_name_pattern(prefix: str) -> re.Pattern:
    """Matches (``fullmatch``) the multi-shard names ``shard_names`` makes for ``prefix``, of any shard count."""
    r = _SHARD_RE_CACHE.get(prefix)
    if r is None:
        r = re.compile(re.escape(prefix) + r"-\d{5,}-of-\d{5,}\.safetensors")
        _SHARD_RE_CACHE[prefix] = r
    return r


def index_text(shards: Sequence[Sequence[TensorPlan]], names: Sequence[str]) -> str:
    """The ``*.safetensors.index.json`` of these shards (``names[i]`` holds ``shards[i]``): total_size and the
    weight_map, sorted keys, two-space indent, final newline."""
    index = {"metadata": {"total_size": sum(s.nbytes for sh in shards for s in sh)},
             "weight_map": {s.name: names[i] for i, sh in enumerate(shards) for s in sh}}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def _prepare_all(tensors: Mapping[str, Any], where: str) -> list[_Prepared]:
    if not isinstance(tensors, Mapping):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected a mapping of name -> array, found {type(tensors).__name__}",
                   where)
    if len(tensors) > MAX_TENSORS:
        raise _err(ErrorCode.TOO_MANY_TENSORS, f"expected at most {MAX_TENSORS} tensors, found {len(tensors)}", where)
    return [_prepare_one(k, v, where) for k, v in tensors.items()]


_CHUNK = 64 << 20


def _write_array(f: BinaryIO, arr: np.ndarray) -> None:
    """Write the bytes of a contiguous array (no full copy; chunks of at most 64 MiB)."""
    if arr.nbytes == 0:
        return
    mv = memoryview(arr.reshape(-1).view(np.uint8))
    for i in range(0, len(mv), _CHUNK):
        f.write(mv[i:i + _CHUNK])


def _write_stream(f: BinaryIO, header: bytes, items: Sequence[_Prepared]) -> None:
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    for p in items:
        _write_array(f, p.array)



def serialize(tensors: Mapping[str, np.ndarray | RawTensor], metadata: dict[str, str] | None = None, *,
              order: str = "name") -> bytes:
    """The bytes ``write_safetensors`` would write (for small in-memory files, tests and fuzz corpora)."""
    items = _order(_prepare_all(tensors, "<memory>"), order, "<memory>")
    hb = build_header(items, _check_metadata(metadata, "<memory>"), "<memory>")
    parts = [struct.pack("<Q", len(hb)), hb]
    parts += [p.array.reshape(-1).view(np.uint8).tobytes() for p in items if p.nbytes]
    return b"".join(parts)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray | RawTensor],
                      metadata: dict[str, str] | None = None, *, order: str = "name", durable: bool = True) -> Path:
    """Write one safetensors file atomically (replacing an existing one).  Returns the path.
    ``durable=False``: no fsync (``publish.atomic_write``), for scratch files.

    ``order="name"`` (default) stores tensors sorted by name; ``order="safetensors"`` uses the reference's
    order (descending dtype alignment, then name).  Metadata keys are sorted.
    """
    p = Path(os.fspath(path))
    items = _order(_prepare_all(tensors, str(p)), order, str(p))
    hb = build_header(items, _check_metadata(metadata, str(p)), str(p))
    atomic_write(p, lambda f: _write_stream(f, hb, items), durable=durable)
    return p


def write_sharded(out_dir: str | os.PathLike, tensors: Mapping[str, np.ndarray | RawTensor], max_shard_bytes: int,
                  metadata: dict[str, str] | None = None, prefix: str = "model", *, overwrite: bool = False,
                  order: str = "name") -> list[Path]:
    """Write tensors into shards of at most ``max_shard_bytes`` of tensor data each (a larger tensor gets
    its own shard), filled in sorted-name order.

    One shard: ``{prefix}.safetensors`` and no index.  Several: ``{prefix}-00001-of-0000N.safetensors``
    plus ``{prefix}.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {...}}``).
    Every file is written atomically.  Existing outputs of this prefix (``{prefix}.safetensors``, its
    index, ``{prefix}-NNNNN-of-NNNNN.safetensors``) raise ``OUTPUT_EXISTS`` unless ``overwrite=True``,
    in which case the stale ones not rewritten are removed after the new files are in place.
    Returns the shard paths.
    """
    d = Path(os.fspath(out_dir))
    where = str(d)
    if not isinstance(prefix, str) or not is_plain_file_name(prefix):
        raise _err(ErrorCode.USAGE, f"expected a plain file-name prefix, found {prefix!r}", where)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise _err(ErrorCode.USAGE, f"expected a positive max_shard_bytes, found {max_shard_bytes!r}", where)
    meta = _check_metadata(metadata, where)
    items = sorted(_prepare_all(tensors, where), key=lambda p: p.name)
    shards = plan_shards(items, max_shard_bytes)
    n = len(shards)
    names = shard_names(n, prefix)
    index_name = f"{prefix}.safetensors.index.json"
    headers = [build_header(_order(s, order, where), meta, where) for s in shards]

    try:
        d.mkdir(parents=True, exist_ok=True)
        existing = []
        pat = shard_name_pattern(prefix)
        for q in d.iterdir():
            if q.name in (f"{prefix}.safetensors", index_name) or pat.fullmatch(q.name):
                existing.append(q)
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot prepare the output directory: {e.strerror or e}", where) from None
    if existing and not overwrite:
        shown = ", ".join(sorted(q.name for q in existing)[:5])
        raise _err(ErrorCode.OUTPUT_EXISTS,
                   f"expected no existing outputs of prefix {prefix!r}, found {len(existing)}: {shown}", where)

    paths = []
    for name, shard, hb in zip(names, shards, headers):
        items_o = _order(shard, order, where)
        out = d / name
        atomic_write(out, lambda f, hb=hb, items_o=items_o: _write_stream(f, hb, items_o))
        paths.append(out)
    written = set(names)
    if n > 1:
        text = index_text(shards, names)
        atomic_write(d / index_name, lambda f: f.write(text.encode("utf-8")))
        written.add(index_name)
    for q in existing:
        if q.name not in written:
            try:
                q.unlink()
            except OSError as e:
                raise _err(ErrorCode.IO_ERROR, f"cannot remove stale output: {e.strerror or e}", str(q)) from None
    return paths


# ------------------------------------------------------------------------------------------------
# streaming: planned shards written tensor by tensor
# ------------------------------------------------------------------------------------------------

class ShardWriter:
    """Writes planned shards tensor by tensor: each file's header is written first (every shape is known),
    then each tensor's bytes as they are fed, in the planned order.  Holds no tensor data itself.

    ``checksums`` records the checksum of every tensor's bytes as written (the verify pass compares it with the file).
    Every ``sync_every`` bytes the shard is ``fdatasync``-ed, so writeback proceeds while later layers are being
    produced and the final fsync has little left to do.
    """

    def __init__(self, directory: Path, shards: list[list[OutSpec]], metadata: dict[str, str], prefix="model",
                 sync_every: int = 256 << 20, index_name: str = "model.safetensors.index.json"):
        from . import checksums  # Numba: imported by a streaming writer only, not by every user of the container

        self._checksums = checksums
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
        hb = build_header(self.shards[i], _check_metadata(self.metadata, str(path)), str(path))
        with naming_write_errors(path):
            self._file = open(path, "xb", buffering=0)
            self._file.write(struct.pack("<Q", len(hb)))
            self._file.write(hb)
        self._shard = i
        self._unsynced = 0

    def _close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            with naming_write_errors(getattr(self, "_path", self.dir)):
                try:
                    os.fsync(f.fileno())
                finally:
                    f.close()

    def check(self, name: str, arr: np.ndarray) -> np.ndarray:
        """Check ``arr`` against the next planned tensor (name, dtype, shape); returns it C-contiguous LE."""
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
        with naming_write_errors(self._path):
            while done < len(mv):
                done += self._file.write(mv[done:])
        self.checksums[name] = self._checksums.checksum(mv)
        self.bytes_written += a.nbytes
        self._unsynced += a.nbytes
        if self._unsynced >= self.sync_every:
            with naming_write_errors(self._path):
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
            write_text(self.dir / self.index_name, index_text(self.shards, self.names))
            written.append(self.index_name)
        return written

    def abort(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass



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
