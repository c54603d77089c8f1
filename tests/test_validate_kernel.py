"""``exl2fmt validate --kernel``: every EXL2 layer through the Triton kernels against the reference.

The kernel runs happen in subprocesses: on the CPU the kernels need Triton's interpreter, which must be chosen
(TRITON_INTERPRET=1, set by ``exl2fmt.kernels.load_triton``) before anything in the process imports triton, and
other test modules of this pytest process may already have imported it in compiled mode.

* The sample model (15 EXL2 layers, every width): exit 0, every layer dequantized bit for bit, every output
  within the bound, JSON per the schema.
* A model that passes the structural checks but whose layer overflows fp16 at its outputs (q_scale_max raised:
  the weights stay finite, x @ W does not): KERNEL_MISMATCH for that layer only, with the count of non-finite
  outputs checked against y_ref recomputed here from the reference weights; a structurally invalid layer in the
  same model is skipped by the kernel pass.
* torch or triton missing (an import shim first on PYTHONPATH): exit 3, one line naming
  ``pip install 'exl2fmt[kernels]'``, no traceback; plain validate still works.

The runs through the interpreter take one layer of each kind the kernels treat differently (``SUBSET``, a
model directory holding those layers only); the same tests over every layer of the sample run with ``-m slow``.

Runtime: about 85 s in one process on 2 CPU cores shared with other work (load ~4); the old whole-model runs
took about twice that.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from typer.testing import CliRunner

from exl2fmt.cli.app import app
from exl2fmt.container import read_header
from exl2fmt.errors import ErrorCode
from exl2fmt.model import dequantize_layer
from exl2fmt.sample import write_sample
from test_cli import SCHEMA, check_schema

ROOT = Path(__file__).resolve().parents[1]
HAS_KERNELS = all(importlib.util.find_spec(m) is not None for m in ("torch", "triton"))
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="needs torch and triton: pip install 'exl2fmt[kernels]'")

OVERFLOW = "model.layers.0.self_attn.v_proj"  # 3/2-bit: |q - z| <= 4, so q_scale_max 12000 keeps |w| <= 48000
BROKEN = "model.layers.1.self_attn.k_proj"  # q_groups bit width 7: GROUPS_BITS
QSM_BIG = 12000.0
#: One layer of each kind the kernels treat differently: every EXL2 width (8 4 3 | 3 2 | 5 | 8 6), groups of
#: 32, 64 and 128 rows, K = 704 (22 blocks of 32 rows), N = 704 (not a power of two: a column block wider than
#: the layer), N = 128, and the head padded from the vocabulary's 1000 columns to 1024 (config.json says 1000).
SUBSET = ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.self_attn.v_proj",
          "lm_head")
#: The broken model's subset: the two bad layers and two good ones next to them.
BAD_SUBSET = (OVERFLOW, BROKEN, "model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.v_proj")
#: GPTQ (4-bit g128; the head stays fp16): K = 256 and 704, N = 128, 256 and 704 (a column block wider than the
#: layer), each layer with the g_idx its own EXL2 permutation gives.
GPTQ_SUBSET = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj", "model.layers.0.mlp.down_proj")
#: A fixture parameter: the subset in the default suite, every layer with -m slow.
SCOPES = [pytest.param("full", marks=pytest.mark.slow), "subset"]
FP16_INF_AT = 65520.0  # |y| from here on rounds to inf in float16


def cli(*args, pythonpath: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, pythonpath=pythonpath, timeout=timeout)


def patch_tensor(model_file: Path, name: str, data: np.ndarray) -> None:
    """Overwrite one tensor's bytes in place (same size)."""
    t = read_header(model_file).tensors[name]
    raw = np.ascontiguousarray(data).tobytes()
    assert len(raw) == t.nbytes
    with open(model_file, "r+b") as f:
        f.seek(t.abs_begin)
        f.write(raw)


