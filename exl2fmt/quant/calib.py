"""Calibration data for the quantizer: token ids int64 [rows, length].

Sources (``load_calibration``):

* ``.txt``   UTF-8 text, tokenized as a whole (in line-aligned chunks of about 1 MB, so a huge file is only read
             as far as needed);
* ``.jsonl`` one JSON object per line with a string field ``text`` (blank lines skipped); the texts are
             tokenized one by one and concatenated;
* token ids, used as given (no tokenizer needed): ``.npy`` (integer array), ``.safetensors`` (an integer tensor
             ``input_ids``) or ``.json`` (a list of lists of ints, or one flat list).  A 2-D array / list of
             lists is a list of rows: the first ``rows`` rows holding at least ``length`` ids are used, cut to
             ``length``.  A flat array is one token stream;
* ``None``   the built-in set: the shipped calibration text (``data/calib.txt.xz``, then ``data/train.txt.xz``
             if more is needed), its documents shuffled by ``seed``, followed by a few rows of uniformly random
             token ids drawn from a generator seeded by ``seed``.  (ExLlamaV2 draws its random rows unseeded;
             here the same seed always gives the same ids.)

Text becomes one token stream (no BOS/EOS inserted); the first ``rows * length`` tokens are reshaped row-major
to ``[rows, length]``, as ExLlamaV2 does with a custom dataset.  Texts are tokenized with the model's own
``tokenizer.json`` through the ``tokenizers`` package.

Every problem is an ``Exl2Error``: ``PATH_NOT_FOUND`` (no such file, no tokenizer.json), ``IO_ERROR`` (a FIFO,
device or directory: never opened blocking), ``CALIBRATION_INVALID`` (unknown extension, undecodable text, a bad
JSON line -- with its line number --, a line longer than 64 MiB, ids of the wrong type or sign, fewer tokens or
rows than needed -- with the counts found and needed).

Nothing is sized by a number from the file: JSON (token ids, ``.jsonl`` lines, tokenizer.json) goes through the
guarded loader (``exl2fmt.container.jsonload``: byte, value-count and depth caps); a ``.npy`` header is read and
its shape x dtype checked against the file's size before the data is memory-mapped (no pickles); a
``.safetensors`` file through the container reader; and only the rows and columns that are used are ever copied.
"""

from __future__ import annotations

import lzma
import os
import random
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..container import jsonload
from ..container.parse import json_type
from ..container.regular import open_regular, stat_regular
from ..errors import ErrorCode, Exl2Error

__all__ = ["load_calibration", "load_tokenizer", "corpus_text", "corpus_documents", "tokenize_stream",
           "default_random_rows", "DATA_DIR", "TEXT_SUFFIXES", "ID_SUFFIXES"]

DATA_DIR = Path(__file__).resolve().parent / "data"
TEXT_SUFFIXES = (".txt", ".jsonl")
ID_SUFFIXES = (".npy", ".safetensors", ".json")
_CHUNK_CHARS = 1 << 20
_MAX_LINE_BYTES = 64 << 20  # one line of .txt / .jsonl (a line is decoded whole)
_MAX_NPY_HEADER = 10_000    # numpy's own default cap on a .npy header


def _err(msg: str, path: "str | os.PathLike | None" = None, code: ErrorCode = ErrorCode.CALIBRATION_INVALID
         ) -> Exl2Error:
    return Exl2Error(code, msg, file=None if path is None else str(path))


# ------------------------------------------------------------------------------------------------------
# shipped corpus
# ------------------------------------------------------------------------------------------------------

def corpus_text(part: str) -> str:
    """One part of the shipped corpus (``train``, ``calib`` or ``eval``) as a str (see data/README.md)."""
    if part not in ("train", "calib", "eval"):
        raise _err(f"corpus part must be train, calib or eval, found {part!r}", code=ErrorCode.USAGE)
    path = DATA_DIR / f"{part}.txt.xz"
    if not path.is_file():
        raise _err("the shipped corpus file is missing (broken install?)", path, ErrorCode.PATH_NOT_FOUND)
    return lzma.decompress(path.read_bytes()).decode("utf-8")


