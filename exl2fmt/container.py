"""The safetensors container: a hardened header parser, zero-copy reader, model directories, writer.

Only numpy and the standard library are used here (no torch, numba, rich or typer).

File layout (safetensors)
-------------------------
``u64 LE header length n`` | ``n bytes of UTF-8 JSON`` | ``data buffer``.  The JSON object maps tensor
names to ``{"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}`` (offsets relative to the
start of the data buffer, ``data_start = 8 + n``) plus an optional ``"__metadata__": {str: str}``.

Dtypes
------
``SAFETENSORS_DTYPES`` lists every dtype safetensors 0.8 accepts (taken from the ``Dtype`` enum of the
Rust crate and confirmed against the installed library), as ``DtypeSpec(bits, numpy)``.  ``numpy`` is the
little-endian numpy dtype ``SafetensorsFile.get`` returns, or ``None`` for the sub-byte dtypes.  Dtypes
that numpy cannot represent are exposed *as raw unsigned integers of the same width* (listed in
``RAW_DTYPES``): ``BF16 -> uint16`` and every ``F8_*`` -> ``uint8``; the caller reinterprets the bits.
The sub-byte dtypes ``F4`` (4 bits) and ``F6_E2M3``/``F6_E3M2`` (6 bits) have ``numpy=None``:
``get`` returns their packed bytes as a 1-D ``uint8`` array.  Besides the dtypes named in the
safetensors README, 0.8 also accepts ``F8_E4M3FNUZ`` and ``F8_E5M2FNUZ``; they are included.

Header checks, in the order they are made
-----------------------------------------
The first failing check raises ``Exl2Error`` with its code; a malformed input therefore always gives
the same code.  Messages name the file and, where there is one, the tensor, and say expected vs found.

1.  ``HEADER_TOO_SMALL``  the file has fewer than 8 bytes.
2.  ``HEADER_TOO_LARGE``  the declared header length exceeds ``MAX_HEADER_BYTES`` (100_000_000).
3.  ``HEADER_PAST_EOF``   ``8 + n`` exceeds the file size.  (Only now is the header read: the
    allocation is bounded by 1-3.)
4.  ``HEADER_NOT_UTF8``   the header bytes are not valid UTF-8.
5.  ``HEADER_NOT_JSON``   the header does not start with ``{`` (trailing JSON whitespace - safetensors
    pads with spaces - is allowed, leading whitespace is not); it is not one valid JSON value; it uses
    ``NaN``/``Infinity``; a number is outside the f64 range; a ``\\uD800``-style escape is an unpaired
    surrogate; or objects/arrays nest deeper than ``JSON_MAX_DEPTH`` (127, the depth at which the
    reference's serde_json parser stops).  These mirror what the reference parser rejects.
6.  ``DUPLICATE_KEY``     any JSON object anywhere in the header repeats a key (after unescaping).
7.  ``TOO_MANY_TENSORS``  more than ``MAX_TENSORS`` (1_000_000) tensor entries.
8.  ``METADATA_INVALID``  ``__metadata__`` is present and is not an object of string -> string.
9.  Per tensor entry, in header order, each entry fully before the next:
    ``TENSOR_ENTRY_INVALID`` (not an object; ``dtype``/``shape``/``data_offsets`` missing; ``dtype``
    not a string, ``shape`` or ``data_offsets`` not a list) ->
    ``DTYPE_UNKNOWN`` -> ``SHAPE_INVALID`` (a dim that is not an integer - JSON ``true`` is not an
    integer, nor is ``1.0`` or ``-0`` -, negative, >= 2**64, or more than ``MAX_NDIM`` = 8 dims) ->
    ``OFFSETS_INVALID`` (not exactly two integers with ``0 <= begin <= end < 2**64``) ->
    ``SIZE_OVERFLOW`` (the running product of the dims, or numel * bits, reaches 2**64: the reference's
    ``checked_mul`` rule, computed with Python ints) ->
    ``MISALIGNED_SLICE`` (numel * bits is not a multiple of 8) ->
    ``SIZE_MISMATCH`` (``end - begin != numel * bits / 8``).
    Unknown extra fields in an entry are ignored, like the reference does.
10. Layout, tensors sorted by ``(begin, end)``: the first must begin at 0 and each must begin where the
    previous one ended (a zero-size tensor may sit at that running offset, also next to a tensor that
    starts there): a later begin is ``OFFSETS_GAP``, an earlier one ``OFFSETS_OVERLAP``.
11. ``TRUNCATED``        ``data_start + last end`` exceeds the file size.
12. ``TRAILING_BYTES``   bytes follow the last tensor's data.

Stricter than the reference (``STRICTER_THAN_REFERENCE``)
---------------------------------------------------------
Checked against safetensors 0.8.0 (``safetensors.deserialize``, the Rust ``SafeTensors::deserialize``).
Every file this parser accepts is accepted by the reference; the reference additionally accepts:

* ``HEADER_NOT_JSON``:  JSON whitespace *before* the opening ``{``.  serde_json skips it (the Rust
  crate even has a test that leading padding is allowed), the safetensors README says the header
  "MUST begin with ``{``".
* ``DUPLICATE_KEY``:   repeated tensor names (the reference silently keeps the last entry, so
  ``"a": F16 [2] [0,4]`` followed by ``"a": U8 [4] [0,4]`` loads as U8 there and as F16 in a reader that
  keeps the first: a parser differential), repeated ``__metadata__`` keys, and duplicate keys inside
  unknown fields.  (The reference does reject a repeated ``__metadata__`` and a repeated
  ``dtype``/``shape``/``data_offsets`` field.)  The README says duplicate keys are disallowed.
* ``METADATA_INVALID``: ``"__metadata__": null`` (the reference treats it as absent).
* ``TENSOR_ENTRY_INVALID``: an entry written as a JSON array ``["F16", [2], [0, 4]]`` (serde fills a
  struct from a sequence) and a dtype written as a map ``{"F16": null}`` (serde's externally tagged
  enum form).  No writer produces either.
* ``SHAPE_INVALID``:   more than 8 dims.  The reference has no cap (a 100-dim shape of ones is
  accepted); 8 is the cap of GGML/huggingface.js and of every framework exl2fmt feeds.
* ``TOO_MANY_TENSORS``: more than 1_000_000 tensors (the reference has no cap); bounds the work per file.

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

Writer
------
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
"""

