"""A bounded, lazy GGUF reader: walk the header with bounds checks before anything is allocated, keep arrays
as (type, count, offset) and decode them only when asked.

Why not ``gguf.GGUFReader`` directly: it builds NumPy views and Python objects for every element of every
metadata array (about 0.2 ms per element on a loaded machine: a 10**6-element array takes minutes and
gigabytes), and it trusts every count in the file.  This module checks what llama.cpp's loader checks, in
the same order (bound, check, then allocate):

* magic, version 2 or 3 (either byte order);
* key/value and tensor counts against caps and against the bytes the file has left;
* every string and array length against the bytes left and a cap; the strings inside arrays counted in
  total (each one is walked, so their number is capped); arrays nested at most ``GGUF_MAX_ARRAY_DEPTH``;
* ``general.alignment`` a UINT32 power of two; keys unique and UTF-8; tensor names unique;
* tensor dims (<= 4, product < 2**63), type known, rows a whole number of blocks, offset aligned, data
  inside the file and no two tensors overlapping (the per-type checks need the ``gguf`` package's type
  table; without it they are skipped).

Everything is ``Exl2Error(GGUF_INVALID)`` naming the file (and key or tensor).  The work is linear in the
number of keys, tensors and strings inside arrays; numeric arrays cost O(1) however long they are.

``GgufFile`` offers the small part of ``GGUFReader``'s interface the converters use: ``fields`` /
``get_field(key)`` (``.types``, ``.count``, ``.contents()``), ``tensors`` (``name``, ``tensor_type``,
``shape`` in GGUF order, ``n_elements``, ``n_bytes``, ``data_offset``, ``data`` as a read-only memory map
view typed and shaped like ``GGUFReader``'s), ``alignment``, ``close()``.

``gguf_hparam_issues(f)`` checks the hyper-parameters that drive loops and allocations (block count,
widths, heads, experts, vocabulary) against sane limits and against the tensors present
(``GGUF_METADATA_INVALID`` naming the key).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ErrorCode, Exl2Error

__all__ = ["GgufFile", "GgufField", "GgufTensor", "open_gguf_file", "gguf_hparam_issues",
           "GGUF_MAX_KV", "GGUF_MAX_TENSORS", "GGUF_MAX_STRING", "GGUF_MAX_ARRAY_STRINGS", "GGUF_MAX_BLOCKS"]

_SCALAR = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_SIZE = {k: np.dtype(v).itemsize for k, v in _SCALAR.items()}
STRING, ARRAY = 8, 9
#: caps (llama.cpp has no smaller ones for real files; real models have < 100 keys and < 10**5 tensors)
GGUF_MAX_KV = 1 << 16
GGUF_MAX_TENSORS = 1 << 18
GGUF_MAX_STRING = 64 << 20
GGUF_MAX_KEY = 1 << 16
GGUF_MAX_NAME = 1024
GGUF_MAX_DIMS = 4
GGUF_MAX_ARRAY_DEPTH = 2
#: strings (and sub-arrays) inside arrays, all keys together; a large vocabulary has ~256k tokens and as many
#: merges.  Each is walked once at open (its length is in front of it), so their number is capped.
GGUF_MAX_ARRAY_STRINGS = 1 << 22
GGUF_MAX_ALIGNMENT = 1 << 16
#: hyper-parameter limits (llama.cpp: LLAMA_MAX_LAYERS 512, LLAMA_MAX_EXPERTS 512; a little headroom)
GGUF_MAX_BLOCKS = 4096
GGUF_MAX_WIDTH = 1 << 20
GGUF_MAX_HEADS = 1 << 14
GGUF_MAX_EXPERTS = 1 << 12
GGUF_MAX_VOCAB = 1 << 24
GGUF_MAX_CONTEXT = (1 << 31) - 1


@dataclass
class GgufField:
    """One key/value.  ``types``: [value type] or [ARRAY, element type]; ``count``: array length (1 for a
    scalar); ``contents()`` decodes the value (arrays: a list) from the file only when called."""

    name: str
    types: list[int]
    count: int
    _file: "GgufFile"
    _offset: int  # scalar / string: where the value starts; array: where the first element starts
    _value: Any = None

    def contents(self) -> Any:
        return self._file._decode(self)


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: Any      # gguf.GGMLQuantizationType when the gguf package is present, else the int
    shape: np.ndarray     # uint64 dims, GGUF order (fastest-varying first), like GGUFReader
    n_elements: int
    n_bytes: int
    data_offset: int      # absolute byte offset in the file
    _file: "GgufFile"

    @property
    def data(self) -> np.ndarray:
        """Read-only memory-map view: F32/F16/F64/I8..I64 typed [reversed dims]; block types uint8
        [reversed dims, last = bytes per row] (GGUFReader's convention)."""
        return self._file._tensor_data(self)


class GgufFile:
    """See the module docstring.  Use ``open_gguf_file(path)``; ``close()`` releases the memory map."""

    def __init__(self, path: str):
        self.path = path
        self.fields: dict[str, GgufField] = {}
        self.tensors: list[GgufTensor] = []
        self.alignment = 32
        self._mm: mmap.mmap | None = None
        self._np: np.ndarray | None = None
        self._fd: int | None = None  # for ``read_bytes``: private copies that never pile up as mapped pages

    # --- reading --------------------------------------------------------------------------------------
    def get_field(self, key: str) -> GgufField | None:
        return self.fields.get(key)

    def close(self) -> None:
        self._np = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a tensor view is still alive; the map goes with it
                pass
            self._mm = None

    def __enter__(self) -> "GgufFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_bytes(self, t: "GgufTensor", start: int, n: int) -> np.ndarray:
        """``n`` bytes of ``t``'s data from byte ``start`` of it, read with ``pread`` into a private buffer (not
        the memory map: a converter streaming a whole file then holds one chunk, not every page it touched).
        Bounds were checked at open; a short read (the file shrank) is ``GGUF_INVALID``."""
        if self._fd is None:
            self._bad("the file is closed")
        if start < 0 or n < 0 or start + n > t.n_bytes:
            self._bad(f"bytes {start}..{start + n} lie outside the tensor's {t.n_bytes}", tensor=t.name)
        if not hasattr(os, "preadv"):  # pragma: no cover - platforms without preadv: a copy from the map
            return np.array(self._tensor_data(t).reshape(-1).view(np.uint8)[start:start + n])
        buf = np.empty(n, dtype=np.uint8)
        view, done = memoryview(buf), 0
        while done < n:
            try:
                got = os.preadv(self._fd, [view[done:]], t.data_offset + start + done)
            except OSError as e:
                raise Exl2Error(ErrorCode.IO_ERROR, f"cannot read: {e.strerror or e}", file=self.path,
                                tensor=t.name) from None
            if got <= 0:
                self._bad("the file ended inside the tensor's data (it changed after it was opened)", tensor=t.name)
            done += got
        return buf

    def _bad(self, msg: str, tensor: str | None = None):
        raise Exl2Error(ErrorCode.GGUF_INVALID, msg, file=self.path, tensor=tensor)

    def _decode(self, f: GgufField) -> Any:
        if f._value is not None or f.types[0] not in (STRING, ARRAY):
            return f._value
        mm = self._mm
        if mm is None:
            self._bad("the file is closed")
        bo = self.byte_order_char
        if f.types[0] == STRING:
            n = struct.unpack_from(bo + "Q", mm, f._offset)[0]
            return bytes(mm[f._offset + 8:f._offset + 8 + n]).decode("utf-8")
        return self._read_array(f.types[-1], f.count, f._offset)[0]

    def _read_array(self, et: int, count: int, pos: int) -> tuple[list, int]:
        """(values, end) of ``count`` elements of type ``et`` at ``pos``; sizes were checked at open.
        Nested arrays are flattened, as GGUFReader does."""
        mm, bo = self._mm, self.byte_order_char
        if et in _SCALAR:
            a = np.frombuffer(mm, dtype=np.dtype(_SCALAR[et]).newbyteorder(bo), count=count, offset=pos)
            return a.tolist(), pos + count * _SIZE[et]
        out: list = []
        for _ in range(count):
            if et == STRING:
                n = struct.unpack_from(bo + "Q", mm, pos)[0]
                out.append(bytes(mm[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
                pos += 8 + n
            else:
                sub_t, sub_n = struct.unpack_from(bo + "IQ", mm, pos)
                vals, pos = self._read_array(sub_t, sub_n, pos + 12)
                out.extend(vals)
        return out, pos

    def _tensor_data(self, t: GgufTensor) -> np.ndarray:
        if self._np is None:
            if self._mm is None:
                self._bad("the file is closed")
            self._np = np.frombuffer(self._mm, dtype=np.uint8)
        raw = self._np[t.data_offset:t.data_offset + t.n_bytes]
        dims = tuple(int(d) for d in reversed(t.shape.tolist()))
        typed = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}.get(int(t.tensor_type))
        if typed is not None:
            return raw.view(np.dtype(typed).newbyteorder(self.byte_order_char)).reshape(dims)
        bs, ts = _quant_sizes()[int(t.tensor_type)]
        if not dims:
            return raw
        return raw.reshape(dims[:-1] + (dims[-1] // bs * ts,))

    byte_order_char = "<"

    @property
    def byte_order(self) -> str:
        return "big" if self.byte_order_char == ">" else "little"


def _quant_sizes() -> dict[int, tuple[int, int]] | None:
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:  # pragma: no cover - exercised only without the gguf package
        return None
    return {int(k): v for k, v in GGML_QUANT_SIZES.items()}


def _tensor_type(t: int):
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(t)
    except (ImportError, ValueError):
        return t


def open_gguf_file(path: str | os.PathLike) -> GgufFile:
    """Walk and check a GGUF file (see the module docstring); ``GgufFile`` with lazy fields and tensors."""
    p = str(path)
    g = GgufFile(p)
    bad = g._bad
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                bad(f"expected at least 24 header bytes, found a {size}-byte file")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            g._fd = os.dup(fh.fileno())
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot read: {e.strerror or e}", file=p) from None
    g._mm = mm
    try:
        _walk(g, mm, size)
    except BaseException:
        g.close()
        raise
    return g


def _walk(g: GgufFile, mm, size: int) -> None:
    """The bounded walk of ``open_gguf_file``, in the file's order: preamble, key/values, tensor infos, then the
    tensor data ranges (each check before what it guards is read or allocated)."""
    w = _HeaderWalk(g, mm, size)
    pos = w.preamble()
    pos = w.key_values(pos)
    infos, pos = w.tensor_infos(pos)
    w.tensor_data(infos, pos)


class _HeaderWalk:
    """Bounds-checked reads over the memory map ``mm`` of a ``size``-byte GGUF file, filling ``g`` as it goes."""

    def __init__(self, g: GgufFile, mm, size: int):
        self.g, self.mm, self.size = g, mm, size
        self.bad = g._bad
        self.bo = "<"
        self.q = self.i4 = ""
        self.n_strings = 0  # strings and sub-arrays inside arrays, all keys together (GGUF_MAX_ARRAY_STRINGS)

    def need(self, at, n, what):
        if n < 0 or at + n > self.size:
            self.bad(f"{what} at byte {at} needs {n} bytes; only {max(self.size - at, 0)} left")

    def string_len(self, at, cap, what):
        self.need(at, 8, what + " length")
        n = struct.unpack_from(self.q, self.mm, at)[0]
        if n > cap:
            self.bad(f"{what} of {n} bytes exceeds the cap of {cap}")
        self.need(at + 8, n, what)
        return n

    def skip_value(self, at, vtype, depth, what):
        """Position after a value of ``vtype`` at ``at`` (bounds-checked)."""
        bad, size = self.bad, self.size
        if vtype in _SIZE:
            self.need(at, _SIZE[vtype], what)
            return at + _SIZE[vtype]
        if vtype == STRING:
            return at + 8 + self.string_len(at, GGUF_MAX_STRING, what + " string")
        if vtype == ARRAY:
            if depth >= GGUF_MAX_ARRAY_DEPTH:
                bad(f"{what}: arrays nested deeper than {GGUF_MAX_ARRAY_DEPTH}")
            self.need(at, 12, what + " array header")
            et, count = struct.unpack_from(self.bo + "IQ", self.mm, at)
            at += 12
            if et in _SIZE:
                if count > (size - at) // _SIZE[et]:
                    bad(f"{what}: array of {count} elements cannot fit in the file")
                return at + count * _SIZE[et]
            if et not in (STRING, ARRAY):
                bad(f"{what}: unknown array element type {et}")
            if count > (size - at) // (8 if et == STRING else 12):
                bad(f"{what}: array of {count} elements cannot fit in the file")
            self.n_strings += count
            if self.n_strings > GGUF_MAX_ARRAY_STRINGS:
                bad(f"{what}: more than {GGUF_MAX_ARRAY_STRINGS} strings/arrays inside arrays in the file (cap)")
            if et == STRING:  # the hot loop of a vocabulary: kept tight
                unpack, q, mm = struct.unpack_from, self.q, self.mm
                for _ in range(count):
                    if at + 8 > size:
                        self.need(at, 8, what + " string length")
                    n = unpack(q, mm, at)[0]
                    if n > GGUF_MAX_STRING or at + 8 + n > size:
                        self.string_len(at, GGUF_MAX_STRING, what + " string")
                    at += 8 + n
                return at
            for _ in range(count):
                at = self.skip_value(at, ARRAY, depth + 1, what)
            return at
        bad(f"{what}: unknown value type {vtype}")

    def preamble(self) -> int:
        """Magic, version (and so the byte order), the two counts against the caps and the file; the position
        after the 24-byte preamble."""
        g, mm, size, bad = self.g, self.mm, self.size, self.bad
        if mm[:4] != b"GGUF":
            bad(f"expected the magic b'GGUF', found {bytes(mm[:4])!r}")
        bo = "<"
        version = struct.unpack_from("<I", mm, 4)[0]
        if version not in (2, 3):
            v_be = struct.unpack_from(">I", mm, 4)[0]
            if v_be in (2, 3):
                bo, version = ">", v_be
            else:
                bad(f"expected GGUF version 2 or 3, found {version}")
        g.byte_order_char = bo
        g.version = version
        n_tensors, n_kv = struct.unpack_from(bo + "QQ", mm, 8)
        pos = 24
        # a key/value needs >= 12 bytes (key length + type), a tensor info >= 24 (name length, dims, type, offset)
        if n_kv > GGUF_MAX_KV or n_kv * 12 > size - pos:
            bad(f"{n_kv} key/value pairs cannot fit in the file (cap {GGUF_MAX_KV})")
        if n_tensors > GGUF_MAX_TENSORS or n_tensors * 24 > size - pos:
            bad(f"{n_tensors} tensors cannot fit in the file (cap {GGUF_MAX_TENSORS})")
        g.n_kv, g.n_tensors = n_kv, n_tensors
        self.bo, self.q, self.i4 = bo, bo + "Q", bo + "I"
        return pos

    def key_values(self, pos: int) -> int:
        """Every key (unique, UTF-8) and its value (scalars read, arrays kept lazy); ``general.alignment``
        checked.  The position after the last value."""
        g, mm, bad, bo = self.g, self.mm, self.bad, self.bo
        for i in range(g.n_kv):
            n = self.string_len(pos, GGUF_MAX_KEY, f"key {i}")
            try:
                key = bytes(mm[pos + 8:pos + 8 + n]).decode("utf-8")
            except UnicodeDecodeError:
                bad(f"key {i} is not UTF-8")
            pos += 8 + n
            if key in g.fields:
                bad(f"key {key!r} appears twice")
            self.need(pos, 4, f"the type of {key!r}")
            vtype = struct.unpack_from(self.i4, mm, pos)[0]
            pos += 4
            what = f"value of {key!r}"
            if vtype in _SCALAR:
                self.need(pos, _SIZE[vtype], what)
                v = np.frombuffer(mm, dtype=np.dtype(_SCALAR[vtype]).newbyteorder(bo), count=1, offset=pos)[0].item()
                f = GgufField(key, [vtype], 1, g, pos, v)
            elif vtype == ARRAY:
                self.need(pos, 12, what + " array header")
                et, count = struct.unpack_from(bo + "IQ", mm, pos)
                f = GgufField(key, [ARRAY, et], count, g, pos + 12)
            else:
                f = GgufField(key, [vtype], 1, g, pos)
            end = self.skip_value(pos, vtype, 0, what)
            pos = end
            g.fields[key] = f
            if key == "general.alignment":
                if vtype != 4:
                    bad(f"general.alignment has value type {vtype}; expected UINT32 (4)")
                al = f._value
                if al == 0 or al & (al - 1) or al > GGUF_MAX_ALIGNMENT:
                    bad(f"general.alignment = {al}; expected a power of two <= {GGUF_MAX_ALIGNMENT}")
                g.alignment = al
        return pos

    def tensor_infos(self, pos: int) -> tuple[list, int]:
        """(name, dims, ggml type, offset, element count) of every tensor (names unique, at most
        ``GGUF_MAX_DIMS`` dims, no overflowing count); and the position where the header ends."""
        mm, bad, bo = self.mm, self.bad, self.bo
        infos = []
        names = set()
        for i in range(self.g.n_tensors):
            n = self.string_len(pos, GGUF_MAX_NAME, f"tensor {i} name")
            name = bytes(mm[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace")
            pos += 8 + n
            if name in names:
                bad(f"tensor name {name!r} appears twice")
            names.add(name)
            self.need(pos, 4, f"tensor {name!r} dims")
            nd = struct.unpack_from(self.i4, mm, pos)[0]
            pos += 4
            if nd > GGUF_MAX_DIMS:
                bad(f"tensor {name!r} has {nd} dims; at most {GGUF_MAX_DIMS}")
            self.need(pos, 8 * nd + 12, f"tensor {name!r} info")
            dims = list(struct.unpack_from(bo + "Q" * nd, mm, pos))
            pos += 8 * nd
            numel = math.prod(dims)
            if numel >= 1 << 63:
                bad(f"tensor {name!r}: element count {numel} overflows")
            ttype, off = struct.unpack_from(bo + "IQ", mm, pos)
            pos += 12
            infos.append((name, dims, ttype, off, numel))
        return infos, pos

    def tensor_data(self, infos: list, pos: int) -> None:
        """The data section after the header (aligned): every tensor's type known, rows whole blocks, offset
        aligned, data inside the file, no two tensors overlapping (with the ``gguf`` type table only)."""
        g, size, bad = self.g, self.size, self.bad
        g.header_end = pos
        data_start = pos + (-pos % g.alignment)
        g.data_start = data_start
        g.size = size
        sizes = _quant_sizes()
        spans = []
        for name, dims, ttype, off, numel in infos:
            nbytes = None
            if sizes is not None:
                if ttype not in sizes:
                    bad(f"tensor {name!r} has unknown ggml type {ttype}", tensor=name)
                bs, ts = sizes[ttype]
                if dims and dims[0] % bs:
                    bad(f"tensor {name!r}: row length {dims[0]} is not a multiple of the {bs}-element block of "
                        f"type {ttype}", tensor=name)
                nbytes = numel // bs * ts
                if off % g.alignment:
                    bad(f"tensor {name!r}: data offset {off} is not a multiple of the alignment {g.alignment}",
                        tensor=name)
                if data_start + off + nbytes > size:
                    bad(f"tensor {name!r}: data ends at byte {data_start + off + nbytes}, past the end of the "
                        f"{size}-byte file (truncated?)", tensor=name)
                if nbytes:
                    spans.append((off, off + nbytes, name))
            g.tensors.append(GgufTensor(name, _tensor_type(ttype), np.array(dims, dtype=np.uint64), numel,
                                        nbytes if nbytes is not None else 0, data_start + off, g))
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                bad(f"the data of tensors {an!r} and {bn!r} overlap")


# ------------------------------------------------------------------------------------------------ hparams

def _plain_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def gguf_hparam_issues(g: GgufFile, arch: str | None) -> list[tuple[str, str]]:
    """``[(key, problem)]`` for the hyper-parameters of ``arch`` that drive loops and allocations.  Checked
    against sane limits (``GGUF_MAX_*``) and against the tensors present: ``block_count`` may not exceed the
    number of distinct ``blk.N`` blocks (nor any block index reach it), ``embedding_length`` must be
    ``token_embd``'s row width, heads must divide it sensibly.  Linear in the number of tensors."""
    out: list[tuple[str, str]] = []
    if not isinstance(arch, str):
        return out
    limits = {
        "block_count": (1, GGUF_MAX_BLOCKS), "embedding_length": (1, GGUF_MAX_WIDTH),
        "feed_forward_length": (1, GGUF_MAX_WIDTH * 4), "attention.head_count": (1, GGUF_MAX_HEADS),
        "attention.head_count_kv": (1, GGUF_MAX_HEADS), "attention.key_length": (1, 1 << 16),
        "attention.value_length": (1, 1 << 16), "rope.dimension_count": (1, 1 << 16),
        "context_length": (1, GGUF_MAX_CONTEXT), "expert_count": (0, GGUF_MAX_EXPERTS),
        "expert_used_count": (0, GGUF_MAX_EXPERTS), "vocab_size": (1, GGUF_MAX_VOCAB),
    }
    vals: dict[str, int] = {}
    for k, (lo, hi) in limits.items():
        f = g.fields.get(f"{arch}.{k}")
        if f is None:
            continue
        v = f.contents() if f.types[0] != ARRAY else None
        if not _plain_int(v) or not lo <= v <= hi:
            shown = f"an array of {f.count}" if f.types[0] == ARRAY else repr(v)[:40]
            out.append((f"{arch}.{k}", f"expected an integer in {lo}..{hi}, found {shown}"))
        else:
            vals[k] = v
    for k in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
              "rope.scaling.factor"):
        f = g.fields.get(f"{arch}.{k}")
        if f is None:
            continue
        v = f.contents() if f.types[0] != ARRAY else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            out.append((f"{arch}.{k}", f"expected a finite number > 0, found {repr(v)[:40]}"))
    blocks = set()
    emb = None
    for t in g.tensors:
        if t.name.startswith("blk."):
            head = t.name[4:].split(".", 1)[0]
            if head.isdigit():
                blocks.add(int(head))
        elif t.name == "token_embd.weight":
            emb = [int(x) for x in t.shape.tolist()]
    bc = vals.get("block_count")
    if bc is not None:
        if len(blocks) < bc:
            out.append((f"{arch}.block_count", f"{bc} blocks declared but the tensors hold {len(blocks)} (blk.N)"))
        elif blocks and max(blocks) >= bc:
            out.append((f"{arch}.block_count", f"{bc} blocks declared but a tensor names block {max(blocks)}"))
    hid, heads, kv = vals.get("embedding_length"), vals.get("attention.head_count"), vals.get(
        "attention.head_count_kv")
    if hid is not None and emb is not None and len(emb) == 2 and emb[0] != hid:
        out.append((f"{arch}.embedding_length", f"{hid} but token_embd.weight rows are {emb[0]} wide"))
    if hid is not None and heads is not None and heads > hid:
        out.append((f"{arch}.attention.head_count", f"{heads} heads for a width of {hid}"))
    if heads is not None and kv is not None and (kv > heads or heads % kv):
        out.append((f"{arch}.attention.head_count_kv", f"{kv} KV heads must divide {heads} query heads"))
    return out
