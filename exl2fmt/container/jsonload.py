"""The one guarded JSON loader for side inputs: config.json, the index, tokenizer files, measurement.json, the
quantizer's job.json, calibration token ids, JSON answers of the Hub.

A byte cap does not bound a parse: 99 MB of ``[{},{},...]`` become 33 million dicts (2.4 GB), a 5000-digit
integer raises Python's int-conversion ``ValueError``, ``1e400`` silently becomes ``inf``, 100 000 nested
brackets raise ``RecursionError``, and a FIFO blocks the open forever.  Every reader of such a file therefore
goes through ``load_json`` (a path) or ``loads_json`` (bytes already in memory), which apply, in this order:

1. **regular file** (``load_json`` only): ``stat_regular`` / ``open_regular`` - a missing path is
   ``PATH_NOT_FOUND``, a FIFO, device, socket or directory ``IO_ERROR`` (never opened blocking);
2. **bytes**: at most ``kind.max_bytes`` (stat first, then a read of at most cap + 1 bytes: a file growing
   under us, or a lying stat, never makes us read more);
3. **structure**, by a scan of the raw bytes before any object is built (C-speed ``bytes``/``re`` calls;
   ``check_structure``): at most ``kind.max_items`` values (commas plus opening brackets: this is what bounds
   parse memory - about 70 bytes per value at worst), no number of more than ``MAX_NUMBER_DIGITS`` digits;
   nesting at most ``kind.max_depth`` deep (the parser's own recursion guard stops absurd depths - its
   ``RecursionError`` is mapped -, and an iterative walk checks the parsed value before anyone recurses into it);
4. **text**: UTF-8 (a leading BOM is allowed);
5. **JSON**: one JSON value; ``NaN``/``Infinity`` and numbers outside the float64 range (``1e400``) are
   refused; strings holding an unpaired UTF-16 surrogate (``"\\ud800"``, which no UTF-8 writer can emit) too.

Each failure is an ``Exl2Error`` with the kind's code (``CONFIG_INVALID``, ``INDEX_INVALID``,
``MEASUREMENT_INVALID``, ``CHECKPOINT_INVALID``, ``CALIBRATION_INVALID``, ...), the file, and a message that
names the rule; every parser exception (``ValueError``, ``RecursionError``, ``OverflowError``,
``UnicodeDecodeError``, ``MemoryError``) is mapped, none escapes.

Callers then state the shape they need with ``expect`` / ``expect_list_of`` / ``expect_dict_of`` (top-level type,
list of str, dict of str -> int, finite numbers ...), which raise the same code naming the file and the key, so
a list where an object is expected is that code, not an ``AttributeError``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import ErrorCode, Exl2Error
from .parse import LONE_SURROGATE, json_repr, json_type, shorten
from .regular import open_regular, stat_regular

__all__ = [
    "JsonKind", "MAX_NUMBER_DIGITS", "CONFIG", "INDEX", "TOKENIZER", "TOKENIZER_CONFIG", "SIDE_CONFIG",
    "MEASUREMENT", "JOB", "CALIBRATION_IDS", "CALIBRATION_LINE", "HUB_API", "MARKER_JSON", "load_json", "loads_json",
    "read_bounded", "check_structure", "expect", "expect_list_of", "expect_dict_of", "TYPES",
]

MAX_NUMBER_DIGITS = 100
"""Most digits in one JSON number (outside strings).  1e100 < float64 max, so a number without an exponent
that passes this can never overflow to inf; Python's own int-conversion limit (4300 digits) is never reached."""


@dataclass(frozen=True)
class JsonKind:
    """The limits of one kind of JSON side input and the code its problems get."""

    what: str          # for messages: "config.json", "the index", ...
    code: ErrorCode
    max_bytes: int
    max_items: int     # values (scalars and containers) in the whole document
    max_depth: int = 64
    #: NaN / Infinity / -Infinity (and an overflowing 1e400) read as the float values Python's own json writes and
    #: reads, for a later check that names the key (config.json: CONFIG_VALUE_INVALID, as before this loader)
    nonfinite: bool = False

    def with_code(self, code: ErrorCode) -> "JsonKind":
        return replace(self, code=code)

    def named(self, what: str) -> "JsonKind":
        """The same limits for a file of another name (``tokenizer_config.json`` read under TOKENIZER's caps)."""
        return replace(self, what=what)