from __future__ import annotations

import collections
import json
import math
import mmap
import os
import re
import secrets
import stat
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from .errors import ErrorCode, Exl2Error, Issue, Severity

__all__ = [
    "MAX_HEADER_BYTES", "MAX_TENSORS", "MAX_NDIM", "JSON_MAX_DEPTH", "MAX_INDEX_BYTES", "MAX_CONFIG_BYTES",
    "MAX_OPEN_SHARDS", "INDEX_NAME", "DtypeSpec", "SAFETENSORS_DTYPES", "RAW_DTYPES", "STRICTER_THAN_REFERENCE",
    "TensorInfo", "SafetensorsHeader", "read_header", "parse_header", "SafetensorsFile", "ModelFiles",
    "open_model", "RawTensor", "numpy_to_safetensors_dtype", "serialize", "write_safetensors", "write_sharded",
    "file_kind", "open_regular",
]

# ------------------------------------------------------------------------------------------------
# constants and tables
# ------------------------------------------------------------------------------------------------

MAX_HEADER_BYTES = 100_000_000
"""Largest header length accepted (the reference's ``MAX_HEADER_SIZE``)."""
MAX_TENSORS = 1_000_000
"""Most tensor entries accepted in one file (stricter than the reference, which has no cap)."""
MAX_NDIM = 8
"""Most dims accepted in a shape (stricter than the reference, which has no cap)."""
JSON_MAX_DEPTH = 127
"""Deepest object/array nesting (top-level object = 1) the reference's serde_json parser accepts."""
MAX_INDEX_BYTES = 100_000_000
"""Largest ``*.safetensors.index.json`` read."""
MAX_CONFIG_BYTES = 100_000_000
"""Largest ``config.json`` read."""
MAX_OPEN_SHARDS = 32
"""Most shards a ``ModelFiles`` keeps memory-mapped at once (each holds one file descriptor)."""
INDEX_NAME = "model.safetensors.index.json"

_U64 = 1 << 64
_JSON_WS = " \t\n\r"


class DtypeSpec(NamedTuple):
    """``bits`` per element and the little-endian numpy dtype ``get`` returns (None: sub-byte, raw bytes)."""

    bits: int
    numpy: np.dtype | None


