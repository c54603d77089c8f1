"""CI mode of the fuzz target (fuzz/fuzz_container.py) without atheris.

* every seed (built-in layers, spec/malformed, spec/vectors) goes through the target: only Exl2Error escapes;
* ~300 hypothesis examples (random bytes, random headers, mutations of the seeds), derandomized so CI is
  repeatable, in well under 30 s;
* the mutations that should keep a file valid do, so the examples reach the layer validators and decoders;
* the harness lets a non-Exl2Error through (a planted bug is caught);
* every reproducer in fuzz/crashes/ is replayed strictly: those of still-open KNOWN_BUGS are strict xfails
  (an XPASS means the bug is fixed: drop it from KNOWN_BUGS and from the list below).
"""

from __future__ import annotations

import importlib.util
import os
import struct
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRASHES = sorted((ROOT / "fuzz" / "crashes").glob("*.safetensors"))
EXAMPLES = int(os.environ.get("EXL2FMT_FUZZ_EXAMPLES", "300"))


def _load_harness():
    name = "fuzz_container"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "fuzz" / "fuzz_container.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


F = _load_harness()


@pytest.fixture(scope="module")
def seeds():
    return F.builtin_seeds() + [d for _, d in F.file_seeds(include_sample=False)]


@pytest.fixture
def target():
    t = F.Target()
    yield t
    t.close()


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setattr(F, "TOLERATE_KNOWN", False)


def test_builtin_seeds_are_valid_and_fully_exercised(target, strict):
    """The built-in seeds parse, and the combined one holds a layer of each format, each validating clean
    (so mutations of them start from the deepest code paths)."""
    from exl2fmt.container import open_model
    from exl2fmt.model import find_layers, load_layer

    seeds = F.builtin_seeds()
    for data in seeds:
        target(data)  # strict: no known bug either
    target._write(seeds[0])
    with open_model(target.path) as model:
        refs = find_layers(model.names(), {n: model.info(n).shape for n in model.names()})
        assert {r.format.value for r in refs.values()} == {"exl2", "gptq", "dense"}
        for key in refs:
            assert load_layer(model, key).validate(deep=True) == []


def test_every_seed_file_only_raises_exl2error(target, seeds):
    assert len(seeds) > 40
    for data in seeds:
        target(data)


@pytest.mark.parametrize("kind", F.PRESERVING_KINDS)
def test_structure_preserving_mutations_keep_the_container_valid(kind):
    """These mutations change what the layer validators see, never the container's validity: the fuzz examples
    built from them reach load_layer / validate / dequantize instead of stopping at the header parser."""
    from exl2fmt.container import parse_header
    from exl2fmt.errors import Exl2Error

    changed = 0
    for data in F.builtin_seeds():
        for i in range(40):
            op = (kind, 7919 * i + 3, 104729 * i + 1, 31 * i + 5)
            out = F.mutate(data, op)
            assert F.mutate(data, op) == out  # deterministic
            try:
                parse_header(out, file_size=len(out), path="m")
            except Exl2Error as e:  # pragma: no cover - a failure message, not a branch
                pytest.fail(f"{kind} {op} broke the container: {e}")
            changed += out != data
    assert changed > 0


def test_byte_mutations_do_reach_the_parser_errors():
    from exl2fmt.container import parse_header
    from exl2fmt.errors import Exl2Error

    data = F.builtin_seeds()[1]
    codes = set()
    for op in [("truncate", 20, 0, 0), ("set_len", 0, 1, 0), ("flip", 9, 0x22, 0), ("append", 3, 1, 0),
               ("edit", 0, 0, 1), ("edit", 0, 1, 0), ("edit", 0, 2, 1)]:
        out = F.mutate(data, op)
        try:
            parse_header(out, file_size=len(out), path="m")
        except Exl2Error as e:
            codes.add(e.code.value)
    assert len(codes) >= 4, codes


def test_harness_lets_other_exceptions_through(target, monkeypatch):
    """A planted bug (a validator raising ValueError) escapes the target: the fuzzer would report it."""
    from exl2fmt import formats as layers

    def broken(self, deep=False):
        raise ValueError("planted")

    monkeypatch.setattr(layers.Exl2Linear, "validate", broken)
    with pytest.raises(ValueError, match="planted"):
        target(F.builtin_seeds()[1])


def test_harness_checks_the_dequantize_contract(target, monkeypatch, strict):
    """A layer that validates clean must dequantize to fp16 [out_features, in_features]."""
    import numpy as np

    from exl2fmt import formats as layers

    monkeypatch.setattr(layers.DenseLinear, "dequantize", lambda self: np.zeros((1, 1), np.float32))
    with pytest.raises(F.FuzzInvariantError, match="dequantize"):
        target(F.builtin_seeds()[3])


def test_hypothesis_smoke(seeds):
    t0 = time.perf_counter()
    F.run_hypothesis(EXAMPLES, derandomize=True, seeds=seeds)
    assert time.perf_counter() - t0 < 60


# ------------------------------------------------------------------------------------------------
# reproducers of reported bugs
# ------------------------------------------------------------------------------------------------

def _known_id(path: Path) -> str:
    return path.name.split("--", 1)[0]


@pytest.mark.parametrize("path", CRASHES, ids=[p.name for p in CRASHES])
def test_crash_reproducer(path, strict, request):
    bug = _known_id(path)
    if bug in F.KNOWN_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"open bug {bug}: {F.KNOWN_BUGS[bug]}"))
    t = F.Target(configs=[None])
    try:
        t(path.read_bytes())
    finally:
        t.close()


def test_every_known_bug_has_a_reproducer():
    assert set(F.KNOWN_BUGS) <= {_known_id(p) for p in CRASHES}


def test_reproducers_are_small_and_parse():
    from exl2fmt.container import parse_header

    for p in CRASHES:
        data = p.read_bytes()
        assert len(data) < 64 << 10
        n = struct.unpack("<Q", data[:8])[0]
        assert n < len(data)
        parse_header(data, file_size=len(data), path=p.name)  # the bugs are past the container