_MB = 1 << 20
# Real files, for scale: config.json of large models ~10 KB; a 1M-tensor index ~100 MB; Gemma 3's tokenizer.json
# 33 MB / ~2M values; a 70B measurement.json ~3 MB.  Worst-case parse memory = max_items x ~70 bytes + 3 x bytes.
CONFIG = JsonKind("config.json", ErrorCode.CONFIG_INVALID, 16 * _MB, 1_000_000, nonfinite=True)
INDEX = JsonKind("the index", ErrorCode.INDEX_INVALID, 100_000_000, 3_000_000)
TOKENIZER = JsonKind("tokenizer.json", ErrorCode.CALIBRATION_INVALID, 100 * _MB, 6_000_000)
TOKENIZER_CONFIG = JsonKind("tokenizer_config.json", ErrorCode.CONFIG_INVALID, 32 * _MB, 1_000_000)
SIDE_CONFIG = JsonKind("a side config", ErrorCode.CONFIG_INVALID, 1 * _MB, 100_000)
MEASUREMENT = JsonKind("measurement.json", ErrorCode.MEASUREMENT_INVALID, 256 * _MB, 4_000_000)
JOB = JsonKind("job.json", ErrorCode.CHECKPOINT_INVALID, 256 * _MB, 4_000_000)
CALIBRATION_IDS = JsonKind("a token-id JSON file", ErrorCode.CALIBRATION_INVALID, 128 * _MB, 8_000_000)
CALIBRATION_LINE = JsonKind("a calibration JSON line", ErrorCode.CALIBRATION_INVALID, 64 * _MB, 100_000)
HUB_API = JsonKind("a Hub API answer", ErrorCode.HUB_BAD_RESPONSE, 64 * _MB, 2_000_000)
MARKER_JSON = JsonKind("an owner marker", ErrorCode.IO_ERROR, 4096, 1_000, 8)

# ---------------------------------------------------------------------------------------------------- scanning

# a JSON string, unrolled (no per-character alternation): blanked to "" before counting
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_TO_SQUARE = bytes.maketrans(b"{}", b"[]")
_DIGITS_AS_9 = bytes.maketrans(b"012345678", b"999999999")
_LONG_RUN = b"9" * (MAX_NUMBER_DIGITS + 1)  # translate + find: C speed, where a regex scan is not
_LOWER_E = bytes.maketrans(b"E", b"e")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _fail(kind: JsonKind, file: str | None, msg: str) -> Exl2Error:
    return Exl2Error(kind.code, f"{kind.what}: {msg}", file=file)


def check_structure(raw: bytes, kind: JsonKind, file: str | None = None) -> None:
    """Rule 3 on raw JSON bytes, before any object is built: value count and number length (and, when the strings
    had to be blanked anyway, nesting depth).

    The fast path counts commas and opening brackets over the whole text, strings included: an over-estimate, so
    a count under the cap proves the document small.  Only a text over the cap (or with a long digit run) is
    scanned again with its strings blanked, which is exact and several times slower."""
    items = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    if items <= kind.max_items and not _long_number(raw):
        return
    try:
        blank = _STRING.sub(b'""', raw)
    except MemoryError:
        raise _fail(kind, file, "out of memory while scanning the file") from None
    items = blank.count(b",") + blank.count(b"[") + blank.count(b"{") + 1
    if items > kind.max_items:
        raise _fail(kind, file, f"expected at most {kind.max_items} JSON values, found about {items} "
                                "(the value-count cap bounds the memory a parse may take)")
    if _long_number(blank):
        raise _fail(kind, file, f"expected numbers of at most {MAX_NUMBER_DIGITS} digits, found a longer one")
    # depth, on brackets outside strings: with one bracket kind, each replace() of the innermost "[]" pairs
    # removes one level of every chain, so a document at most max_depth deep is empty after max_depth rounds
    # (mismatched brackets are left to the parser: the scan stops when a round removes nothing)
    br = blank.translate(_TO_SQUARE, _NOT_BRACKETS)
    del blank
    for _ in range(kind.max_depth):
        shorter = br.replace(b"[]", b"")
        if len(shorter) == len(br):
            return
        br = shorter
    if len(br.replace(b"[]", b"")) < len(br):
        raise _too_deep(kind, file)


def _long_number(raw: bytes) -> bool:
    return raw.translate(_DIGITS_AS_9).find(_LONG_RUN) >= 0


def _too_deep(kind: JsonKind, file: str | None) -> Exl2Error:
    return _fail(kind, file, f"expected objects/arrays nested at most {kind.max_depth} deep, found deeper nesting")


def _deeper_than(root: Any, limit: int, subclasses: bool = False) -> bool:
    """True when containers nest deeper than ``limit`` (the top-level container is depth 1); iterative, level by
    level.  json.loads builds plain dict and list (a type() test is enough, and fast); an object_pairs_hook may
    build dict subclasses (``subclasses=True``: isinstance)."""
    def is_container(v: Any) -> bool:
        return type(v) in _CONTAINERS or (subclasses and isinstance(v, (dict, list)))

    level = [root] if is_container(root) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        nxt: list = []
        add = nxt.append
        for c in level:
            vals = c.values() if isinstance(c, dict) else c
            if subclasses:
                nxt.extend([v for v in vals if isinstance(v, (dict, list))])
                continue
            for v in vals:
                if type(v) in _CONTAINERS:
                    add(v)
        level = nxt
    return False


_CONTAINERS = frozenset({dict, list})


def _parse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _parse_float(s: str) -> float:
    f = float(s)
    if math.isinf(f):
        raise ValueError(f"the number {shorten(s, 30)} is outside the float64 range")
    return f


def _lone_surrogate(root: Any) -> bool:
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, str):
            if LONE_SURROGATE.search(obj):
                return True
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if LONE_SURROGATE.search(k):
                    return True
                stack.append(v)
        elif isinstance(obj, list):
            stack.extend(obj)
    return False