SAFETENSORS_DTYPES: Mapping[str, DtypeSpec] = MappingProxyType({
    "BOOL": DtypeSpec(8, np.dtype(np.bool_)),
    "F4": DtypeSpec(4, None),
    "F6_E2M3": DtypeSpec(6, None),
    "F6_E3M2": DtypeSpec(6, None),
    "U8": DtypeSpec(8, np.dtype("u1")),
    "I8": DtypeSpec(8, np.dtype("i1")),
    "F8_E5M2": DtypeSpec(8, np.dtype("u1")),
    "F8_E4M3": DtypeSpec(8, np.dtype("u1")),
    "F8_E8M0": DtypeSpec(8, np.dtype("u1")),
    "F8_E4M3FNUZ": DtypeSpec(8, np.dtype("u1")),
    "F8_E5M2FNUZ": DtypeSpec(8, np.dtype("u1")),
    "I16": DtypeSpec(16, np.dtype("<i2")),
    "U16": DtypeSpec(16, np.dtype("<u2")),
    "F16": DtypeSpec(16, np.dtype("<f2")),
    "BF16": DtypeSpec(16, np.dtype("<u2")),
    "I32": DtypeSpec(32, np.dtype("<i4")),
    "U32": DtypeSpec(32, np.dtype("<u4")),
    "F32": DtypeSpec(32, np.dtype("<f4")),
    "C64": DtypeSpec(64, np.dtype("<c8")),
    "F64": DtypeSpec(64, np.dtype("<f8")),
    "I64": DtypeSpec(64, np.dtype("<i8")),
    "U64": DtypeSpec(64, np.dtype("<u8")),
})
"""Every dtype safetensors 0.8 accepts, in the reference's enum order (increasing alignment)."""

