"""The safetensors header parser: the file format's rules, its limits and the JSON rules of the reference.

Only numpy and the standard library are used here (no torch, numba, rich or typer).

File layout (safetensors)
-------------------------
``u64 LE header length n`` | ``n bytes of UTF-8 JSON`` | ``data buffer``.  The JSON object maps tensor
names to ``{"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}`` (offsets relative to the
start of the data buffer, ``data_start = 8 + n``) plus an optional ``"__metadata__": {str: str}``.

Dtypes
------
The dtype table lives in ``exl2fmt.container.dtypes`` (``SAFETENSORS_DTYPES``, ``RAW_DTYPES``).

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
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import ErrorCode, Exl2Error
from .dtypes import DTYPE_BITS

__all__ = [
    "MAX_HEADER_BYTES", "MAX_TENSORS", "MAX_NDIM", "JSON_MAX_DEPTH", "STRICTER_THAN_REFERENCE", "TensorInfo",
    "SafetensorsHeader", "parse_header", "check_prefix", "parse_header_bytes", "LONE_SURROGATE", "shorten",
    "json_repr", "json_type",
]

# ------------------------------------------------------------------------------------------------
# limits
# ------------------------------------------------------------------------------------------------

MAX_HEADER_BYTES = 100_000_000
"""Largest header length accepted (the reference's ``MAX_HEADER_SIZE``)."""
MAX_TENSORS = 1_000_000
"""Most tensor entries accepted in one file (stricter than the reference, which has no cap)."""
MAX_NDIM = 8
"""Most dims accepted in a shape (stricter than the reference, which has no cap)."""
JSON_MAX_DEPTH = 127
"""Deepest object/array nesting (top-level object = 1) the reference's serde_json parser accepts."""

_U64 = 1 << 64
_JSON_WS = " \t\n\r"


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
        return DTYPE_BITS[self.dtype]

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


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _err(code: ErrorCode, msg: str, path: str, tensor: str | None = None) -> Exl2Error:
    return Exl2Error(code, msg, file=path, tensor=tensor)


def shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def json_repr(value: Any, limit: int = 60) -> str:
    """A short JSON-ish rendering of a parsed value for messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return shorten(text, limit)


def json_type(value: Any) -> str:
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
            raise _JsonReject(f"number {shorten(s, 30)} is out of the f64 range")
        return f

    def parse_int(s: str) -> Any:
        if s == "-0":
            return -0.0  # serde_json reads -0 as a float, not as the integer 0
        if len(s) > 20 and math.isinf(float(s)):
            raise _JsonReject(f"number {shorten(s, 30)} is out of the f64 range")
        return int(s)

    # parse_int only acts on "-0" and on integers of more than 20 digits; a text holding neither (anywhere, strings
    # included) parses its integers with the decoder's own int(), which gives the same values
    needs_int_hook = "-0" in text or _LONG_DIGITS in text.translate(_DIGITS_AS_9)
    decoder = json.JSONDecoder(object_pairs_hook=pairs_hook, parse_float=parse_float,
                               parse_int=parse_int if needs_int_hook else None, parse_constant=parse_constant)
    value = decoder.decode(text)
    _check_json_tree(value, text)
    if not dup:
        return value, None
    # the top-level object completes last: a repeat there is a repeated tensor name (or __metadata__)
    key, call = dup[0]
    return value, (key, call == calls[0] - 1)


_DIGITS_AS_9 = str.maketrans("012345678", "999999999")
_LONG_DIGITS = "9" * 21  # a run of 21 digits once every digit reads 9 (str.translate + find: C speed, no regex)
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
                if LONE_SURROGATE.search(k):
                    raise _JsonReject("a key contains an unpaired UTF-16 surrogate escape")
                if isinstance(v, (dict, list)):
                    stack.append(v)
                elif isinstance(v, str) and LONE_SURROGATE.search(v):
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


def check_prefix(first: bytes, file_size: int, path: str) -> int:
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


def parse_header_bytes(hb: bytes, n: int, file_size: int, path: str) -> SafetensorsHeader:
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
        raise _err(ErrorCode.HEADER_NOT_JSON, f"expected a JSON object, found invalid JSON: {shorten(str(e), 120)}",
                   path) from None
    if not isinstance(root, dict):  # pragma: no cover - '{' + valid JSON is always an object
        raise _err(ErrorCode.HEADER_NOT_JSON, f"expected a JSON object, found {json_type(root)}", path)
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
                       f"expected __metadata__ to be an object of string -> string, found {json_type(meta)}", path)
        for k, v in meta.items():
            if not isinstance(v, str):
                raise _err(ErrorCode.METADATA_INVALID,
                           f"expected __metadata__ values to be strings, found {json_type(v)} for key {k!r}", path)
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


_new_object = object.__new__


def _tensor_info(name: str, dtype: str, shape: tuple, begin: int, end: int, file: str, data_start: int) -> TensorInfo:
    """``TensorInfo(...)`` for the parser's hot loop: the same fields without the frozen dataclass's
    ``__init__`` (one ``object.__setattr__`` per field; a 70B model has ~3000 entries per shard set).
    TensorInfo has no ``__post_init__``: tests/test_container.py checks both give equal objects."""
    t = _new_object(TensorInfo)
    d = t.__dict__
    d["name"] = name
    d["dtype"] = dtype
    d["shape"] = shape
    d["begin"] = begin
    d["end"] = end
    d["file"] = file
    d["data_start"] = data_start
    return t


def _check_entry(name: str, entry: Any, path: str, data_start: int) -> TensorInfo:
    """Check 9 for one entry: a well-formed entry takes the short path (every test below passes, in one go);
    anything else is checked field by field, in the documented order, by ``_check_entry_fields``."""
    if type(entry) is dict:
        dtype = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if type(dtype) is str and type(shape) is list and type(offsets) is list and len(offsets) == 2:
            bits = DTYPE_BITS.get(dtype)
            begin, end = offsets
            if (bits is not None and len(shape) <= MAX_NDIM and type(begin) is int and type(end) is int
                    and 0 <= begin <= end < _U64):
                numel = 1
                for d in shape:
                    # dims >= 1 only: the running product then never exceeds the final one, so one bound on
                    # the final numel * bits covers the reference's checked_mul at every step
                    if type(d) is not int or d < 1:
                        break
                    numel *= d
                else:
                    nbits = numel * bits
                    if nbits < _U64 and not nbits % 8 and end - begin == nbits // 8:
                        return _tensor_info(name, dtype, tuple(shape), begin, end, path, data_start)
    return _check_entry_fields(name, entry, path, data_start)


def _check_entry_fields(name: str, entry: Any, path: str, data_start: int) -> TensorInfo:
    """Check 9 for one entry, field by field: raises for the first broken rule."""
    if not isinstance(entry, dict):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID,
                   f"expected an object with dtype, shape, data_offsets, found {json_type(entry)}", path, tensor=name)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected a field {key!r}, found none", path, tensor=name)
    dtype = entry["dtype"]
    if not isinstance(dtype, str):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected dtype to be a string, found {json_type(dtype)}",
                   path, tensor=name)
    shape = entry["shape"]
    if not isinstance(shape, list):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID, f"expected shape to be an array, found {json_type(shape)}",
                   path, tensor=name)
    offsets = entry["data_offsets"]
    if not isinstance(offsets, list):
        raise _err(ErrorCode.TENSOR_ENTRY_INVALID,
                   f"expected data_offsets to be an array, found {json_type(offsets)}", path, tensor=name)
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise _err(ErrorCode.DTYPE_UNKNOWN,
                   f"expected one of {', '.join(DTYPE_BITS)}, found dtype {shorten(dtype, 40)!r}",
                   path, tensor=name)
    if len(shape) > MAX_NDIM:
        raise _err(ErrorCode.SHAPE_INVALID, f"expected at most {MAX_NDIM} dims, found {len(shape)}", path, tensor=name)
    for i, d in enumerate(shape):
        if not _is_int(d) or d < 0 or d >= _U64:
            raise _err(ErrorCode.SHAPE_INVALID,
                       f"expected dim {i} to be an integer in [0, 2**64), found {json_repr(d)}", path, tensor=name)
    if (len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1] < _U64):
        raise _err(ErrorCode.OFFSETS_INVALID,
                   f"expected data_offsets [begin, end] of integers with 0 <= begin <= end < 2**64, "
                   f"found {json_repr(offsets)}", path, tensor=name)
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
        if numel >= _U64:
            raise _err(ErrorCode.SIZE_OVERFLOW,
                       f"expected the element count of shape {json_repr(shape)} to stay below 2**64, found it does not",
                       path, tensor=name)
    nbits = numel * bits
    if nbits >= _U64:
        raise _err(ErrorCode.SIZE_OVERFLOW,
                   f"expected numel x {bits} bits to stay below 2**64, found {numel} x {bits} bits",
                   path, tensor=name)
    if nbits % 8:
        raise _err(ErrorCode.MISALIGNED_SLICE,
                   f"expected {dtype} data to end on a byte boundary, found {numel} x {bits} = {nbits} bits",
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
    n = check_prefix(bytes(mv[:8]), file_size, path)
    if len(mv) < 8 + n:
        raise _err(ErrorCode.HEADER_PAST_EOF,
                   f"declared header length {n} bytes needs {8 + n} bytes, found only {len(mv)} bytes", path)
    return parse_header_bytes(bytes(mv[8:8 + n]), n, file_size, path)

