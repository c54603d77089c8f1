"""Issue 41, class 6: JSON and other side inputs (config.json, the index, --measurement, --calibration as
.json/.jsonl/.npy, the source's tokenizer.json, --resume's job.json) never give a traceback, a hang, or memory
sized by a number in the file.

Catalogue: ``spec/malformed/hostile3_json/`` (``make_hostile3_json.py``); the big and runtime-only cases (a 99 MB
``{}``-heavy file under the byte caps, ``/dev/zero``, a FIFO, a directory) are made here.  Each case runs through
``hostile_harness.run_bounded`` on the command that reads that input: exit 1-3, its code, the file named, no
traceback, within the time and memory bounds.  The quantizer's inputs (each CLI run imports torch and transformers:
~15 s on a loaded machine) run a few representative cases each through the CLI and every catalogue payload
in-process through the same readers.  Unit tests pin the loader's own rules (``exl2fmt.container.jsonload``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from hostile_harness import ROOT, run_bounded

from exl2fmt.container import jsonload
from exl2fmt.errors import ErrorCode, Exl2Error

CAT = ROOT / "spec" / "malformed" / "hostile3_json"
INDEX = json.loads((CAT / "index.json").read_text(encoding="utf-8"))
QUANT_S = 240
BIG_BYTES = 99 * 1000 * 1000  # under the 100 MB caps of the index and tokenizer.json, far over the value caps


def _cases(use: str, ext: str | None = None) -> list[dict]:
    return [c for c in INDEX if use in c["uses"] and (ext is None or c["file"].endswith(ext))]


def _name(case: dict) -> str:
    return case["name"]


def _big_json(path: Path) -> Path:
    """99 MB of ``[{},{},...]``: 33 million dicts (2.4 GB parsed) in a file under the byte caps."""
    n = (BIG_BYTES - 2) // 3
    with open(path, "wb") as f:
        f.write(b"[")
        chunk = b"{}," * 100_000
        for _ in range(n // 100_000):
            f.write(chunk)
        f.write(b"{}]")
    return path


def _runtime(kind: str, path: Path) -> Path:
    """Make ``path`` the runtime-only hostile case ``kind``."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "big_99mb":
        _big_json(path)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return path


RUNTIME = ["fifo", "dev_zero", "directory", "big_99mb"]
#: non-finite numbers in config.json keep round 2's code (spec/malformed/hostile/c3_*): the loader reads them as
#: floats (jsonload.CONFIG.nonfinite) and the bounded value check refuses them by key
CONFIG_NONFINITE = {"nan", "float_1e400"}
RUNTIME_CODE = {"fifo": "IO_ERROR", "dev_zero": "IO_ERROR", "directory": "IO_ERROR"}


def _check(r, code: str, rc: int | tuple, name: str | None = None) -> None:
    r.check_bounds()
    out = r.stdout + r.stderr
    assert r.rc in ((rc,) if isinstance(rc, int) else rc), (r.rc, out[-2000:])
    assert f"[{code}]" in out or f" {code} " in out or f"{code}" in out, (code, out[-2000:])
    if name is not None:
        assert name in out, (name, out[-2000:])


# ----------------------------------------------------------------------------------------------- the catalogue

def test_catalogue_is_reproducible(tmp_path):
    sys.path.insert(0, str(ROOT / "spec" / "malformed"))
    try:
        import make_hostile3_json as gen
    finally:
        sys.path.pop(0)
    gen.write(tmp_path)
    for c in INDEX:
        assert (tmp_path / c["file"]).read_bytes() == (CAT / c["file"]).read_bytes(), c["name"]
    assert json.loads((tmp_path / "index.json").read_text()) == INDEX
    assert len(INDEX) >= 25


# ------------------------------------------------------------------------------------ config.json and the index

@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    from exl2fmt.sample import write_sample

    return write_sample(tmp_path_factory.mktemp("h3json") / "sample")


def _model(tmp_path: Path, sample: Path, index: bool) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copyfile(sample / "output.safetensors", d / "output.safetensors")
    if index:
        shutil.copyfile(sample / "config.json", d / "config.json")
    return d