def keep_layers(src: Path, dst: Path, keys) -> Path:
    """A copy of the model directory ``src`` (one safetensors file) in ``dst`` whose linear layers are ``keys``
    only: every other layer's tensors dropped; embeddings, norms and the other files kept as they are."""
    from safetensors.numpy import load_file

    from exl2fmt.container import write_safetensors
    from exl2fmt.detect import detect_layers

    (f,) = src.glob("*.safetensors")
    t = load_file(str(f))
    drop = set(detect_layers(read_header(f).tensors)) - set(keys)
    assert drop and not set(keys) - set(detect_layers(read_header(f).tensors)), keys
    dst.mkdir()
    write_safetensors(dst / f.name, {n: a for n, a in t.items() if n.rpartition(".")[0] not in drop})
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy(p, dst / p.name)
    return dst


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernel-sample")
    write_sample(d)
    return d


@pytest.fixture(scope="module", params=SCOPES)
def sample_case(request, sample_dir, tmp_path_factory):
    """(model directory, how many EXL2 layers it holds): the whole sample, or the sample's ``SUBSET``."""
    if request.param == "full":
        return sample_dir, 15
    return keep_layers(sample_dir, tmp_path_factory.mktemp("kernel-subset") / "m", SUBSET), len(SUBSET)


