"""The malformed-input catalogue (spec/malformed/): every sample gives its documented error code.

For each entry of ``spec/malformed/index.json`` not marked ``"checked_by": "cli"`` the library path the CLI
uses is run - ``open_model``; for a directory also ``index_issues()`` and ``config``; for an entry with a
``layer`` also ``load_layer(...).validate(deep=entry["deep"])`` - and the expected ``ErrorCode`` must be
raised or reported, with a one-line message naming the file (and the tensor), in bounded time and memory.
The catalogue itself is checked: codes exist, exit classes agree with the codes' categories, files stay
small, the README lists every sample, and the generator reproduces the files byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from exl2fmt.container import open_model, parse_header, read_header
from exl2fmt.errors import Category, ErrorCode, Exl2Error, Issue, Severity, escape_name
from exl2fmt.formats import layer_from_tensors
from exl2fmt.model import load_layer

ROOT = Path(__file__).resolve().parents[1]
MAL = ROOT / "spec" / "malformed"
INDEX = json.loads((MAL / "index.json").read_text(encoding="utf-8"))
LIBRARY = [e for e in INDEX if e.get("checked_by") != "cli"]
CLI_ONLY = [e for e in INDEX if e.get("checked_by") == "cli"]
LAYER_ENTRIES = [e for e in LIBRARY if e["layer"] is not None]

#: codes the brief requires the catalogue to cover (issue 3, "Bad input")
REQUIRED_CODES = {
    "HEADER_TOO_SMALL", "HEADER_PAST_EOF", "HEADER_TOO_LARGE", "HEADER_NOT_UTF8", "HEADER_NOT_JSON", "DUPLICATE_KEY",
    "METADATA_INVALID", "TENSOR_ENTRY_INVALID", "SHAPE_INVALID", "DTYPE_UNKNOWN", "OFFSETS_INVALID", "OFFSETS_OVERLAP",
    "OFFSETS_GAP", "SIZE_MISMATCH", "SIZE_OVERFLOW", "TRUNCATED", "TRAILING_BYTES", "NAME_CONTROL_CHARS",
    "SLOT_MISSING", "SLOT_DTYPE", "SLOT_SHAPE", "K_MISMATCH", "GROUPS_BITS", "GROUPS_ORDER", "GROUPS_QROW",
    "GROUPS_ROWS", "N_PADDING", "PERM_INVALID", "PERM_MISMATCH", "SCALE_MAX_INVALID", "GROUPS_LIMIT", "GPTQ_G_IDX",
    "GPTQ_BITS", "NONFINITE_VALUES", "INDEX_MISSING_SHARD", "INDEX_MISSING_TENSOR", "INDEX_UNLISTED_TENSOR",
    "INDEX_INVALID", "DUPLICATE_TENSOR", "CONFIG_MISMATCH", "CONFIG_INVALID", "NO_SAFETENSORS", "UNSUPPORTED_INPUT",
}

TIME_LIMIT_S = 2.0
PEAK_LIMIT_BYTES = 50 << 20


def _ids(entries):
    return [e["path"] for e in entries]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_malformed", MAL / "make_malformed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass(frozen=True)
class Finding:
    code: ErrorCode
    severity: Severity
    file: str | None
    tensor: str | None
    line: str  # the one-line message the CLI prints

    @classmethod
    def of(cls, x: Exl2Error | Issue) -> "Finding":
        if isinstance(x, Exl2Error):
            return cls(x.code, Severity.ERROR, x.file, x.tensor, x.one_line())
        return cls(x.code, x.severity, x.file, x.tensor, x.to_error().one_line())


def library_findings(entry: dict, deep: bool) -> list[Finding]:
    """Everything the library path raises or reports for one catalogue entry."""
    path = MAL / entry["path"]
    out: list[Finding] = []
    try:
        model = open_model(path)
    except Exl2Error as e:
        return [Finding.of(e)]
    try:
        if path.is_dir():
            out += [Finding.of(i) for i in model.index_issues()]
            try:
                model.config
            except Exl2Error as e:
                out.append(Finding.of(e))
        if entry["layer"] is not None:
            try:
                layer = load_layer(model, entry["layer"])
            except Exl2Error as e:
                out.append(Finding.of(e))
            else:
                out += [Finding.of(i) for i in layer.validate(deep=deep)]
    finally:
        model.close()
    return out


@pytest.fixture(scope="module", autouse=True)
def _warm_numba():
    """Compile (or load from cache) the Numba kernels the deep checks use, outside the timed region."""
    gen = _load_generator()
    for slots in (gen.exl2_base(), gen.gptq_base(), gen.dense_base()):
        layer = layer_from_tensors("warm", slots)
        layer.validate(deep=True)
        layer.dequantize()


# ------------------------------------------------------------------------------------------------
# every library-checked sample gives its code
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", LIBRARY, ids=_ids(LIBRARY))
def test_sample_gives_expected_code(entry):
    expected = ErrorCode(entry["code"])
    deep = bool(entry.get("deep", False))

    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        found = library_findings(entry, deep)
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()

    hits = [f for f in found if f.code is expected]
    assert hits, f"expected {expected.value}, found {[f.line for f in found]}"
    # each sample breaks one rule: nothing else is reported
    assert {f.code for f in found} == {expected}, [f.line for f in found]
    assert elapsed < TIME_LIMIT_S, f"took {elapsed:.2f} s"
    assert peak < PEAK_LIMIT_BYTES, f"traced peak {peak / 2**20:.1f} MiB"

    hit = hits[0]
    want_sev = Severity(entry.get("severity", "error"))
    assert hit.severity is want_sev
    # one line, no raw control characters, names the file (for a directory: a path inside it)
    assert "\n" not in hit.line and "\x1b" not in hit.line and "\r" not in hit.line
    assert hit.file is not None and Path(entry["path"]).name in Path(hit.file).parts, hit.file
    assert escape_name(Path(entry["path"]).name) in hit.line
    if entry["layer"] is not None:
        assert hit.tensor is not None and hit.tensor.startswith(entry["layer"]), hit.tensor
        assert escape_name(hit.tensor) in hit.line
    if "tensor" in entry:
        assert hit.tensor == entry["tensor"]
    if deep:
        # a --deep check: the header-only validation must not find it (it needs the data)
        assert expected not in {f.code for f in library_findings(entry, deep=False)}


@pytest.mark.parametrize("entry", [e for e in LIBRARY if e["path"].endswith(".safetensors") and e["layer"] is None],
                         ids=_ids([e for e in LIBRARY if e["path"].endswith(".safetensors") and e["layer"] is None]))
def test_in_memory_parser_agrees_with_file_reader(entry):
    """parse_header on the bytes gives the same code as read_header on the file (one rule, one code)."""
    buf = (MAL / entry["path"]).read_bytes()
    with pytest.raises(Exl2Error) as from_file:
        read_header(MAL / entry["path"])
    with pytest.raises(Exl2Error) as from_bytes:
        parse_header(buf, file_size=len(buf), path=entry["path"])
    assert from_file.value.code is from_bytes.value.code is ErrorCode(entry["code"])


@pytest.mark.parametrize("entry", LAYER_ENTRIES, ids=_ids(LAYER_ENTRIES))
def test_broken_layer_never_dequantizes_silently_wrong(entry):
    """dequantize() on a broken layer raises Exl2Error, or (for data-only faults such as NaN) returns the
    documented fp16 [out_features, in_features] array; never another exception type."""
    model = open_model(MAL / entry["path"])
    try:
        layer = load_layer(model, entry["layer"])
        shallow = [i for i in layer.validate(deep=False) if i.severity is Severity.ERROR]
        try:
            w = layer.dequantize()
        except Exl2Error as e:
            assert "\n" not in e.one_line()
        else:
            assert not shallow, "dequantize accepted a layer the structural checks reject"
            assert w.dtype == np.float16 and w.shape == (layer.out_features, layer.in_features)
    finally:
        model.close()


def test_generator_base_layers_are_valid():
    """The uncorrupted layers the EXL2/GPTQ/dense samples start from pass every check, so each sample's
    finding comes from its one corruption."""
    gen = _load_generator()
    for slots in (gen.exl2_base(), gen.exl2_base(bias=True, seed=4), gen.exl2_base([(8, 32), (4, 64)], seed=2),
                  gen.exl2_base(n_pad=64, seed=3), gen.gptq_base(), gen.dense_base()):
        layer = layer_from_tensors(gen.KEY, slots)
        assert layer.validate(deep=True) == []
        w = layer.dequantize()
        assert np.isfinite(w.astype(np.float32)).all()


# ------------------------------------------------------------------------------------------------
# samples the CLI checks (exl2fmt/validate/): the library still reads them
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", CLI_ONLY, ids=_ids(CLI_ONLY))
def test_cli_checked_samples_are_readable(entry):
    """The container accepts these; the fault is one only the model-level validator reports."""
    model = open_model(MAL / entry["path"])
    try:
        if entry["code"] == "NAME_CONTROL_CHARS":
            names = model.names()
            assert any(ch in n for n in names for ch in "\x1b\x07\n")
            layer = load_layer(model, entry["layer"])
            assert layer.validate(deep=True) == []  # the layer itself is fine
        elif entry["code"] == "CONFIG_MISMATCH":
            cfg = model.config
            assert cfg["vocab_size"] != model.info("lm_head.weight").shape[0]
        else:  # pragma: no cover - a new cli-only sample needs its own check here
            pytest.fail(f"no readability check for {entry['code']}")
    finally:
        model.close()


# ------------------------------------------------------------------------------------------------
# the catalogue itself
# ------------------------------------------------------------------------------------------------

def test_catalogue_size_and_codes():
    assert len(INDEX) >= 35
    assert len({e["path"] for e in INDEX}) == len(INDEX)
    for e in INDEX:
        code = ErrorCode(e["code"])  # a member of the closed enum
        assert e["exit"] in (1, 3)
        assert (e["exit"] == 3) == (code.category is Category.UNREADABLE), e["path"]
        assert isinstance(e["description"], str) and e["description"] and "\n" not in e["description"]
        assert e["layer"] is None or isinstance(e["layer"], str)
        if e.get("severity") == "warning":
            assert e.get("strict") is True and e.get("exit_without_strict") == 0
        assert (MAL / e["path"]).exists(), e["path"]
    assert REQUIRED_CODES <= {e["code"] for e in INDEX}, REQUIRED_CODES - {e["code"] for e in INDEX}


def test_catalogue_files_are_small():
    for e in INDEX:
        p = MAL / e["path"]
        files = [q for q in p.rglob("*") if q.is_file()] if p.is_dir() else [p]
        size = sum(q.stat().st_size for q in files)
        limit = 320 << 10 if "oversize_reason" in e else 64 << 10
        assert size < limit, f"{e['path']}: {size} bytes"


def test_readme_lists_every_sample():
    text = (MAL / "README.md").read_text(encoding="utf-8")
    for e in INDEX:
        assert f"`{e['path']}`" in text, e["path"]
        assert e["code"] in text


def _tree(root: Path) -> dict[str, bytes]:
    # the hostile catalogues (hostile/, hostile_io/, hostile3_*/) have their own generators and tests
    return {q.relative_to(root).as_posix(): q.read_bytes() for q in sorted(root.rglob("*"))
            if q.is_file() and q.name != "make_malformed.py" and not q.name.startswith("make_hostile")
            and "__pycache__" not in q.parts and not q.relative_to(root).parts[0].startswith("hostile")}


def test_generator_is_deterministic_and_matches_checked_in_files(tmp_path):
    gen = _load_generator()
    gen.generate(tmp_path / "a")
    gen.generate(tmp_path / "a")  # idempotent: a second run over its own output changes nothing
    gen.generate(tmp_path / "b")
    a, b, shipped = _tree(tmp_path / "a"), _tree(tmp_path / "b"), _tree(MAL)
    assert a == b
    assert sorted(a) == sorted(shipped), "spec/malformed differs from the generator's file list: regenerate"
    stale = [k for k in a if a[k] != shipped[k]]
    assert not stale, f"regenerate spec/malformed: {stale}"