RAW_DTYPES = frozenset({"BF16", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
"""Dtypes numpy cannot represent: ``get`` returns their bits as unsigned ints of the same width."""

_DTYPE_RANK = {name: i for i, name in enumerate(SAFETENSORS_DTYPES)}

STRICTER_THAN_REFERENCE: Mapping[ErrorCode, str] = MappingProxyType({
    ErrorCode.HEADER_NOT_JSON: "JSON whitespace before the opening '{' (the README requires the header to begin with '{')",
    ErrorCode.DUPLICATE_KEY: "repeated tensor names, repeated __metadata__ keys, duplicate keys inside unknown fields "
                             "(the reference silently keeps the last one; other readers may keep the first)",
    ErrorCode.METADATA_INVALID: '"__metadata__": null (the reference treats it as absent)',
    ErrorCode.TENSOR_ENTRY_INVALID: "a tensor entry written as a JSON array, or a dtype written as a {\"F16\": null} map "
                                    "(serde accepts both forms)",
    ErrorCode.SHAPE_INVALID: "more than 8 dims (the reference has no cap)",
    ErrorCode.TOO_MANY_TENSORS: "more than MAX_TENSORS tensors in one file (the reference has no cap)",
})
"""Error codes this parser raises for some files the reference library accepts, with the reason."""


# ------------------------------------------------------------------------------------------------
# header data classes
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry.  ``begin``/``end`` are relative to ``data_start`` (the absolute offset of the
    data buffer in ``file``, also recorded here)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str
    data_start: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bits(self) -> int:
        return SAFETENSORS_DTYPES[self.dtype].bits

    @property
    def abs_begin(self) -> int:
        return self.data_start + self.begin

    @property
    def abs_end(self) -> int:
        return self.data_start + self.end


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header.  ``tensors`` is in offset order."""

    path: str
    file_size: int
    header_len: int
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    has_metadata: bool = False

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# ------------------------------------------------------------------------------------------------
# header parsing
# ------------------------------------------------------------------------------------------------

class _JsonReject(Exception):
    """Internal: the header is JSON the reference parser would reject."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def _err(code: ErrorCode, msg: str, path: str, tensor: str | None = None) -> Exl2Error:
    return Exl2Error(code, msg, file=path, tensor=tensor)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _jrepr(value: Any, limit: int = 60) -> str:
    """A short JSON-ish rendering of a parsed value for messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return _short(text, limit)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _decode_json(text: str) -> tuple[Any, tuple[str, bool] | None]:
    """Parse like serde_json would accept; return (value, None or (first duplicate key, is top-level)).

    Raises ``_JsonReject`` (with a reason) or ``ValueError``/``RecursionError`` for invalid JSON.
    """
    dup: list[tuple[str, int]] = []  # (first repeated key, index of the object-completion call)
    calls = [0]

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict:
        d = dict(pairs)
        if len(d) != len(pairs) and not dup:
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    dup.append((k, calls[0]))
                    break
                seen.add(k)
        calls[0] += 1
        return d

    def parse_constant(name: str) -> Any:
        raise _JsonReject(f"{name} is not a JSON value")

    def parse_float(s: str) -> float:
        f = float(s)
        if math.isinf(f):
            raise _JsonReject(f"number {_short(s, 30)} is out of the f64 range")
        return f

    def parse_int(s: str) -> Any:
        if s == "-0":
            return -0.0  # serde_json reads -0 as a float, not as the integer 0
        if len(s) > 20 and math.isinf(float(s)):
            raise _JsonReject(f"number {_short(s, 30)} is out of the f64 range")
        return int(s)

    decoder = json.JSONDecoder(object_pairs_hook=pairs_hook, parse_float=parse_float, parse_int=parse_int,
                               parse_constant=parse_constant)
    value = decoder.decode(text)
    _check_json_tree(value, text)
    if not dup:
        return value, None
    # the top-level object completes last: a repeat there is a repeated tensor name (or __metadata__)
    key, call = dup[0]
    return value, (key, call == calls[0] - 1)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_json_tree(root: Any, text: str) -> None:
    """Nesting depth and unpaired surrogates (from ``\\uD8xx`` escapes), which serde_json rejects."""
    # depth: the usual shape (root -> entry -> flat list) is walked without a stack
    for v in root.values():  # depth 2
        if isinstance(v, dict):
            for x in v.values():  # depth 3
                if isinstance(x, list):
                    for y in x:
                        if isinstance(y, (dict, list)):
                            _check_depth(y, 4)
                elif isinstance(x, dict):
                    _check_depth(x, 3)
        elif isinstance(v, list):
            _check_depth(v, 2)
    # surrogates: only reachable through a \uD800-\uDFFF escape in the text
    if _SURROGATE_ESCAPE.search(text):
        stack: list[Any] = [root]
        while stack:
            obj = stack.pop()
            items = obj.items() if isinstance(obj, dict) else zip(("",) * len(obj), obj)
            for k, v in items:
                if _SURROGATE.search(k):
                    raise _JsonReject("a key contains an unpaired UTF-16 surrogate escape")
                if isinstance(v, (dict, list)):
                    stack.append(v)
                elif isinstance(v, str) and _SURROGATE.search(v):
                    raise _JsonReject("a string contains an unpaired UTF-16 surrogate escape")


def _check_depth(node: Any, depth: int) -> None:
    stack: list[tuple[Any, int]] = [(node, depth)]
    while stack:
        obj, d = stack.pop()
        if d > JSON_MAX_DEPTH:
            raise _JsonReject(f"objects/arrays nest deeper than {JSON_MAX_DEPTH} levels")
        for v in (obj.values() if isinstance(obj, dict) else obj):
            if isinstance(v, (dict, list)):
                stack.append((v, d + 1))


def _check_prefix(first: bytes, file_size: int, path: str) -> int:
    """Checks 1-3: returns the header length n."""
    if file_size < 8 or len(first) < 8:
        raise _err(ErrorCode.HEADER_TOO_SMALL,
                   f"expected at least 8 bytes (the header length), found a file of {min(file_size, len(first))} bytes",
                   path)
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER_BYTES:
        raise _err(ErrorCode.HEADER_TOO_LARGE,
                   f"declared header length {n} bytes exceeds the cap of {MAX_HEADER_BYTES} bytes", path)
    if 8 + n > file_size:
        raise _err(ErrorCode.HEADER_PAST_EOF,
                   f"declared header length {n} bytes needs a file of at least {8 + n} bytes, found {file_size}", path)
    return n


def _parse_header_bytes(hb: bytes, n: int, file_size: int, path: str) -> SafetensorsHeader:
    """Checks 4-12 on the n header bytes."""
    data_start = 8 + n
    # 4. UTF-8
    try:
        text = bytes(hb).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _err(ErrorCode.HEADER_NOT_UTF8,
                   f"expected UTF-8, found an invalid byte sequence at header byte {e.start}", path) from None
    # 5. JSON object
    if not text.startswith("{"):
        found = "an empty header" if not text else f"{text[:1]!r}"
        extra = " (leading whitespace is not allowed)" if text[:1] in _JSON_WS and text else ""
        raise _err(ErrorCode.HEADER_NOT_JSON, f"expected the header to start with '{{', found {found}{extra}", path)
    try:
        root, dup = _decode_json(text)
    except _JsonReject as e:
        raise _err(ErrorCode.HEADER_NOT_JSON, f"expected a JSON object, found invalid JSON: {e}", path) from None
    except RecursionError:
        raise _err(ErrorCode.HEADER_NOT_JSON,
                   f"expected a JSON object, found nesting deeper than {JSON_MAX_DEPTH} levels", path) from None
    except ValueError as e:  # JSONDecodeError, int() digit limit
        raise _err(ErrorCode.HEADER_NOT_JSON, f"expected a JSON object, found invalid JSON: {_short(str(e), 120)}",
                   path) from None
    if not isinstance(root, dict):  # pragma: no cover - '{' + valid JSON is always an object
        raise _err(ErrorCode.HEADER_NOT_JSON, f"expected a JSON object, found {_json_type(root)}", path)
    # 6. duplicate keys
    if dup is not None:
        key, top = dup
        what = ("tensor name" if key != "__metadata__" else "key") if top else "key (in a nested object)"
        raise _err(ErrorCode.DUPLICATE_KEY, f"expected unique keys in every JSON object, found {what} {key!r} twice",
                   path, tensor=key if top and key != "__metadata__" else None)
    # 7. tensor count
    has_meta = "__metadata__" in root
    count = len(root) - (1 if has_meta else 0)
    if count > MAX_TENSORS:
        raise _err(ErrorCode.TOO_MANY_TENSORS, f"expected at most {MAX_TENSORS} tensors, found {count}", path)
    # 8. metadata
    metadata: dict[str, str] = {}
    if has_meta:
        meta = root["__metadata__"]
        if not isinstance(meta, dict):
            raise _err(ErrorCode.METADATA_INVALID,
                       f"expected __metadata__ to be an object of string -> string, found {_json_type(meta)}", path)
        for k, v in meta.items():
            if not isinstance(v, str):
                raise _err(ErrorCode.METADATA_INVALID,
                           f"expected __metadata__ values to be strings, found {_json_type(v)} for key {k!r}", path)
        metadata = dict(meta)
    # 9. entries
    entries: list[tuple[int, TensorInfo]] = []
    for pos, (name, entry) in enumerate(root.items()):
        if name == "__metadata__":
            continue
        entries.append((pos, _check_entry(name, entry, path, data_start)))
    # 10. layout
    entries.sort(key=lambda pe: (pe[1].begin, pe[1].end, pe[0]))
    running = 0
    prev: TensorInfo | None = None
    for _, t in entries:
        if t.begin > running:
            after = f"after tensor {prev.name!r}" if prev is not None else "at the start of the data buffer"
            raise _err(ErrorCode.OFFSETS_GAP,
                       f"expected data to begin at offset {running} ({after}), found begin {t.begin}: "
                       f"a hole of {t.begin - running} bytes", path, tensor=t.name)
        if t.begin < running:
            raise _err(ErrorCode.OFFSETS_OVERLAP,
                       f"expected data to begin at offset {running}, found begin {t.begin}: overlaps tensor "
                       f"{prev.name if prev else ''!r} [{prev.begin if prev else 0}, {running})", path, tensor=t.name)
        running = t.end
        prev = t
    # 11/12. coverage of the file
    expected_size = data_start + running
    if expected_size > file_size:
        raise _err(ErrorCode.TRUNCATED,
                   f"expected a file of {expected_size} bytes (data buffer of {running} bytes), found {file_size} "
                   f"bytes: {expected_size - file_size} bytes missing", path,
                   tensor=prev.name if prev is not None else None)
    if expected_size < file_size:
        raise _err(ErrorCode.TRAILING_BYTES,
                   f"expected a file of {expected_size} bytes, found {file_size} bytes: "
                   f"{file_size - expected_size} bytes after the last tensor", path)
    tensors = {t.name: t for _, t in entries}
    return SafetensorsHeader(path=path, file_size=file_size, header_len=n, data_start=data_start,
                             metadata=metadata, tensors=tensors, has_metadata=has_meta)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _check_entry(name: str, entry: Any, path: str, data_start: int) -> TensorInfo:
    """Check 9 for one entry."""
    if not isinstance(entry, dict):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID,
                   f"expected an object with dtype, shape, data_offsets, found {_json_type(entry)}", path, tensor=name)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected a field {key!r}, found none", path, tensor=name)
    dtype = entry["dtype"]
    if not isinstance(dtype, str):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected dtype to be a string, found {_json_type(dtype)}",
                   path, tensor=name)
    shape = entry["shape"]
    if not isinstance(shape, list):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected shape to be an array, found {_json_type(shape)}",
                   path, tensor=name)
    offsets = entry["data_offsets"]
    if not isinstance(offsets, list):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID,
                   f"expected data_offsets to be an array, found {_json_type(offsets)}", path, tensor=name)
    spec = SAFETENSORS_DTYPES.get(dtype)
    if spec is None:
        raise _err(ErrorCode.DTYPE_UNKNOWN,
                   f"expected one of {', '.join(SAFETENSORS_DTYPES)}, found dtype {_short(dtype, 40)!r}",
                   path, tensor=name)
    if len(shape) > MAX_NDIM:
        raise _err(ErrorCode.SHAPE_INVALID, f"expected at most {MAX_NDIM} dims, found {len(shape)}", path, tensor=name)
    for i, d in enumerate(shape):
        if not _is_int(d) or d < 0 or d >= _U64:
            raise _err(ErrorCode.SHAPE_INVALID,
                       f"expected dim {i} to be an integer in [0, 2**64), found {_jrepr(d)}", path, tensor=name)
    if (len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1] < _U64):
        raise _err(ErrorCode.OFFSETS_INVALID,
                   f"expected data_offsets [begin, end] of integers with 0 <= begin <= end < 2**64, "
                   f"found {_jrepr(offsets)}", path, tensor=name)
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
        if numel >= _U64:
            raise _err(ErrorCode.SIZE_OVERFLOW,
                       f"expected the element count of shape {_jrepr(shape)} to stay below 2**64, found it does not",
                       path, tensor=name)
    nbits = numel * spec.bits
    if nbits >= _U64:
        raise _err(ErrorCode.SIZE_OVERFLOW,
                   f"expected numel x {spec.bits} bits to stay below 2**64, found {numel} x {spec.bits} bits",
                   path, tensor=name)
    if nbits % 8:
        raise _err(ErrorCode.MISALIGNED_SLICE,
                   f"expected {dtype} data to end on a byte boundary, found {numel} x {spec.bits} = {nbits} bits",
                   path, tensor=name)
    size = nbits // 8
    if end - begin != size:
        raise _err(ErrorCode.SIZE_MISMATCH,
                   f"expected end - begin = {size} bytes ({dtype} x {tuple(shape)}), found {end - begin} "
                   f"(data_offsets [{begin}, {end}])", path, tensor=name)
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end, file=path,
                      data_start=data_start)


def parse_header(buf: bytes | bytearray | memoryview, *, file_size: int, path: str) -> SafetensorsHeader:
    """Validate the header held in ``buf`` (the file's first bytes, or all of it) of a file of ``file_size``.

    Never reads past ``8 + n`` of ``buf``.  Raises ``Exl2Error`` only.
    """
    path = str(path)
    if not _is_int(file_size) or file_size < 0:
        raise _err(ErrorCode.IO_ERROR, f"expected a non-negative file size, found {file_size!r}", path)
    try:
        mv = buf if isinstance(buf, bytes) else memoryview(buf).cast("B")
    except TypeError:
        raise _err(ErrorCode.IO_ERROR, f"expected a bytes-like buffer, found {type(buf).__name__}", path) from None
    n = _check_prefix(bytes(mv[:8]), file_size, path)
    if len(mv) < 8 + n:
        raise _err(ErrorCode.HEADER_PAST_EOF,
                   f"declared header length {n} bytes needs {8 + n} bytes, found only {len(mv)} bytes", path)
    return _parse_header_bytes(bytes(mv[8:8 + n]), n, file_size, path)


def file_kind(st: os.stat_result) -> str:
    """What a stat result describes, for messages: "a regular file", "a FIFO (named pipe)", ..."""
    m = st.st_mode
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(m):
            return what
    return "a special file"  # pragma: no cover - no other kinds on Linux


def _stat_regular(path: str) -> os.stat_result:
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
    file swapped for a FIFO after ``_stat_regular`` cannot block: the open itself is non-blocking)."""
    _stat_regular(path)
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


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file (reads 8 + n bytes, never the data)."""
    p = os.fspath(path)
    try:
        with open_regular(p) as f:
            file_size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            n = _check_prefix(first, file_size, p)
            hb = f.read(n)
    except FileNotFoundError:
        raise _err(ErrorCode.PATH_NOT_FOUND, "expected an existing file, found nothing at this path", p) from None
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot read: {e.strerror or e}", p) from None
    if len(hb) < n:
        raise _err(ErrorCode.HEADER_PAST_EOF,
                   f"declared header length {n} bytes, found only {len(hb)} header bytes (file shrank?)", p)
    return _parse_header_bytes(hb, n, file_size, p)


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
        spec = SAFETENSORS_DTYPES[t.dtype]
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


def _read_json_file(path: Path, cap: int, code: ErrorCode, what: str) -> Any:
    p = str(path)
    st = _stat_regular(p)
    if st.st_size > cap:
        raise _err(code, f"expected {what} of at most {cap} bytes, found {st.st_size} bytes", p)
    try:
        with open_regular(p) as f:
            raw = f.read(min(cap, st.st_size) + 1)  # never allocate by the cap
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot read: {e.strerror or e}", p) from None
    if len(raw) > cap:
        raise _err(code, f"expected {what} of at most {cap} bytes, found more", p)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _err(code, f"expected UTF-8 {what}, found an invalid byte at {e.start}", p) from None
    try:
        return json.loads(text, object_pairs_hook=_dup_hook)
    except RecursionError:
        raise _err(code, f"expected {what} as JSON, found nesting too deep", p) from None
    except ValueError as e:
        raise _err(code, f"expected {what} as JSON, found invalid JSON: {_short(str(e), 120)}", p) from None


def _plain_dict(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_dict(v) for v in obj]
    return obj


_BAD_SHARD_CHARS = ("/", "\\", "\x00")


def _valid_shard_name(name: str) -> bool:
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
                value = _read_json_file(self.config_path, MAX_CONFIG_BYTES, ErrorCode.CONFIG_INVALID, "config.json")
                if not isinstance(value, dict):
                    raise _err(ErrorCode.CONFIG_INVALID,
                               f"expected a JSON object, found {_json_type(value)}", str(self.config_path))
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
        _stat_regular(str(q))
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
        _stat_regular(str(p))  # a FIFO / device / dangling link is IO_ERROR whatever its name
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
    doc = _read_json_file(index, MAX_INDEX_BYTES, ErrorCode.INDEX_INVALID, "the index")
    if not isinstance(doc, dict):
        raise _err(ErrorCode.INDEX_INVALID, f"expected a JSON object, found {_json_type(doc)}", ip)
    wm = doc.get("weight_map")
    if not isinstance(wm, dict):
        raise _err(ErrorCode.INDEX_INVALID, f"expected \"weight_map\" to be an object, found {_json_type(wm)}", ip)
    if getattr(wm, "dups", None):
        raise _err(ErrorCode.INDEX_INVALID, f"expected each tensor once in weight_map, found {wm.dups[0]!r} twice",
                   ip, tensor=wm.dups[0])
    for name, shard in wm.items():
        if not isinstance(shard, str):
            raise _err(ErrorCode.INDEX_INVALID, f"expected a shard file name, found {_json_type(shard)}", ip, tensor=name)
        if not _valid_shard_name(shard):
            raise _err(ErrorCode.INDEX_INVALID,
                       f"expected a plain file name inside the model directory, found {_short(shard)!r}", ip,
                       tensor=name)
    meta = doc.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise _err(ErrorCode.INDEX_INVALID, f"expected \"metadata\" to be an object, found {_json_type(meta)}", ip)

    issues: list[Issue] = []
    per_shard: dict[str, int] = {}  # shard name -> indexed tensors (one pass: linear in the index)
    for v in wm.values():
        per_shard[v] = per_shard.get(v, 0) + 1
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

    # where each tensor is; which copy `tensors` exposes (the indexed shard, else the last file)
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
    if isinstance(meta, dict) and "total_size" in meta:
        ts = meta["total_size"]
        actual = sum(t.nbytes for t in tensors.values())
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            issues.append(Issue(ErrorCode.INDEX_TOTAL_SIZE,
                                f"expected metadata.total_size to be a number, found {_json_type(ts)}",
                                file=ip, severity=Severity.WARNING))
        elif ts != actual:
            issues.append(Issue(ErrorCode.INDEX_TOTAL_SIZE,
                                f"expected metadata.total_size = {actual} (sum of tensor bytes), found {_jrepr(ts)}",
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


# ------------------------------------------------------------------------------------------------
# writer
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RawTensor:
    """A tensor given as raw bytes with a safetensors dtype (for BF16, F8_*, F4, F6_*, ...).

    ``data`` is any contiguous-able array whose bytes are the little-endian element data (multi-byte
    numeric arrays in big-endian order are byte-swapped first); its size must equal shape x dtype bits / 8.
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray = field(repr=False)


_NUMPY_TO_ST = {
    ("b", 1): "BOOL",
    ("i", 1): "I8", ("i", 2): "I16", ("i", 4): "I32", ("i", 8): "I64",
    ("u", 1): "U8", ("u", 2): "U16", ("u", 4): "U32", ("u", 8): "U64",
    ("f", 2): "F16", ("f", 4): "F32", ("f", 8): "F64",
    ("c", 8): "C64",
}


def numpy_to_safetensors_dtype(dtype: Any) -> str | None:
    """The safetensors dtype string of a numpy dtype (None if safetensors has no equivalent)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    return _NUMPY_TO_ST.get((dt.kind, dt.itemsize))


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
    if _SURROGATE.search(name):
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
        if _SURROGATE.search(k) or _SURROGATE.search(v):
            raise _err(ErrorCode.METADATA_INVALID, f"expected UTF-8 encodable metadata, found a lone surrogate in {k!r}",
                       where)
    return {k: metadata[k] for k in sorted(metadata)}


def _order(prepared: list[_Prepared], order: str, where: str) -> list[_Prepared]:
    if order == "name":
        return sorted(prepared, key=lambda p: p.name)
    if order == "safetensors":
        return sorted(prepared, key=lambda p: (-_DTYPE_RANK[p.dtype], p.name))
    raise _err(ErrorCode.USAGE, f"expected order 'name' or 'safetensors', found {order!r}", where)


def _build_header(items: list[_Prepared], metadata: dict[str, str] | None, where: str) -> bytes:
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


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write via a temp file in the same directory, fsync, os.replace; the temp file never survives."""
    parent = path.parent if str(path.parent) else Path(".")
    tmp = None
    for _ in range(100):
        cand = parent / f".{path.name[:180]}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(cand, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise _err(ErrorCode.IO_ERROR, f"cannot create a temp file next to the output: {e.strerror or e}",
                       str(path)) from None
        tmp = cand
        break
    if tmp is None:  # pragma: no cover
        raise _err(ErrorCode.IO_ERROR, "cannot create a temp file next to the output", str(path))
    done = False
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        done = True
    except OSError as e:
        raise _err(ErrorCode.IO_ERROR, f"cannot write: {e.strerror or e}", str(path)) from None
    finally:
        if not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    try:  # make the rename durable (best effort; not possible on every platform)
        dfd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def serialize(tensors: Mapping[str, np.ndarray | RawTensor], metadata: dict[str, str] | None = None, *,
              order: str = "name") -> bytes:
    """The bytes ``write_safetensors`` would write (for small in-memory files, tests and fuzz corpora)."""
    items = _order(_prepare_all(tensors, "<memory>"), order, "<memory>")
    hb = _build_header(items, _check_metadata(metadata, "<memory>"), "<memory>")
    parts = [struct.pack("<Q", len(hb)), hb]
    parts += [p.array.reshape(-1).view(np.uint8).tobytes() for p in items if p.nbytes]
    return b"".join(parts)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray | RawTensor],
                      metadata: dict[str, str] | None = None, *, order: str = "name") -> Path:
    """Write one safetensors file atomically (replacing an existing one).  Returns the path.

    ``order="name"`` (default) stores tensors sorted by name; ``order="safetensors"`` uses the reference's
    order (descending dtype alignment, then name).  Metadata keys are sorted.
    """
    p = Path(os.fspath(path))
    items = _order(_prepare_all(tensors, str(p)), order, str(p))
    hb = _build_header(items, _check_metadata(metadata, str(p)), str(p))
    _atomic_write(p, lambda f: _write_stream(f, hb, items))
    return p


