"""The hostile catalogue of issue 11, classes 1-4 (``spec/malformed/hostile/``, made by ``make_hostile.py``).

Every run of every case goes through the real CLI in a fresh process under the issue's bounds
(``hostile_harness.run_bounded``: 10 s wall clock, 1 GB peak RSS, an address-space cap, no traceback) and
must exit with the catalogue's status and print the catalogue's code.  The generator must reproduce the
checked-in bytes.  Cases whose point is size are written at test time (``make_hostile.big_cases``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hostile_harness import run_bounded

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "spec" / "malformed" / "hostile"
ENTRIES = json.loads((HOSTILE / "index.json").read_text(encoding="utf-8"))


def _generator():
    sys.path.insert(0, str(ROOT / "spec" / "malformed"))
    spec = importlib.util.spec_from_file_location("make_hostile", ROOT / "spec" / "malformed" / "make_hostile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generator_reproduces_the_catalogue(tmp_path):
    _generator().generate(tmp_path / "h")
    want, got = _files(HOSTILE), _files(tmp_path / "h")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from what make_hostile.py writes"
    assert sum(map(len, want.values())) < 2 << 20, "the stored catalogue should stay small"


def test_catalogue_covers_every_class():
    by_class: dict[int, int] = {}
    for e in ENTRIES:
        by_class[e["class"]] = by_class.get(e["class"], 0) + 1
    assert all(by_class.get(c, 0) >= 3 for c in (1, 2, 3, 4)), by_class


def _check(args, code, exit_status, tmp_path):
    r = run_bounded(*args)
    r.check_bounds()
    out = r.stdout + r.stderr
    assert r.rc == exit_status, f"{args}: exit {r.rc}, expected {exit_status}\n{out[-2000:]}"
    assert "INTERNAL" not in out, out[-2000:]
    if code is not None:
        assert code in out, f"{args}: {code!r} not in the output\n{out[-2000:]}"
    return r


@pytest.fixture(scope="module")
def warm_numba():
    """Compile (or load) the Numba decoders once, unbounded, so that the 10 s bound measures the input's work
    and not a cold JIT cache (the harness pins NUMBA_CACHE_DIR, so later processes load the cache)."""
    d = HOSTILE / "c3_gptq_bits_true"
    for key in ("model.layers.0.mlp.up_proj",):
        run_bounded("dequantize", d, key, timeout=600)
    run_bounded("dequantize", HOSTILE / "c4_exl2_decodes_to_inf", "model.layers.0.mlp.down_proj", timeout=600)
    run_bounded("validate", "--deep", HOSTILE / "c4_exl2_decodes_to_inf", timeout=600)  # the fused stats kernel


def _runs(first: bool):
    out = []
    for e in ENTRIES:
        for i, r in enumerate(e["runs"]):
            if (i == 0) == first:
                out.append(pytest.param(e, i, id=f"{e['path']}-{i}-{r['args'][0]}"))
    return out


def _run_case(entry, i, tmp_path):
    run = entry["runs"][i]
    out = tmp_path / "out"
    args = [a.replace("{case}", str(HOSTILE / entry["path"])).replace("{out}", str(out)) for a in run["args"]]
    _check(args, run["code"], run["exit"], tmp_path)
    if "{out}" in run["args"] and run["exit"]:
        assert not out.exists(), "a refused conversion must not leave DST"


@pytest.mark.parametrize("entry,i", _runs(True))
def test_hostile_case(entry, i, tmp_path, warm_numba):
    """The first command of every case (for class 4: dequantize, the command that used to accept)."""
    _run_case(entry, i, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("entry,i", _runs(False))
def test_hostile_case_other_commands(entry, i, tmp_path, warm_numba):
    """The same case through the other commands (inspect, validate --deep, convert): same code, same bounds."""
    _run_case(entry, i, tmp_path)


def test_findings_are_capped_in_human_output_not_in_json():
    d = HOSTILE / "c1_index_5000_missing_tensors"
    human = run_bounded("validate", d)
    assert human.stdout.count("INDEX_MISSING_TENSOR") == 21  # 20 findings + the "... and 4980 more" line
    js = run_bounded("validate", "--json", d)
    doc = json.loads(js.stdout)
    assert sum(1 for c in doc["checks"] if c["code"] == "INDEX_MISSING_TENSOR") == 5000
    assert doc["counts"]["fail"] >= 5000


def test_size_cases_generated_at_test_time(tmp_path):
    gen = _generator()
    for path, args, code, exit_status in gen.big_cases(tmp_path):
        if "100000" in str(path) or "array_8_" in str(path):
            continue  # the largest ones run in bench/bench_hostile_scaling.py
        _check(args, code, exit_status, tmp_path)


@pytest.mark.slow
def test_largest_size_cases(tmp_path):
    gen = _generator()
    for path, args, code, exit_status in gen.big_cases(tmp_path):
        _check(args, code, exit_status, tmp_path)