def corpus_documents(part: str) -> list[str]:
    """The documents of a corpus part in stored order (documents are separated by two blank lines, paragraphs
    inside a document by one)."""
    return [d.strip("\n") for d in corpus_text(part).split("\n\n\n") if d.strip()]


# ------------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------------

def load_tokenizer(path: "str | os.PathLike | None"):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file or a model directory holding one."""
    if path is None:
        raise _err("text calibration needs the model's tokenizer.json, and none was given",
                   code=ErrorCode.PATH_NOT_FOUND)
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not os.path.lexists(p):
        raise _err("text calibration needs the model's tokenizer.json, found none", p, ErrorCode.PATH_NOT_FOUND)
    # a FIFO / device is IO_ERROR, a huge or absurdly nested file CALIBRATION_INVALID, before the Rust parser
    raw = jsonload.read_bounded(p, jsonload.TOKENIZER)
    jsonload.check_structure(raw, jsonload.TOKENIZER, str(p))
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _err(f"tokenizer.json is not UTF-8 (invalid byte at offset {e.start})", p) from None
    del raw
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - part of the quant extra
        raise _err("the tokenizers package is needed: pip install 'exl2fmt[quant]'", code=ErrorCode.USAGE) from None
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions with its parser message
        raise _err(f"tokenizer.json could not be loaded: {str(e)[:200]}", p) from None


def tokenize_stream(tokenizer, texts: Iterable[str], needed: int | None = None) -> list[int]:
    """Token ids of ``texts`` concatenated (no special tokens added); stops once ``needed`` ids are collected."""
    out: list[int] = []
    batch: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
                out.extend(enc.ids)
        batch, size = [], 0

    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= _CHUNK_CHARS:
            flush()
            if needed is not None and len(out) >= needed:
                return out
    flush()
    return out


# ------------------------------------------------------------------------------------------------------
# readers
# ------------------------------------------------------------------------------------------------------

def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, decoded line with its end) -- decoded line by line so an invalid byte is reported
    at its line."""
    try:
        f = open_regular(str(path))
    except OSError as e:
        raise _err(f"cannot read the file: {e.strerror}", path, ErrorCode.IO_ERROR) from None
    with f:
        n = 0
        while True:
            try:
                raw = f.readline(_MAX_LINE_BYTES + 1)
            except OSError as e:
                raise _err(f"cannot read the file: {e.strerror}", path, ErrorCode.IO_ERROR) from None
            if not raw:
                return
            n += 1
            if len(raw) > _MAX_LINE_BYTES:
                raise _err(f"line {n}: longer than {_MAX_LINE_BYTES} bytes (the cap on one line)", path)
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _err(f"line {n}: the text is not valid UTF-8 ({e.reason} at byte {e.start} of the line)",
                           path) from None


def _txt_chunks(path: Path) -> Iterator[str]:
    """The file's text in pieces of about _CHUNK_CHARS characters, each ending at a line end."""
    buf: list[str] = []
    size = 0
    for _, line in _lines(path):
        buf.append(line)
        size += len(line)
        if size >= _CHUNK_CHARS:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


def _jsonl_texts(path: Path, field: str = "text") -> Iterator[str]:
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = jsonload.loads_json(line, jsonload.CALIBRATION_LINE, file=str(path))
        except Exl2Error as e:
            raise _err(f"line {n}: {e.message.split(': ', 1)[-1]}", path) from None
        if not isinstance(obj, dict):
            raise _err(f"line {n}: expected a JSON object with a {field!r} field, found {json_type(obj)}", path)
        text = obj.get(field)
        if not isinstance(text, str):
            found = "none" if field not in obj else type(text).__name__
            raise _err(f"line {n}: expected a string field {field!r}, found {found}", path)
        yield text


def _check_ids(arr: np.ndarray, path: Path) -> np.ndarray:
    if arr.dtype.kind not in "iu":
        raise _err(f"token ids must be integers, found dtype {arr.dtype}", path)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**31):
        raise _err(f"token ids must lie in 0..2**31-1, found {int(arr.min())}..{int(arr.max())}", path)
    return arr.astype(np.int64)