_SHARD_RE_CACHE: dict[str, re.Pattern] = {}


def _shard_re(prefix: str) -> re.Pattern:
    r = _SHARD_RE_CACHE.get(prefix)
    if r is None:
        r = re.compile(re.escape(prefix) + r"-\d{5,}-of-\d{5,}\.safetensors")
        _SHARD_RE_CACHE[prefix] = r
    return r


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
    if not isinstance(prefix, str) or not _valid_shard_name(prefix):
        raise _err(ErrorCode.USAGE, f"expected a plain file-name prefix, found {prefix!r}", where)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise _err(ErrorCode.USAGE, f"expected a positive max_shard_bytes, found {max_shard_bytes!r}", where)
    meta = _check_metadata(metadata, where)
    items = sorted(_prepare_all(tensors, where), key=lambda p: p.name)
    shards: list[list[_Prepared]] = [[]]
    cur = 0
    for p in items:
        if shards[-1] and cur + p.nbytes > max_shard_bytes:
            shards.append([])
            cur = 0
        shards[-1].append(p)
        cur += p.nbytes
    n = len(shards)
    names = [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    index_name = f"{prefix}.safetensors.index.json"
    headers = [_build_header(_order(s, order, where), meta, where) for s in shards]

    try:
        d.mkdir(parents=True, exist_ok=True)
        existing = []
        pat = _shard_re(prefix)
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
        _atomic_write(out, lambda f, hb=hb, items_o=items_o: _write_stream(f, hb, items_o))
        paths.append(out)
    written = set(names)
    if n > 1:
        index = {"metadata": {"total_size": sum(p.nbytes for p in items)},
                 "weight_map": {p.name: names[i] for i, s in enumerate(shards) for p in s}}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        _atomic_write(d / index_name, lambda f: f.write(text.encode("utf-8")))
        written.add(index_name)
    for q in existing:
        if q.name not in written:
            try:
                q.unlink()
            except OSError as e:
                raise _err(ErrorCode.IO_ERROR, f"cannot remove stale output: {e.strerror or e}", str(q)) from None
    return paths