@pytest.fixture(scope="module", params=SCOPES)
def bad_dir(request, sample_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("kernel-bad")
    if request.param == "full":
        for p in sample_dir.iterdir():
            shutil.copy(p, d / p.name)
    else:
        d = keep_layers(sample_dir, d / "m", BAD_SUBSET)
    f = d / "output.safetensors"
    from safetensors.numpy import load_file

    t = load_file(str(f))
    patch_tensor(f, f"{OVERFLOW}.q_scale_max", np.full_like(t[f"{OVERFLOW}.q_scale_max"], QSM_BIG))
    qg = t[f"{BROKEN}.q_groups"].copy()
    qg[0] = 7
    patch_tensor(f, f"{BROKEN}.q_groups", qg)
    return d, 15 if request.param == "full" else len(BAD_SUBSET)


@pytest.fixture(scope="module")
def bad_doc(bad_dir):
    """(validate --kernel's JSON report on the broken model, how many layers the model holds)."""
    d, n = bad_dir
    p = cli("validate", d, "--kernel", "--device", "cpu", "--kernel-m", "1", "--json")
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 1, p.stderr[-3000:]
    return json.loads(p.stdout), n


# ------------------------------------------------------------------------------------------------ the sample


@needs_kernels
def test_sample_every_layer_bit_exact_and_within_bound(sample_case):
    d, n = sample_case
    p = cli("validate", d, "--kernel", "--device", "cpu", "--json")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert p.stderr == ""  # JSON mode: no note, no progress on stderr
    doc = json.loads(p.stdout)
    check_schema(doc, SCHEMA["$defs"]["validate"])
    assert doc["result"] == "PASS" and doc["kernel"] == {"device": "cpu", "interpreter": True, "ms": [1, 16],
                                                         "seed": 0}
    run = {l["key"]: l["kernel"] for l in doc["layers"] if l["kernel"]}
    inspected = json.loads(cli("inspect", d, "--json").stdout)
    assert sorted(run) == sorted(l["key"] for l in inspected["layers"]) and len(run) == n
    assert n == 15 or sorted(run) == sorted(SUBSET)
    for key, k in run.items():
        assert k["dequant_exact"] and k["mismatches"] == 0, key
        assert [(r["M"], r["path"]) for r in k["results"]] == [(1, "gemv"), (16, "dot")]
        for r in k["results"]:
            assert r["within_bound"] and r["outside"] == 0 and r["nonfinite"] == 0, (key, r)
            # float16 outputs: rounding makes the error non-zero, and it stays near fp16's unit roundoff
            assert 0 < r["max_rel_err"] < 2.0 ** -10, (key, r)
    ok = [c for c in doc["checks"] if c["check"] == "kernel"]
    assert [(c["status"], c["code"], c["count"]) for c in ok] == [("PASS", "KERNEL_OK", n)]


@needs_kernels
def test_human_output_notes_the_interpreter(sample_dir, tmp_path):
    from safetensors.numpy import load_file

    from exl2fmt.container import write_safetensors

    key = "model.layers.0.self_attn.k_proj"  # one small layer: a fast interpreter run
    t = load_file(str(sample_dir / "output.safetensors"))
    write_safetensors(tmp_path / "one.safetensors", {n: a for n, a in t.items() if n.startswith(key + ".")})
    p = cli("validate", tmp_path / "one.safetensors", "--kernel", "--device", "cpu", "--kernel-m", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "interpreter" in p.stderr and "Traceback" not in p.stderr
    assert "PASS KERNEL_OK" in p.stdout and "M=3 dot" in p.stdout
    (row,) = [l for l in p.stdout.splitlines() if l.startswith(key)]
    assert "bit-exact" in row and row.rstrip().endswith("ok")


# ------------------------------------------------------------------------------------------------ failures


@needs_kernels
def test_overflowing_layer_fails_kernel_check(bad_doc):
    torch = pytest.importorskip("torch")
    bad_doc, n = bad_doc
    check_schema(bad_doc, SCHEMA["$defs"]["validate"])
    fails = [c for c in bad_doc["checks"] if c["status"] == "FAIL"]
    assert {(c["check"], c["code"], c["tensor"]) for c in fails} == {
        ("kernel", "KERNEL_MISMATCH", OVERFLOW), ("layers", "GROUPS_BITS", f"{BROKEN}.q_groups")}
    run = {l["key"]: l["kernel"] for l in bad_doc["layers"] if l["kernel"]}
    assert BROKEN not in run and len(run) == n - 1  # structurally invalid: never handed to the kernels
    for key, k in run.items():
        assert k["dequant_exact"], key  # large but finite weights still dequantize bit for bit
        assert [r["M"] for r in k["results"]] == [1]
        assert all(r["within_bound"] for r in k["results"]) == (key != OVERFLOW), key
    (r,) = run[OVERFLOW]["results"]
    assert r["nonfinite"] > 0 and r["outside"] >= r["nonfinite"] and r["max_rel_err"] is None
    # Oracle: y_ref = x @ W_ref from the Numba weights and the same seeded x; outputs past fp16's range are inf
    w = dequantize_layer(bad_doc["path"], OVERFLOW).astype(np.float64)  # [N, K]
    assert np.isfinite(w).all() and np.abs(w).max() <= 4 * QSM_BIG
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(0)).half().double().numpy()
    y = np.abs(x @ w.T)
    assert int((y > FP16_INF_AT * 1.001).sum()) <= r["nonfinite"] <= int((y > FP16_INF_AT * 0.999).sum())
    assert bad_doc["kernel"]["ms"] == [1]


@needs_kernels
def test_kernel_table_renders_failures(bad_doc, capsys):
    from exl2fmt.cli.checks import kernel_table as _kernel_table
    from exl2fmt.cli.output import Output

    bad_doc, n = bad_doc
    _kernel_table(Output("human"), bad_doc)
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if l.startswith("model.") or l.startswith("lm_head")]
    assert len(rows) == n - 1 and not any(l.startswith(BROKEN) for l in rows)
    (bad,) = [l for l in rows if l.startswith(OVERFLOW)]
    assert "not finite OUT" in bad and bad.rstrip().endswith("FAIL")
    assert all(l.rstrip().endswith("ok") for l in rows if l is not bad)


# ------------------------------------------------------------------------------------------------ no torch