def _npy(path: Path, f) -> np.ndarray:
    """The array of an open .npy file as a read-only memory map, after its header's shape x dtype was checked
    against the file's size (a 128-byte file declaring 10**7 rows is refused here, before anything is built)."""
    fmt = np.lib.format
    size = os.fstat(f.fileno()).st_size
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f, max_header_size=_MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f, max_header_size=_MAX_NPY_HEADER)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]} is not read (1.0 and 2.0 are)")
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, EOFError, OSError) as e:
        raise _err(f"not a readable .npy array: {str(e)[:200]}", path) from None
    if dtype.hasobject or dtype.kind not in "iu":
        raise _err(f"token ids must be integers, found dtype {dtype}", path)
    if len(shape) not in (1, 2) or any(d < 0 for d in shape):
        raise _err(f"token ids must be 1-D or 2-D, found shape {list(shape)}", path)
    offset = f.tell()
    n = 1
    for d in shape:
        n *= d
    if n * dtype.itemsize != size - offset:
        raise _err(f"the header declares shape {list(shape)} of {dtype} ({n * dtype.itemsize} bytes), the file "
                   f"holds {size - offset} bytes of data", path)
    if n == 0:
        return np.zeros(tuple(shape), dtype)
    return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=tuple(shape), order="F" if fortran else "C")


def _ids_from_array(arr: np.ndarray, rows: int, length: int, path: Path) -> np.ndarray:
    """[rows, length] int64 from a 1-D stream or a 2-D array of rows; only that part is read and copied."""
    if arr.dtype.kind not in "iu":
        raise _err(f"token ids must be integers, found dtype {arr.dtype}", path)
    if arr.ndim == 1:
        return _check_ids(_rows_from_stream(arr, rows, length, "the token-id stream", path, copy=False),
                          path)
    if arr.ndim != 2:
        raise _err(f"token ids must be 1-D or 2-D, found shape {list(arr.shape)}", path)
    n_rows, width = arr.shape
    usable = n_rows if width >= length else 0
    if usable < rows:
        raise _err(f"found {usable} rows of at least {length} token ids (of {n_rows} rows), {rows} are needed", path)
    return _check_ids(np.asarray(arr[:rows, :length]), path)


def _ids_from_json(value, rows: int, length: int, path: Path) -> np.ndarray:
    kind = jsonload.CALIBRATION_IDS
    if isinstance(value, list) and all(type(v) is int for v in value):
        if len(value) < rows * length:
            _rows_from_stream(value, rows, length, "the token-id stream", path)  # raises with the counts
        value = value[:rows * length]
        if any(v < 0 or v >= 2**31 for v in value):
            raise _err("token ids must lie in 0..2**31-1", path)
        return np.array(value, dtype=np.int64).reshape(rows, length)
    if not (isinstance(value, list) and all(isinstance(r, list) for r in value)):
        raise _err("expected a list of lists of token ids, or one flat list", path)
    usable = []
    for i, r in enumerate(value):
        try:
            jsonload.expect_list_of(r, "integer", kind, file=str(path), where=f"row {i}")
        except Exl2Error:
            raise _err(f"row {i}: expected a list of integer token ids", path) from None
        if any(v < 0 or v >= 2**31 for v in r):
            raise _err(f"row {i}: token ids must lie in 0..2**31-1", path)
        if len(r) >= length and len(usable) < rows:
            usable.append(r[:length])
    if len(usable) < rows:
        raise _err(f"found {len(usable)} rows of at least {length} token ids (of {len(value)} rows), "
                   f"{rows} are needed", path)
    return np.array(usable, dtype=np.int64)