@pytest.mark.parametrize("case", _cases("config") + [{"name": k} for k in RUNTIME], ids=_name)
@pytest.mark.parametrize("what", ["config", "index"])
def test_config_and_index_cases_are_a_code_naming_the_file(case, what, tmp_path, sample):
    d = _model(tmp_path, sample, index=what == "index")
    target = d / ("config.json" if what == "config" else "model.safetensors.index.json")
    if "file" in case:
        shutil.copyfile(CAT / case["file"], target)
    else:
        _runtime(case["name"], target)
    code = RUNTIME_CODE.get(case["name"], "CONFIG_INVALID" if what == "config" else "INDEX_INVALID")
    if what == "config" and case["name"] in CONFIG_NONFINITE:
        code = "CONFIG_VALUE_INVALID"      # read as Python's json reads it; the value check names the key
    # validate: the whole command exits 1 (a failed check) or 3 (an unreadable input)
    r = run_bounded("validate", d)
    _check(r, code, (1, 3), target.name)
    if what == "index":  # inspect opens the model through the index: fatal
        r = run_bounded("inspect", d)
        _check(r, code, (1, 3), target.name)
    else:  # inspect reports a config problem as an issue seen while inspecting
        r = run_bounded("inspect", d)
        r.check_bounds()
        assert code in r.stdout + r.stderr and r.rc in (0, 1, 3), r.stdout[-2000:]


# --------------------------------------------------------------------------------- the quantizer's side inputs