@pytest.mark.parametrize("missing", ["torch", "triton"])
def test_missing_dependency_is_one_line_exit_3(sample_dir, tmp_path, missing):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / f"{missing}.py").write_text(f'raise ImportError("no module named {missing} (test shim)")\n')
    for extra in ([], ["--json"]):
        p = cli("validate", sample_dir, "--kernel", "--device", "cpu", *extra, pythonpath=str(shim))
        assert p.returncode == 3, (p.stdout[-2000:], p.stderr[-2000:])
        assert "Traceback" not in p.stdout + p.stderr
        if extra:
            doc = json.loads(p.stdout)
            check_schema(doc, SCHEMA)
            assert doc["error"]["code"] == "KERNEL_UNAVAILABLE" and doc["exit_code"] == 3
            assert "pip install 'exl2fmt[kernels]'" in doc["error"]["message"]
        else:
            assert p.stdout == ""
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and "KERNEL_UNAVAILABLE" in lines[0], p.stderr
            assert "pip install 'exl2fmt[kernels]'" in lines[0] and missing in lines[0]
    p = cli("validate", sample_dir, pythonpath=str(shim))  # structural validation never imports them
    assert p.returncode == 0, p.stderr[-2000:]


@needs_kernels
def test_cuda_without_device_is_exit_3(sample_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    p = cli("validate", sample_dir, "--kernel", "--device", "cuda")
    assert p.returncode == 3 and "KERNEL_UNAVAILABLE" in p.stderr and "Traceback" not in p.stderr


def test_kernel_options_usage(sample_dir):
    runner = CliRunner()
    for args in (["--device", "cpu"], ["--kernel-m", "4"], ["--kernel", "--kernel-m", "0"],
                 ["--kernel", "--device", "tpu"]):
        r = runner.invoke(app, ["validate", str(sample_dir), *args])
        assert r.exit_code == 2, (args, r.output)
        assert "USAGE" in r.output and "Traceback" not in r.output
    assert ErrorCode.KERNEL_MISMATCH.category.value == "invalid"
    assert ErrorCode.KERNEL_UNAVAILABLE.category.value == "unreadable"


@needs_kernels
@pytest.mark.parametrize("bits,scope", [(4, "subset"), pytest.param(4, "full", marks=pytest.mark.slow), (3, "full")])
def test_gptq_layers_run_through_the_gptq_kernels(sample_dir, tmp_path, bits, scope):
    """The sample converted to GPTQ: 4-bit layers go through the GPTQ kernels (dequantization bit-exact, outputs
    within the bound); 3-bit codes straddle words and are reported as not run, with a warning.  The 4-bit run
    takes one layer of each shape (``GPTQ_SUBSET``), every layer with -m slow."""
    from exl2fmt.converters import convert

    g = tmp_path / "g"
    convert(sample_dir, g, "gptq", bits=bits)
    n = 14                                                                     # the head stays fp16 in GPTQ
    if scope == "subset":
        g, n = keep_layers(g, tmp_path / "sub", GPTQ_SUBSET), len(GPTQ_SUBSET)
    p = cli("validate", g, "--kernel", "--device", "cpu", "--kernel-m", "1", "--kernel-m", "33", "--json")
    doc = json.loads(p.stdout)
    checks = [c for c in doc["checks"] if c["check"] == "kernel"]
    run = {l["key"]: l["kernel"] for l in doc["layers"] if l.get("kernel")}
    if bits == 3:
        assert p.returncode == 0 and not run
        assert [(c["status"], c["code"]) for c in checks] == [("WARN", "FORMAT_UNSUPPORTED")]
        assert "14 3-bit gptq layer(s) not run" in checks[0]["message"]       # the head stays fp16 in GPTQ
        return
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert len(run) == n and (n == 14 or sorted(run) == sorted(GPTQ_SUBSET))
    for key, k in run.items():
        assert k["dequant_exact"] and k["mismatches"] == 0, key
        assert [(r["M"], r["path"]) for r in k["results"]] == [(1, "fused"), (33, "fused")]
        assert all(r["within_bound"] and 0 < r["max_rel_err"] < 2.0 ** -10 for r in k["results"]), (key, k)
    assert [(c["status"], c["code"], c["count"]) for c in checks] == [("PASS", "KERNEL_OK", n)]
    assert f"{n} GPTQ layer(s)" in checks[0]["message"] and "M=1 (fused)" in checks[0]["message"]
