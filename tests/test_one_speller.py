"""The layout table is the only speller of slot names (issue 13).

Walks the source of ``exl2fmt/``, ``converters/`` and ``kernels/`` and fails when a string literal spells a
slot name of the layout table (``exl2fmt.layout.ALL_LAYOUTS``: the decoded EXL2 / GPTQ / dense / EXL3 layouts and
the recognised-only AWQ ones) anywhere but ``exl2fmt/layout.py``.  Other modules name a slot through
the per-format enums (``Exl2Slot.Q_WEIGHT``, ``f"{key}.{GptqSlot.QZEROS}"``) or lookups derived from the
table (``marker_slot``, ``slot_names``).

What counts as a spelling:

* a literal equal to a slot name (``"q_weight"``), or ending in ``.<slot name>`` - a tensor-name fragment,
  including the constant parts of an f-string (``f"{key}.q_groups"``);
* docstrings are prose and do not count; neither does a slot name inside a longer message
  (``"q_weight must be 2-D"``): that is text for people, and the test would otherwise police grammar.

Generic names:

* ``weight`` and ``bias`` are not checked.  Hugging Face names the parameters of every module so (norms,
  embeddings, ``lm_head``), and the converters copy those tensors by name; a literal ``"weight"`` says
  nothing about the layout table.  The layer classes still name them through ``DenseSlot`` / ``Exl2Slot``.
  ``scale`` (EXL3's refused legacy slot) likewise: GGUF metadata keys such as ``attention.scale`` end in it.
* ``su`` as a whole literal is not checked: it is also the rope-scaling type of Phi-3 (LongRoPE) in
  ``config.json``.  Its tensor form ``".su"`` is checked.

Golden vectors and ``spec/`` are outside the walked folders.  ``PENDING`` lists the modules of the parallel
issue-13 work that are still being rewritten; it has no other use.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from exl2fmt.layout import ALL_LAYOUTS

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("exl2fmt", "converters", "kernels")
SPELLER = "exl2fmt/layout.py"

#: Modules allowed to spell slot names while a move is under way; empty, and it may only stay so.
PENDING: set[str] = set()

#: Names that are also ordinary words of other vocabularies (see the module docstring).
NOT_CHECKED = frozenset({"weight", "bias", "scale"})
WHOLE_LITERAL_NOT_CHECKED = frozenset({"su"})

SLOT_NAMES = frozenset(str(s.name) for slots in ALL_LAYOUTS.values() for s in slots) - NOT_CHECKED
_DOTTED = re.compile(r"\.(%s)$" % "|".join(sorted(map(re.escape, SLOT_NAMES))))


def spellings(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every slot-name spelling in ``source`` (docstrings skipped)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in docstrings:
            continue
        v = node.value
        if (v in SLOT_NAMES and v not in WHOLE_LITERAL_NOT_CHECKED) or _DOTTED.search(v):
            out.append((node.lineno, v))
    return sorted(out)


def _pending(rel: str) -> bool:
    return any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in PENDING)


def _sources():
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), p


def test_the_finder_finds_spellings():
    """The checker itself: literals and dotted f-string parts count, docstrings and prose do not."""
    src = '''
def f(t, key):
    """Reads t["q_weight"] and the qzeros."""
    a = t["q_weight"]
    b = f"{key}.qzeros"
    c = "q_weight must be 2-D"
    d = {"weight": 1, "bias": 2}
    e = kind in ("su", "longrope")
    g = f"{key}.su"
    return t.get("g_idx"), key + ".trellis"
'''
    assert spellings(src) == [(4, "q_weight"), (5, ".qzeros"), (9, ".su"), (10, ".trellis"), (10, "g_idx")]


def test_slot_names_are_spelled_only_by_the_layout_table():
    found = {}
    for rel, p in _sources():
        if rel == SPELLER or _pending(rel):
            continue
        hits = spellings(p.read_text(encoding="utf-8"))
        if hits:
            found[rel] = hits
    assert not found, "slot names spelled outside exl2fmt/layout.py (use the layout enums): " + "; ".join(
        f"{rel}:{line} {lit!r}" for rel, hits in found.items() for line, lit in hits)


def test_pending_entries_are_still_needed():
    """The allowlist only shrinks: every PENDING entry that exists (a module, or a package as a whole) still
    spells a slot name."""
    clean = []
    for e in sorted(PENDING):
        files = [p for rel, p in _sources() if rel == e or (e.endswith("/") and rel.startswith(e))]
        if files and not any(spellings(p.read_text(encoding="utf-8")) for p in files):
            clean.append(e)
    assert not clean, f"no longer spell a slot name, remove from PENDING: {clean}"