def _read_ids(path: Path, rows: int, length: int) -> np.ndarray:
    """[rows, length] int64 token ids from a .npy / .safetensors / .json file."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        with open_regular(str(path)) as f:
            return _ids_from_array(_npy(path, f), rows, length, path)
    if suffix == ".safetensors":
        from ..container import SafetensorsFile

        with SafetensorsFile(path) as f:
            if "input_ids" not in f:
                raise _err(f"expected a tensor 'input_ids', found {sorted(f.names())[:8]}", path)
            return _ids_from_array(f.get("input_ids"), rows, length, path)
    value = jsonload.load_json(path, jsonload.CALIBRATION_IDS)
    return _ids_from_json(value, rows, length, path)


def _rows_from_stream(ids: "list[int] | np.ndarray", rows: int, length: int, what: str,
                      path: "Path | None", copy: bool = True) -> np.ndarray:
    need = rows * length
    if len(ids) < need:
        raise _err(f"{what} gives {len(ids)} tokens, {need} are needed for {rows} rows x {length} tokens "
                   "(use fewer --rows / a shorter --length, or more text)", path)
    if not copy:  # an integer array of any dtype, cut (a view) and shaped; _check_ids converts
        return np.asarray(ids[:need]).reshape(rows, length)
    return np.asarray(ids[:need], dtype=np.int64).reshape(rows, length)


def default_random_rows(rows: int) -> int:
    """How many of ``rows`` default calibration rows are uniformly random tokens: about 2 % (ExLlamaV2 uses 2 of
    115), at least one from 8 rows up, none below (so a tiny calibration set stays text)."""
    return 0 if rows < 8 else max(1, round(rows * 0.02))


def _default_rows(tokenizer, rows: int, length: int, seed: int, vocab_size: int | None) -> np.ndarray:
    n_rand = default_random_rows(rows)
    n_text = rows - n_rand
    need = n_text * length
    rng = random.Random(seed)
    ids: list[int] = []
    for part in ("calib", "train"):
        if len(ids) >= need:
            break
        units = corpus_documents(part)
        rng.shuffle(units)
        ids.extend(tokenize_stream(tokenizer, (u + "\n\n" for u in units), need - len(ids)))
    text = _rows_from_stream(ids, n_text, length, "the built-in calibration text", None)
    vocab = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
    g = np.random.Generator(np.random.PCG64(seed))
    noise = g.integers(0, vocab, size=(n_rand, length), dtype=np.int64)
    return np.concatenate([text, noise], axis=0)


# ------------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------------

def load_calibration(path: "str | os.PathLike | None", tokenizer_json: "str | os.PathLike | None", rows: int,
                     length: int, seed: int = 0, *, vocab_size: int | None = None):
    """Calibration token ids: torch.LongTensor [rows, length], row-major token stream (see the module docstring).

    ``path``            a .txt / .jsonl / .npy / .safetensors / .json file, or None for the built-in set
    ``tokenizer_json``  the model's tokenizer.json (or its directory); needed for text, ignored for token ids
    ``seed``            shuffles the built-in text and draws its random rows; user files are used in order
    ``vocab_size``      upper bound (exclusive) for the built-in random rows; default: the tokenizer's size
    """
    import torch

    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise _err(f"rows must be a positive integer, found {rows!r}", code=ErrorCode.USAGE)
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise _err(f"length must be a positive integer, found {length!r}", code=ErrorCode.USAGE)
    if path is None:
        out = _default_rows(load_tokenizer(tokenizer_json), rows, length, seed, vocab_size)
        return torch.from_numpy(out)

    p = Path(path)
    if not os.path.lexists(p):
        raise _err("the calibration file does not exist", p, ErrorCode.PATH_NOT_FOUND)
    stat_regular(str(p))  # a FIFO, device or directory: IO_ERROR, never opened
    suffix = p.suffix.lower()
    need = rows * length
    if suffix in TEXT_SUFFIXES:
        tok = load_tokenizer(tokenizer_json)
        texts = _txt_chunks(p) if suffix == ".txt" else _jsonl_texts(p)
        ids = tokenize_stream(tok, texts, need)
        return torch.from_numpy(_rows_from_stream(ids, rows, length, "the calibration text", p))
    if suffix in ID_SUFFIXES:
        return torch.from_numpy(_read_ids(p, rows, length))
    raise _err(f"unknown calibration file type {suffix or '(none)'!r}: expected one of "
               f"{', '.join(TEXT_SUFFIXES + ID_SUFFIXES)}", p)
