"""Build the text corpus the quantizer ships (exl2fmt/quant/data/): English prose from the running CPython.

Sources, both part of CPython and under the PSF License (see exl2fmt/quant/data/README.md):

* ``pydoc_data.topics`` -- the Python Language Reference sections ``help()`` shows (plain text);
* the docstrings of the standard library: every module in ``sys.stdlib_module_names`` that imports cleanly,
  its module docstring and the docstrings of its public classes, functions and methods.

Each source text is one *document*.  Documents are cleaned (doctest paragraphs dropped, whitespace normalised),
short ones (< 160 characters) and exact duplicates dropped, and sorted by their id (``topic:<name>`` or
``<module>:<qualname>``).  Each is assigned to a part by the SHA-256 of its id::

    h = int(sha256(id)[:8], 16) % 100
    h < 10  -> eval   (held out: perplexity / KL of quantized models)
    h < 30  -> calib  (the default calibration text)
    else    -> train  (the fixture model's training text)

so the split does not depend on the order or number of documents.  Each part is written as UTF-8 text, documents
separated by two blank lines (paragraphs inside a document by one), compressed with xz (preset 9, deterministic).

Usage:  python bench/make_corpus.py [--out exl2fmt/quant/data] [--max-mb 2.5]
Rerunning with the same Python version gives the same bytes; a different version gives a different corpus
(the interpreter version is recorded in manifest.json).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import lzma
import pkgutil
import re
import sys
import sysconfig
import warnings
from pathlib import Path

# modules with side effects on import (browser, GUI, printing, interpreter internals) or that are test suites
SKIP = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "test", "ensurepip",
    "lib2to3", "pydoc_data", "xxsubtype", "xxlimited", "_xxtestfuzz", "msvcrt", "winreg", "winsound", "_winapi",
    "nt", "_msi", "msilib", "_overlapped", "_testcapi", "_testinternalcapi", "_tkinter", "_ctypes_test",
}

MIN_CHARS = 160
SPLIT = (("eval", 10), ("calib", 30), ("train", 100))


def clean(text: str) -> str:
    """Drop doctest paragraphs and normalise whitespace (keep paragraph breaks)."""
    paras = re.split(r"\n\s*\n", inspect.cleandoc(text))
    keep = []
    for p in paras:
        lines = [ln.rstrip() for ln in p.splitlines()]
        if any(ln.lstrip().startswith((">>>", "...")) for ln in lines):
            continue
        p = "\n".join(lines).strip()
        if p:
            keep.append(p)
    return "\n\n".join(keep)


def part_of(doc_id: str) -> str:
    h = int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % 100
    for name, limit in SPLIT:
        if h < limit:
            return name
    raise AssertionError


def topic_docs() -> dict[str, str]:
    import pydoc_data.topics as t

    return {f"topic:{k}": v for k, v in t.topics.items()}


def _members(obj, prefix: str, depth: int, out: dict[str, str], seen: set[int], modname: str) -> None:
    for name, val in sorted(vars(obj).items(), key=lambda kv: kv[0]):
        if name.startswith("_"):
            continue
        if isinstance(val, (staticmethod, classmethod)):
            val = val.__func__
        if not (inspect.isclass(val) or inspect.isfunction(val) or inspect.isbuiltin(val)
                or inspect.ismethoddescriptor(val)):
            continue
        owner = getattr(val, "__module__", None)
        if inspect.isclass(obj) is False and owner not in (None, modname):
            continue   # re-exported from another module: documented there
        if id(val) in seen:
            continue
        seen.add(id(val))
        doc = val.__doc__ if isinstance(getattr(val, "__doc__", None), str) else None
        if doc:
            out[f"{modname}:{prefix}{name}"] = doc
        if inspect.isclass(val) and depth == 0:
            _members(val, f"{prefix}{name}.", 1, out, seen, modname)


def stdlib_docs() -> dict[str, str]:
    out: dict[str, str] = {}
    names = sorted(n for n in sys.stdlib_module_names if n not in SKIP and not n.startswith("_"))
    todo = list(reversed(names))
    done: set[str] = set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
                _members(mod, "", 0, out, set(), name)
        except BaseException:  # noqa: BLE001 - platform modules may fail in any way; skip them
            continue
        if isinstance(mod.__doc__, str):
            out[f"{name}:"] = mod.__doc__
        if hasattr(mod, "__path__"):   # a package: its public submodules too (test packages excluded)
            subs = sorted(f"{name}.{m.name}" for m in pkgutil.iter_modules(mod.__path__)
                          if not m.name.startswith("_") and "test" not in m.name and m.name not in SKIP)
            todo.extend(reversed(subs))
    return out


def build(max_chars: int) -> tuple[dict[str, list[str]], dict]:
    raw = {**topic_docs(), **stdlib_docs()}
    docs: dict[str, str] = {}
    seen: set[str] = set()
    for doc_id in sorted(raw):
        text = clean(raw[doc_id])
        if len(text) < MIN_CHARS or text in seen:
            continue
        seen.add(text)
        docs[doc_id] = text
    # keep the whole corpus under max_chars: drop the longest-id-hash documents first (deterministic)
    total = sum(len(t) for t in docs.values())
    if total > max_chars:
        order = sorted(docs, key=lambda d: hashlib.sha256(d.encode()).hexdigest())
        kept, acc = set(), 0
        for d in order:
            if acc + len(docs[d]) > max_chars:
                continue
            kept.add(d)
            acc += len(docs[d])
        docs = {d: t for d, t in docs.items() if d in kept}
    parts: dict[str, list[str]] = {name: [] for name, _ in SPLIT}
    ids: dict[str, int] = {name: 0 for name, _ in SPLIT}
    for doc_id in sorted(docs):
        p = part_of(doc_id)
        parts[p].append(docs[doc_id])
        ids[p] += 1
    manifest = {
        "python": sys.version.split()[0],
        "documents": ids,
        "chars": {p: sum(len(t) + 3 for t in v) for p, v in parts.items()},
        "split": "sha256(document id)[:8] as int % 100: <10 eval, <30 calib, else train",
        "min_chars": MIN_CHARS,
    }
    return parts, manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "exl2fmt" / "quant" / "data"))
    ap.add_argument("--max-mb", type=float, default=2.5, help="cap on the uncompressed corpus, in MB")
    args = ap.parse_args()
    parts, manifest = build(int(args.max_mb * 1_000_000))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in parts.items():
        data = ("\n\n\n".join(docs) + "\n").encode("utf-8")
        comp = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9)
        (out / f"{name}.txt.xz").write_bytes(comp)
        manifest.setdefault("sha256", {})[name] = hashlib.sha256(data).hexdigest()
        print(f"{name}: {len(docs)} documents, {len(data)} bytes ({len(comp)} compressed)")
    lic = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if lic.is_file():   # the text is derived from CPython: ship its license with it
        (out / "LICENSE-PSF.txt").write_bytes(lic.read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
