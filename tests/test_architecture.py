"""The house rules of the package, checked on the source (no import is executed): no import cycle, no private name
crossing a module boundary, and arrows that point one way (spec/architecture.md):

    core  <-  formats  <-  runner  <-  checks (inspect, validate, ...)  <-  converters / quant  <-  runtime  <-  CLI
    kernels import the layout only

The graph is built from the AST of every module of ``exl2fmt/``, ``converters/`` (importable as
``exl2fmt.converters``) and ``kernels/`` (``exl2fmt.kernels``; pyproject's package-dir): module-level and
function-level imports, absolute and relative, ``TYPE_CHECKING`` blocks included.  ``from pkg import name`` is an
arrow to the submodule ``pkg.name`` when that module exists, else to ``pkg``.  The lazy re-export tables of the
package roots (``_LAZY``: names resolved on first attribute access) are facades, not arrows; ``test_api`` checks
that they resolve.

Issue 38 adds the rooms' rules: no import circle between folders (``exl2fmt.<package>`` or a top-level module,
``converters``, ``kernels``), ``SEPARATE_ROOMS`` that never import each other, no module over
``MAX_MODULE_LINES`` and no function body over ``MAX_FUNCTION_LINES`` (a CLI command's signature is its option
table and is not counted).

``PENDING`` lists today's violations that the other parts of issue 13 remove (they are excused here until then);
emptied by the lead at merge.  ``test_pending_entries_are_still_real`` fails on an entry that no longer exists.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import name of a package -> its folder, as pyproject.toml's package-dir maps them (converters/ and kernels/
#: are installed as exl2fmt.converters and exl2fmt.kernels)
tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PACKAGES = {name: ROOT / folder for name, folder in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}

#: Tiers, lowest first; a module may import its own tier and the tiers below.  Longest prefix wins; every module
#: must match one entry (a new module gets a place in this table and in spec/architecture.md).
TIERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("exl2fmt", "exl2fmt.errors", "exl2fmt.layout", "exl2fmt.groups", "exl2fmt.codec", "exl2fmt.container",
              "exl2fmt.config_values", "exl2fmt.arch", "exl2fmt.detect", "exl2fmt.gguf_scan", "exl2fmt._stats",
              "exl2fmt.extras", "exl2fmt.jitnote", "exl2fmt.outputs", "exl2fmt.names")),
    # one module per storage format, the layer loader, the kernels
    ("formats", ("exl2fmt.formats", "exl2fmt.model", "exl2fmt.kernels")),
    # the model runner that the quantizer's calibration, validate --run and the perplexity report all drive
    # (transformers' modeling code over weights read through the core: the model, its layers, MoE, weight source)
    ("runner", ("exl2fmt.runner",)),
    ("checks", ("exl2fmt.inspect", "exl2fmt.validate", "exl2fmt.hub", "exl2fmt.modelcard", "exl2fmt.sample")),
    ("converters/quant", ("exl2fmt.converters", "exl2fmt.quant", "exl2fmt.runtime", "exl2fmt.hf")),
    ("cli", ("exl2fmt.cli",)),
]
#: what the kernels may import besides themselves: the layout (layout.py and its q_groups table)
KERNEL_ALLOWED = ("exl2fmt.layout", "exl2fmt.groups")

#: Known violations owned by the other helpers of issue 13 - emptied by the lead at merge.
PENDING_EDGES: dict[tuple[str, str], str] = {}
PENDING_PRIVATE: dict[tuple[str, str, str], str] = {}


# ------------------------------------------------------------------------------------------------ the graph


@dataclass(frozen=True)
class PrivateUse:
    module: str      # the importing module
    line: int
    target: str      # the module the name belongs to
    name: str


@dataclass
class Graph:
    modules: dict[str, Path]                                         # module name -> file
    edges: dict[str, dict[str, int]] = field(default_factory=dict)   # importer -> {imported: first line}
    private: list[PrivateUse] = field(default_factory=list)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def build_graph(packages: dict[str, Path]) -> Graph:
    """The import graph of the modules below ``packages`` ({import name: folder}; a folder nested in another
    package's folder belongs to the package that names it)."""
    roots = {Path(d).resolve(): name for name, d in packages.items()}
    modules: dict[str, Path] = {}
    is_pkg: dict[str, bool] = {}
    for name, d in packages.items():
        d = Path(d).resolve()
        for f in sorted(d.rglob("*.py")):
            owner = next(p for p in [f.parent, *f.parent.parents] if p in roots)
            if roots[owner] != name:
                continue  # e.g. converters/ inside exl2fmt/ would belong to its own package
            parts = list(f.relative_to(d).with_suffix("").parts)
            pkg = parts[-1] == "__init__"
            if pkg:
                parts = parts[:-1]
            mod = ".".join([name, *parts])
            modules[mod] = f
            is_pkg[mod] = pkg
    g = Graph(modules)

    def owner_of(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for mod, f in modules.items():
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        here = mod if is_pkg[mod] else mod.rpartition(".")[0]
        out = g.edges.setdefault(mod, {})
        aliases: dict[str, str] = {}  # local name -> in-tree module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    t = owner_of(a.name)
                    if t is not None:
                        out.setdefault(t, node.lineno)
                        if a.asname:
                            aliases[a.asname] = t
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                if owner_of(src) is None:
                    continue
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    if sub in modules:
                        out.setdefault(sub, node.lineno)
                        aliases[a.asname or a.name] = sub
                        continue
                    t = owner_of(src)
                    out.setdefault(t, node.lineno)
                    if _is_private(a.name) and t != mod:
                        g.private.append(PrivateUse(mod, node.lineno, t, a.name))
        for node in ast.walk(tree):  # module._private through an imported module object
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _is_private(node.attr) and aliases[node.value.id] != mod):
                g.private.append(PrivateUse(mod, node.lineno, aliases[node.value.id], node.attr))
        out.pop(mod, None)
    return g


def find_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module: [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:  # Tarjan, iteratively (no recursion limit on a deep graph)
        nonlocal counter
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    circles = []
    for comp in comps:  # a shortest circle through the component's first module (BFS inside the component)
        members = set(comp)
        start = comp[0]
        prev: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(edges.get(v, ())):
                    if w not in members:
                        continue
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        circles.append([*reversed(path), start])
    return circles


def tier_of(module: str) -> int | None:
    best, tier = -1, None
    for i, (_, prefixes) in enumerate(TIERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, tier = len(p), i
    return tier


def _without_pending(edges: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {a: {b: n for b, n in out.items() if (a, b) not in PENDING_EDGES} for a, out in edges.items()}


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(PACKAGES)


def _where(g: Graph, a: str, b: str) -> str:
    return f"{a} -> {b} ({g.modules[a].relative_to(ROOT)}:{g.edges[a][b]})"


# ------------------------------------------------------------------------------------------------ the rules


def test_no_import_cycles(graph):
    circles = find_cycles(_without_pending(graph.edges))
    text = ["  " + "  ".join(_where(graph, a, b) for a, b in zip(c, c[1:])) for c in circles]
    assert not circles, "import cycles:\n" + "\n".join(text)


def test_no_private_name_crosses_a_module_boundary(graph):
    bad = [u for u in graph.private if (u.module, u.target, u.name) not in PENDING_PRIVATE]
    assert not bad, "private names used across modules:\n" + "\n".join(
        f"  {u.module}:{u.line} uses {u.target}.{u.name}" for u in bad)


def test_every_module_has_a_tier(graph):
    assert {"exl2fmt.converters.base", "exl2fmt.kernels.exl2_triton", "exl2fmt.validate.run"} <= set(graph.modules)
    assert [m for m in graph.modules if tier_of(m) is None] == []


def test_arrows_point_down(graph):
    bad = []
    for a, out in _without_pending(graph.edges).items():
        for b in out:
            ta, tb = tier_of(a), tier_of(b)
            if ta is not None and tb is not None and tb > ta:
                bad.append(f"  {_where(graph, a, b)}: {TIERS[ta][0]} imports {TIERS[tb][0]}")
    assert not bad, "arrows pointing up:\n" + "\n".join(bad)


def test_kernels_import_the_layout_only(graph):
    bad = [_where(graph, a, b) for a, out in graph.edges.items() if a.startswith("exl2fmt.kernels")
           for b in out if not b.startswith("exl2fmt.kernels") and b not in KERNEL_ALLOWED]
    assert not bad, "\n".join(bad)


def test_pending_entries_are_still_real(graph):
    """An entry whose violation is gone must leave PENDING (so that it cannot hide a new one)."""
    gone = [e for e in PENDING_EDGES if e[1] not in graph.edges.get(e[0], {})]
    have = {(u.module, u.target, u.name) for u in graph.private}
    gone += [e for e in PENDING_PRIVATE if e not in have]
    assert gone == [], f"fixed, remove from PENDING: {gone}"


# ------------------------------------------------------------------------------------------------ the checker itself


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_checker_finds_a_planted_cycle_and_private_import(tmp_path):
    _write(tmp_path, {
        "toy/__init__.py": "",
        "toy/a.py": "def f():\n    from . import b  # function-level\n    return b\n",
        "toy/b.py": "from toy.sub.c import helper\n",
        "toy/sub/__init__.py": "",
        "toy/sub/c.py": "from ..a import f\n\ndef helper():\n    return f\n",
        "toy/d.py": "from .b import _hidden\nfrom . import a as A\nx = A._secret\n",
        "toy/e.py": "import os\nfrom .sub import c\n",
        "plug/__init__.py": "from toy import d\n",
    })
    g = build_graph({"toy": tmp_path / "toy", "toy.plug": tmp_path / "plug"})
    assert g.edges["toy.a"] == {"toy.b": 2}
    assert g.edges["toy.b"] == {"toy.sub.c": 1}
    assert g.edges["toy.sub.c"] == {"toy.a": 1}
    assert g.edges["toy.e"] == {"toy.sub.c": 2}
    assert g.edges["toy.plug"] == {"toy.d": 1}
    assert find_cycles(g.edges) == [["toy.a", "toy.b", "toy.sub.c", "toy.a"]]
    assert sorted((u.module, u.target, u.name) for u in g.private) == [
        ("toy.d", "toy.a", "_secret"), ("toy.d", "toy.b", "_hidden")]
    # breaking one arrow breaks the circle
    del g.edges["toy.b"]["toy.sub.c"]
    assert find_cycles(g.edges) == []


def test_every_package_folder_is_installed():
    """A wheel holds only the packages pyproject.toml lists: every folder with an ``__init__.py`` under a mapped
    package must be in ``packages`` and ``package-dir`` (an editable install would hide the omission)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    assert listed == set(setup["package-dir"]), sorted(listed ^ set(setup["package-dir"]))
    found = set()
    for name, folder in PACKAGES.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert found <= listed, f"package folders missing from pyproject.toml: {sorted(found - listed)}"


def test_the_kernels_folder_does_not_shadow_the_kernels_distribution():
    """``kernels/`` (installed as ``exl2fmt.kernels``) is also a top-level package when the checkout's root is on
    ``sys.path`` (``python -m pytest`` / ``python -c`` run from it).  transformers >= 5.25 requires Hugging Face's
    ``kernels`` distribution and imports it, so there the name must reach that package; without it installed,
    the folder itself is what ``import kernels`` finds."""
    import importlib.metadata
    import subprocess
    import sys

    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    p = subprocess.run([sys.executable, "-c", "import kernels, sys; print(kernels.__file__); "
                        "print(sys.modules['kernels'] is kernels)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    path, same = p.stdout.split()
    assert same == "True"
    ours = Path(path).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
    assert ours != installed, (path, installed)


# ------------------------------------------------------------------------------------------------ rooms (issue 38)

#: a module over this many lines is a room doing too much; split it by job
MAX_MODULE_LINES = 800
#: a function's body (from its first statement after the docstring: a CLI command's signature is its option table
#: and does not count) over this many lines does too much
MAX_FUNCTION_LINES = 150


def folder_of(module: str) -> str:
    """The room a module lives in: ``exl2fmt.<pkg>`` for a subpackage's modules (converters/ and kernels/ are
    ``exl2fmt.converters`` / ``exl2fmt.kernels``), the module itself for a top-level module of ``exl2fmt``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def folder_edges(edges: dict[str, dict[str, int]]) -> dict[str, dict[str, tuple[str, str, int]]]:
    """{folder: {other folder: (one importer, its import, line)}} for arrows that leave a folder."""
    out: dict[str, dict[str, tuple[str, str, int]]] = {}
    for a, targets in edges.items():
        for b, line in targets.items():
            fa, fb = folder_of(a), folder_of(b)
            if fa != fb:
                out.setdefault(fa, {}).setdefault(fb, (a, b, line))
    return out


def test_no_import_circle_between_folders(graph):
    fe = folder_edges(graph.edges)
    circles = find_cycles({a: {b: 0 for b in out} for a, out in fe.items()})
    text = []
    for c in circles:
        steps = [fe[a][b] for a, b in zip(c, c[1:])]
        text.append("  " + "  ".join(f"{a} -> {b} ({graph.modules[m].relative_to(ROOT)}:{n} imports {t})"
                                     for (a, b), (m, t, n) in zip(zip(c, c[1:]), steps)))
    assert not circles, "folders in a circle:\n" + "\n".join(text)


def test_no_module_over_the_size_limit(graph):
    big = {m: n for m, f in graph.modules.items()
           if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not big, "modules over %d lines: %s" % (MAX_MODULE_LINES, big)


def function_lengths(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(name, first line, body lines) of every function and method; the body starts after the docstring."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                body = body[1:]
            found.append((node.name, node.lineno, node.end_lineno - body[0].lineno + 1))
    return found


def test_no_function_over_the_size_limit(graph):
    long = [f"  {f.relative_to(ROOT)}:{line} {name}: {n} lines" for m, f in graph.modules.items()
            for name, line, n in function_lengths(ast.parse(f.read_text(encoding="utf-8")))
            if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_room_checks_find_a_planted_circle_and_a_long_function(tmp_path):
    _write(tmp_path, {
        "toy/__init__.py": "",
        "toy/top.py": "def f():\n    from .sub import c\n",
        "toy/sub/__init__.py": "",
        "toy/sub/c.py": "from ..other import x\n",
        "toy/other/__init__.py": "",
        "toy/other/x.py": "import toy.top\n",
        "toy/long.py": "def g(a,\n      b):\n    '''doc'''\n" + "    a += 1\n" * 151,
    })
    g = build_graph({"toy": tmp_path / "toy"})
    fe = folder_edges(g.edges)
    assert fe["toy.sub"]["toy.other"] == ("toy.sub.c", "toy.other.x", 1)
    assert find_cycles({a: {b: 0 for b in out} for a, out in fe.items()}) == [
        ["toy.other", "toy.top", "toy.sub", "toy.other"]]
    assert function_lengths(ast.parse((tmp_path / "toy/long.py").read_text())) == [("g", 1, 151)]


#: rooms that must not reach each other at all (in either direction where both are listed): the quantizer gets
#: the deep validation of its output from its caller (``quantize_model(verify_output=...)``) and its GPTQ fit from
#: ``codec``; validate runs models through ``runner``, never through the quantizer
SEPARATE_ROOMS: list[tuple[str, str]] = [("exl2fmt.quant", "exl2fmt.validate"), ("exl2fmt.validate", "exl2fmt.quant"),
                                         ("exl2fmt.quant", "exl2fmt.converters"), ("exl2fmt.quant", "exl2fmt.inspect"),
                                         ("exl2fmt.runner", "exl2fmt.quant"), ("exl2fmt.runner", "exl2fmt.validate")]


def test_separate_rooms_do_not_import_each_other(graph):
    fe = folder_edges(graph.edges)
    bad = [f"  {a} -> {b} ({graph.modules[m].relative_to(ROOT)}:{n} imports {t})"
           for a, b in SEPARATE_ROOMS if (hit := fe.get(a, {}).get(b)) for m, t, n in [hit]]
    assert not bad, "rooms that must stay apart:\n" + "\n".join(bad)