def _needs_quant() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a tiny llama directory with a byte-level BPE tokenizer.json, calibration ids .npy, a text file)."""
    _needs_quant()
    import numpy as np
    from tiny_hf import make_tiny

    d = tmp_path_factory.mktemp("h3json-q")
    src = make_tiny("llama", d / "tiny-llama", tokenizer="bpe")
    ids = d / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 100, (4, 32)))
    (d / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200, encoding="utf-8")
    return src, ids, d / "text.txt"


def _q(ids, *extra):
    return ["--to", "exl2", "--bits", "4.0", "--rows", "4", "--length", "32", "--device", "cpu",
            *(["--calibration", str(ids)] if ids is not None else []), *extra]


def _file(tmp_path: Path, case: str, name: str) -> Path:
    p = tmp_path / name
    if case in RUNTIME:
        return _runtime(case, p)
    shutil.copyfile(CAT / next(c["file"] for c in INDEX if c["name"] == case), p)
    return p


@pytest.mark.parametrize("case", ["deep_array", "measurement_layer_5000_digits", "fifo", "big_99mb", "top_array"])
def test_measurement_cases_through_the_cli(case, tiny, tmp_path):
    src, ids, _ = tiny
    m = _file(tmp_path, case, "measurement.json")
    r = run_bounded("convert", src, tmp_path / "q", *_q(ids, "--measurement", m), timeout=QUANT_S)
    _check(r, RUNTIME_CODE.get(case, "MEASUREMENT_INVALID"), 3, "measurement.json")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("case,name", [("deep_object", "ids.json"), ("bigint_5000", "ids.json"),
                                       ("npy_10m_empty_rows", "ids.npy"), ("jsonl_deep_line", "ids.jsonl"),
                                       ("dev_zero", "ids.json"), ("fifo", "ids.npy")])
def test_calibration_cases_through_the_cli(case, name, tiny, tmp_path):
    src, _, _ = tiny
    c = _file(tmp_path, case, name)
    r = run_bounded("convert", src, tmp_path / "q", *_q(c), timeout=QUANT_S)
    _check(r, RUNTIME_CODE.get(case, "CALIBRATION_INVALID"), (1, 3), name)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("case", ["deep_array", "fifo"])
def test_tokenizer_cases_through_the_cli(case, tiny, tmp_path):
    src0, _, text = tiny
    src = tmp_path / "src"
    shutil.copytree(src0, src)
    (src / "tokenizer.json").unlink()
    _file(src, case, "tokenizer.json")
    r = run_bounded("convert", src, tmp_path / "q", *_q(text), timeout=QUANT_S)
    _check(r, RUNTIME_CODE.get(case, "CALIBRATION_INVALID"), (1, 3), "tokenizer.json")


def _work_dir(dst: Path) -> Path:
    from exl2fmt.quant import workdir

    root = workdir.work_root(dst)
    make = getattr(workdir, "make_work_dir", None)
    if make is not None:
        make(root, dst)
    else:  # pragma: no cover - before the work-dir owner markers
        root.mkdir()
    return root


@pytest.mark.parametrize("case", ["job_wrong_types", "deep_array", "fifo"])
def test_resume_job_cases_through_the_cli(case, tiny, tmp_path):
    src, ids, _ = tiny
    dst = tmp_path / "q"
    root = _work_dir(dst)
    _file(root, case, "job.json")
    r = run_bounded("convert", src, dst, *_q(ids, "--resume"), timeout=QUANT_S)
    _check(r, RUNTIME_CODE.get(case, "CHECKPOINT_INVALID"), 3, "job.json")
    assert not dst.exists()


# every catalogue payload in-process, through the same readers the CLI uses

def _raises(fn) -> Exl2Error:
    with pytest.raises(Exl2Error) as ei:
        fn()
    return ei.value


@pytest.mark.parametrize("case", _cases("measurement"), ids=_name)
def test_every_measurement_payload(case):
    from exl2fmt.quant.qparams import read_measurement

    names = {"model.layers.0.self_attn": ("q_proj",), "model.layers.0.mlp": ("up_proj",)}
    e = _raises(lambda: read_measurement(CAT / case["file"], names, num_layers=1))
    assert e.code is ErrorCode.MEASUREMENT_INVALID and e.file == str(CAT / case["file"]), e


@pytest.mark.parametrize("case", [c for c in _cases("calibration") if not c["file"].endswith(".jsonl")], ids=_name)
def test_every_calibration_payload(case):
    pytest.importorskip("torch")
    from exl2fmt.quant.calib import load_calibration

    src = CAT / case["file"]
    e = _raises(lambda: load_calibration(src, None, 1, 2))
    assert e.code is ErrorCode.CALIBRATION_INVALID and e.file == str(src), e


@pytest.mark.parametrize("case", _cases("calibration", ".jsonl"), ids=_name)
def test_every_jsonl_payload_names_its_line(case, tiny):
    from exl2fmt.quant.calib import load_calibration

    src, _, _ = tiny
    e = _raises(lambda: load_calibration(CAT / case["file"], src / "tokenizer.json", 1, 2))
    assert e.code is ErrorCode.CALIBRATION_INVALID and "line 2" in e.message, e


@pytest.mark.parametrize("case", _cases("tokenizer"), ids=_name)
def test_every_tokenizer_payload(case, tmp_path):
    pytest.importorskip("tokenizers")
    from exl2fmt.quant.calib import load_tokenizer

    p = tmp_path / "tokenizer.json"
    shutil.copyfile(CAT / case["file"], p)
    e = _raises(lambda: load_tokenizer(p))
    assert e.code is ErrorCode.CALIBRATION_INVALID and e.file == str(p), e


@pytest.mark.parametrize("case", _cases("job"), ids=_name)
def test_every_job_payload(case, tmp_path):
    _needs_quant()
    from exl2fmt.quant import job

    root = tmp_path / "w"
    root.mkdir()
    shutil.copyfile(CAT / case["file"], root / "job.json")
    e = _raises(lambda: job.Work(root, {"x": 1}, resume=True))
    assert e.code is ErrorCode.CHECKPOINT_INVALID and e.file == str(root / "job.json"), e


def test_progress_of_a_hostile_job_is_none_or_a_description(tmp_path):
    from exl2fmt.quant.workdir import progress_of

    for c in _cases("job"):
        root = tmp_path / c["name"]
        root.mkdir()
        shutil.copyfile(CAT / c["file"], root / "job.json")
        pr = progress_of(root)
        assert pr is None or pr["phase"] in ("measurement", "quantization"), c["name"]
    os.mkfifo(tmp_path / "fifo-job")
    (tmp_path / "f").mkdir()
    os.symlink(tmp_path / "fifo-job", tmp_path / "f" / "job.json")
    with _alarm(5):
        assert progress_of(tmp_path / "f") is None


# ----------------------------------------------------------------------------------------------- the loader

class _alarm:
    def __init__(self, s: int):
        self.s = s

    def __enter__(self):
        def boom(*_):
            raise TimeoutError("blocked")
        self.old = signal.signal(signal.SIGALRM, boom)
        signal.alarm(self.s)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


K = jsonload.MEASUREMENT        # the strict number rules (config.json reads non-finite numbers: tested below)


def _err(raw: bytes, kind=K) -> Exl2Error:
    return _raises(lambda: jsonload.loads_json(raw, kind, file="f.json"))


def test_loader_maps_every_parser_error_to_the_kinds_code():
    for c in INDEX:
        if c["file"].endswith(".json") and c["name"] not in ("top_array", "top_string") and "config" in c["uses"]:
            raw = (CAT / c["file"]).read_bytes()
            for kind in (jsonload.CONFIG, jsonload.MEASUREMENT, jsonload.JOB, jsonload.INDEX):
                if kind.nonfinite and c["name"] in CONFIG_NONFINITE:
                    assert not all(math.isfinite(v) for v in jsonload.loads_json(raw, kind).values()
                                   if isinstance(v, float)), c["name"]
                    continue
                e = _err(raw, kind)
                assert e.code is kind.code and e.file == "f.json" and kind.what in e.message, (c["name"], e)


def test_loader_rules_at_their_edges():
    # depth: the top level is depth 1
    assert jsonload.loads_json(b"[" * 64 + b"]" * 64, K) is not None
    assert "nested at most 64" in _err(b"[" * 65 + b"]" * 65).message
    assert "nested" in _err(b"[" * 5000 + b"]" * 5000).message
    # brackets, commas and digits inside strings are text, not structure
    s = json.dumps({"a": "[" * 5000, "b": "9" * 5000, "c": "," * (K.max_items + 10)}).encode()
    assert jsonload.loads_json(s, K)["a"] == "[" * 5000
    # numbers: 100 digits pass, 101 do not; the float64 range is the limit
    assert jsonload.loads_json(b"[" + b"9" * 100 + b"]", K) == [int("9" * 100)]
    assert "100 digits" in _err(b"[" + b"9" * 101 + b"]").message
    assert jsonload.loads_json(b"[1e308, -1e308, 1E-400]", K) == [1e308, -1e308, 0.0]
    assert "float64" in _err(b"[1e309]").message and "float64" in _err(b"[-1E309]").message
    for bad in (b"[NaN]", b"[Infinity]", b"[-Infinity]"):
        assert "not a JSON value" in _err(bad).message
    # config.json reads them as Python's json does, so the value check can name the key (round 2's code)
    got = jsonload.loads_json(b"[NaN, Infinity, -Infinity, 1e400]", jsonload.CONFIG)
    assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf, math.inf]
    # text
    assert jsonload.loads_json(b'\xef\xbb\xbf{"a": "\\ud83d\\ude00"}', K) == {"a": "\U0001F600"}
    assert "surrogate" in _err(b'{"\\udc00": 1}').message
    assert "UTF-8" in _err(b'["\xc3"]').message
    # value count: an estimate over the raw text, exact over the text without strings
    few = jsonload.JsonKind("t", ErrorCode.USAGE, 1000, 10)
    assert jsonload.loads_json(b"[1,2,3,4,5,6,7,8,9]", few) == list(range(1, 10))
    assert "at most 10 JSON values" in _err(b"[" + b"{}," * 10 + b"{}]", few).message
    # bytes
    assert "at most 1000 bytes" in _err(b" " * 1001 + b"1", few).message


def test_loader_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"a": [1, 2]}')
    assert jsonload.load_json(p, K) == {"a": [1, 2]}
    assert _raises(lambda: jsonload.load_json(tmp_path / "none.json", K)).code is ErrorCode.PATH_NOT_FOUND
    for kind in ("fifo", "dev_zero", "directory"):
        q = _runtime(kind, tmp_path / kind)
        with _alarm(5):
            e = _raises(lambda: jsonload.load_json(q, K))
        assert e.code is ErrorCode.IO_ERROR and e.file == str(q) and "regular file" in e.message, e
    small = jsonload.JsonKind("x", ErrorCode.CONFIG_INVALID, 10, 100)
    p.write_text(" " * 11)
    assert "at most 10 bytes" in _raises(lambda: jsonload.load_json(p, small)).message


def test_big_99mb_file_is_refused_by_value_count_within_bounds(tmp_path):
    """The index and tokenizer.json caps are 100 MB: the value-count rule, not the byte cap, refuses this."""
    big = _big_json(tmp_path / "big.json")
    assert big.stat().st_size < jsonload.INDEX.max_bytes
    for kind in (jsonload.INDEX, jsonload.TOKENIZER):
        e = _raises(lambda: jsonload.load_json(big, kind))
        assert e.code is kind.code and "JSON values" in e.message


def test_shape_helpers_name_the_file_and_key():
    kind = jsonload.MEASUREMENT
    assert jsonload.expect({}, "object", kind) == {}
    e = _raises(lambda: jsonload.expect([], "object", kind, file="m.json"))
    assert e.code is ErrorCode.MEASUREMENT_INVALID and e.file == "m.json" and "expected object, found array" in e.message
    e = _raises(lambda: jsonload.expect_list_of(["a", 1], "string", kind, where="names"))
    assert "names[1]: expected string, found integer 1" in e.message
    e = _raises(lambda: jsonload.expect_dict_of({"a": 1, "b": True}, "integer", kind, where="vocab"))
    assert 'vocab["b"]: expected integer, found boolean true' in e.message
    e = _raises(lambda: jsonload.expect(float("inf"), "number", kind))
    assert "expected number" in e.message
    assert jsonload.expect(None, ("object", "null"), kind) is None
    with pytest.raises(KeyError):
        jsonload.expect(1, "float", kind)  # a programming error, not a file problem