def loads_json(data: "bytes | bytearray | memoryview | str", kind: JsonKind, *, file: str | None = None,
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """Rules 2-5 on JSON already in memory (``file`` names it in errors)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > kind.max_bytes:
        raise _fail(kind, file, f"expected at most {kind.max_bytes} bytes, found {len(raw)}")
    check_structure(raw, kind, file)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _fail(kind, file, f"expected UTF-8 text, found an invalid byte at offset {e.start}") from None
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    exponent = b"e" in raw.translate(_LOWER_E)  # only then can a float overflow (the digit cap bounds the rest)
    del raw
    try:
        if kind.nonfinite:
            value = json.loads(text, object_pairs_hook=object_pairs_hook)
        else:
            value = json.loads(text, object_pairs_hook=object_pairs_hook, parse_constant=_parse_constant,
                               parse_float=_parse_float if exponent else None)
    except json.JSONDecodeError as e:
        raise _fail(kind, file, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise _too_deep(kind, file) from None
    except MemoryError:
        raise _fail(kind, file, "out of memory while parsing the JSON") from None
    except (ValueError, OverflowError) as e:
        raise _fail(kind, file, f"not valid JSON: {shorten(str(e), 120)}") from None
    if _deeper_than(value, kind.max_depth, subclasses=object_pairs_hook is not None):
        raise _too_deep(kind, file)
    if surrogates and _lone_surrogate(value):
        raise _fail(kind, file, "expected text, found a string with an unpaired UTF-16 surrogate escape")
    return value


def read_bounded(path: "str | os.PathLike", kind: JsonKind) -> bytes:
    """Rules 1-2: the bytes of a regular file of at most ``kind.max_bytes`` bytes."""
    p = os.fspath(path)
    st = stat_regular(p)
    if st.st_size > kind.max_bytes:
        raise _fail(kind, p, f"expected at most {kind.max_bytes} bytes, found {st.st_size}")
    try:
        with open_regular(p) as f:
            raw = f.read(min(st.st_size, kind.max_bytes) + 1)  # never allocate by the cap
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot read {kind.what}: {e.strerror or e}", file=p) from None
    except MemoryError:
        raise _fail(kind, p, "out of memory while reading the file") from None
    if len(raw) > kind.max_bytes:
        raise _fail(kind, p, f"expected at most {kind.max_bytes} bytes, found more (the file grew?)")
    return raw


def load_json(path: "str | os.PathLike", kind: JsonKind, *,
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """The parsed JSON of the file at ``path`` under ``kind``'s limits (rules 1-5 of the module docstring)."""
    p = os.fspath(path)
    return loads_json(read_bounded(p, kind), kind, file=p, object_pairs_hook=object_pairs_hook)


# ---------------------------------------------------------------------------------------------------- shapes

def _is_integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (isinstance(v, int) or math.isfinite(v)))


TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": _is_integer,
    "number": _is_number,            # finite int or float, not a boolean
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
"""The type names ``expect`` understands (JSON's, with "number" finite and "integer" not a boolean)."""


def _types(want: "str | tuple[str, ...]") -> tuple[str, ...]:
    names = (want,) if isinstance(want, str) else tuple(want)
    for n in names:
        if n not in TYPES:
            raise KeyError(f"unknown JSON type name {n!r}")  # a programming error, not a file problem
    return names


def _matches(v: Any, names: tuple[str, ...]) -> bool:
    return any(TYPES[n](v) for n in names)


def _found(v: Any) -> str:
    t = json_type(v)
    return t if isinstance(v, (dict, list)) else f"{t} {json_repr(v, 40)}"


def expect(value: Any, want: "str | tuple[str, ...]", kind: JsonKind, *, file: str | None = None,
           where: str = "the top level") -> Any:
    """``value`` if it is of type ``want`` (a name of ``TYPES`` or a tuple of them), else ``kind.code`` naming
    the file and ``where`` (the key path)."""
    names = _types(want)
    if not _matches(value, names):
        raise _fail(kind, file, f"{where}: expected {' or '.join(names)}, found {_found(value)}")
    return value


def expect_list_of(value: Any, item: "str | tuple[str, ...]", kind: JsonKind, *, file: str | None = None,
                   where: str = "the top level") -> list:
    """A list whose every item is of type ``item``; the first bad item is named by its index."""
    expect(value, "array", kind, file=file, where=where)
    names = _types(item)
    for i, v in enumerate(value):
        if not _matches(v, names):
            raise _fail(kind, file, f"{where}[{i}]: expected {' or '.join(names)}, found {_found(v)}")
    return value


def expect_dict_of(value: Any, item: "str | tuple[str, ...]", kind: JsonKind, *, file: str | None = None,
                   where: str = "the top level") -> dict:
    """An object whose every value is of type ``item`` (keys are strings in JSON); the first bad one is named by
    its key."""
    expect(value, "object", kind, file=file, where=where)
    names = _types(item)
    for k, v in value.items():
        if not _matches(v, names):
            raise _fail(kind, file, f"{where}[{json_repr(k, 40)}]: expected {' or '.join(names)}, found "
                                    f"{_found(v)}")
    return value
