"""``exl2fmt validate --run``: the whole model through the Triton kernel against the dequantized weights.

Kernel runs happen in subprocesses (Triton's interpreter must be chosen before anything imports triton; see
tests/test_validate_kernel.py).  In-process tests use the reference and float16-I/O passes only (no triton).

* The sample model, default ids: exit 0, JSON per the schema, every kernel call within the bound, the logits
  within the tolerance, which is recomputed here from the reported numbers; KL tiny, top-1 agreement 1.
* Oracle: the reference pass (float32 over the Numba-dequantized weights) equals transformers'
  LlamaForCausalLM (float32, eager) loaded from ``convert(..., "fp16")`` of the sample, within fp32 rounding.
* A kernel that reads corrupted q_weight for one layer (patched in after the reference weights are taken):
  KERNEL_MISMATCH for exactly that layer (later layers get different activations, but their own calls stay
  within the bound) and RUN_MISMATCH on the logits; exit 1.
* The verdict rules on hand-made logits (no triton): tolerance, KL, top-1 near-tie vs clear disagreement,
  non-finite logits.
* Errors: ids outside the vocabulary / not integers / without --run (USAGE, exit 2), an unsupported
  architecture (ARCH_UNSUPPORTED, exit 3), triton missing (KERNEL_UNAVAILABLE, exit 3); GPTQ layers run over
  their dequantized weights with a warning.

Runtime: about 45 s on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from typer.testing import CliRunner

from exl2fmt.cli.app import app
from exl2fmt.converters import validate_quantized_output
from exl2fmt.sample import SAMPLE_CONFIG, write_sample
from test_cli import SCHEMA, check_schema

ROOT = Path(__file__).resolve().parents[1]
HAS_KERNELS = all(importlib.util.find_spec(m) is not None for m in ("torch", "triton"))
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="needs torch and triton: pip install 'exl2fmt[kernels]'")

CORRUPT = "model.layers.0.mlp.down_proj"
FEW_IDS = [1, 17, 503, 999, 0, 250, 731, 42]


def cli(*args, pythonpath: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, pythonpath=pythonpath, timeout=timeout)


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run-sample")
    write_sample(d)
    return d


# ------------------------------------------------------------------------------------------------ the sample


@needs_kernels
def test_sample_run_passes(sample_dir):
    from exl2fmt.validate.run import RUN_MARGIN, U16, default_ids

    p = cli("validate", sample_dir, "--run", "--device", "cpu", "--json")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert p.stderr == ""
    doc = json.loads(p.stdout)
    check_schema(doc, SCHEMA["$defs"]["validate"])
    run = doc["run"]
    assert run["device"] == "cpu" and run["interpreter"] and run["arch"] == "llama"
    assert run["ids_source"] == "default" and run["ids"] == default_ids(SAMPLE_CONFIG["vocab_size"])
    assert len(run["ids"]) == 16 and len(set(run["ids"])) > 8
    assert run["linears"] == {"exl2": 15, "gptq": 0, "dense": 0}
    # every linear (14 decoder + lm_head) called once, on the tensor-core path for M = 16, within the bound
    assert sorted(c["key"] for c in run["calls"]) == sorted(
        [f"model.layers.{i}.{n}" for i in range(2) for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")] + ["lm_head"])
    for c in run["calls"]:
        assert (c["M"], c["path"], c["within_bound"], c["outside"], c["nonfinite"]) == (16, "dot", True, 0, 0), c
        assert 0 < c["max_rel_err"] < 2.0 ** -10, c  # float16 output rounding, nothing more
    k, io, th = run["kernel"], run["fp16io"], run["thresholds"]
    # the tolerance follows its documented rule from the reported numbers
    want = RUN_MARGIN * max(io["max_abs_logit_diff"], U16 * run["logit_absmax"])
    assert th["max_abs_logit_diff"] == pytest.approx(want, rel=1e-12)
    assert th["mean_kl"] == pytest.approx(want * want / 2, rel=1e-12)
    # float16 activations make the kernel path differ a little, of the size the fp16 I/O replay shows
    assert 0 < k["max_abs_logit_diff"] <= th["max_abs_logit_diff"]
    assert k["max_abs_logit_diff"] < 3 * io["max_abs_logit_diff"]
    assert 0 <= k["mean_kl"] < 1e-5 and k["max_kl"] >= k["mean_kl"]
    assert k["top1_agree"] == 1.0 and k["top1_disagree_clear"] == k["top1_disagree_near_tie"] == 0
    pos = run["positions"]
    assert [q["pos"] for q in pos] == list(range(16)) and [q["id"] for q in pos] == run["ids"]
    assert max(q["max_abs_logit_diff"] for q in pos) == k["max_abs_logit_diff"]
    assert sum(q["kl"] for q in pos) / 16 == pytest.approx(k["mean_kl"], rel=1e-9)
    assert all(q["top1_ref"] == q["top1_kernel"] for q in pos)
    runs = [c for c in doc["checks"] if c["check"] == "run"]
    assert [(c["status"], c["code"], c["count"]) for c in runs] == [("PASS", "RUN_OK", 15)]
    assert doc["result"] == "PASS" and doc["kernel"] is None


def _convert_fp16(sample_dir, out):
    from exl2fmt.converters import convert

    convert(sample_dir, out, "fp16")
    return out


def test_reference_pass_matches_transformers(sample_dir, tmp_path):
    """The reference pass (what --run compares the kernel with) is transformers' Llama over the same weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from exl2fmt.container import open_model
    from exl2fmt.detect import detect_layers
    from exl2fmt.model import load_layer
    from exl2fmt.validate.run import run_forward, run_model

    fp16 = _convert_fp16(sample_dir, tmp_path / "fp16")
    m = open_model(sample_dir)
    layers = {k: load_layer(m, k) for k in detect_layers(m.tensors)}
    ids = FEW_IDS + [999, 3]
    res = run_forward(run_model(m), layers, ids, kernels=None)
    assert res.kernel is None and res.calls == []
    hf = transformers.LlamaForCausalLM.from_pretrained(fp16, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double()
    got = res.reference.double()
    assert got.shape == want.shape == (len(ids), SAMPLE_CONFIG["vocab_size"])
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2e-5 * scale, float((got - want).abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the float16-I/O replay differs from it at float16's level, not more and not zero
    d_io = float((res.fp16io.double() - want).abs().max())
    assert 2.0 ** -14 * scale < d_io < 2.0 ** -6 * scale
    m.close()


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_reference_pass_on_other_architectures(arch, tmp_path):
    """The runner gives validate --run every architecture transformers implements.  Oracle: transformers' own
    model (float32, eager) with every linear replaced by the Numba-dequantized EXL2 weights (Phi-3's split q/k/v
    and gate/up concatenated back into its fused modules).  Gemma 2: soft-capping, sliding window (8 < 16 ids),
    tied head; Phi-3: fused projections, stored split."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tiny_models import exl2_rtn_copy, make_tiny

    from exl2fmt.container import open_model
    from exl2fmt.detect import detect_layers
    from exl2fmt.model import load_layer
    from exl2fmt.validate.run import run_forward, run_model

    src = make_tiny(arch, tmp_path / "fp16")
    keys = exl2_rtn_copy(src, tmp_path / "exl2")
    m = open_model(tmp_path / "exl2")
    layers = {k: load_layer(m, k) for k in detect_layers(m.tensors)}
    assert sorted(k for k, v in layers.items() if type(v).__name__ == "Exl2Linear") == keys
    ids = [int(v) for v in np.random.default_rng(1).integers(0, 160, 16)]
    res = run_forward(run_model(m), layers, ids, kernels=None)
    m.close()
    # Gemma 2 ties its head to the embeddings: the head runs dense (the embedding table)
    assert res.counts == {"exl2": len(keys), "gptq": 0, "dense": int("lm_head" not in keys)}
    assert ("lm_head" in keys) == (arch == "phi3") and res.kernel is None

    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    deq = {k: torch.from_numpy(np.asarray(layers[k].dequantize(), dtype=np.float32)) for k in keys}
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            base = name.rpartition(".")[0] + "."
            parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(
                name.rpartition(".")[2])
            if name == "lm_head" and "lm_head" not in deq:
                continue                                    # tied: the embedding table, as stored
            w = deq[name] if parts is None else torch.cat([deq[base + p] for p in parts])
            assert mod.weight.shape == w.shape
            mod.weight.copy_(w)
        want = hf(torch.tensor([ids])).logits[0].double()
    got = res.reference.double()
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2e-5 * scale, float((got - want).abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    d_io = float((res.fp16io.double() - want).abs().max())
    assert 2.0 ** -16 * scale < d_io < 2.0 ** -6 * scale, (d_io, scale)


def test_preflight_bounds_the_config_by_the_checkpoint(sample_dir, tmp_path):
    """Sizes from config.json are checked against the tensors before transformers builds anything from them (a
    10^9-layer skeleton would hang): a failed run check, no work."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from exl2fmt.container import open_model
    from exl2fmt.errors import ErrorCode
    from exl2fmt.validate.run import run_preflight

    d = tmp_path / "m"
    d.mkdir()
    (d / "output.safetensors").symlink_to(sample_dir / "output.safetensors")
    cfg = json.loads((sample_dir / "config.json").read_text())
    for patch, word in (({"num_hidden_layers": 10 ** 9}, "num_hidden_layers"), ({"head_dim": 10 ** 9}, "head_dim")):
        (d / "config.json").write_text(json.dumps({**cfg, **patch}))
        with open_model(d) as m:
            pre = run_preflight(m, None)
        assert pre["engine"] is None and pre["error"].code is ErrorCode.CONFIG_MISMATCH and word in pre["error"].message
    (d / "config.json").write_text(json.dumps(cfg))
    with open_model(d) as m:
        pre = run_preflight(m, None)
    assert pre["error"] is None and pre["engine"].num_layers == 2 and len(pre["ids"]) == 16


# ------------------------------------------------------------------------------------------------ failures

_CORRUPT_SCRIPT = textwrap.dedent("""
    import json, sys
    from exl2fmt.kernels import load_triton
    kt = load_triton("cpu")
    from exl2fmt.validate import validate_model

    orig = kt.Exl2KernelLinear.from_layer.__func__

    def from_layer(cls, layer, device=None):
        lin = orig(cls, layer, device)
        if layer.key == sys.argv[2]:  # the reference dequantized the file; only the kernel sees flipped bits
            half = lin.q_weight.shape[1] // 2
            lin.q_weight[:, :half] ^= 0x5A5A5A5A
        return lin

    kt.Exl2KernelLinear.from_layer = classmethod(from_layer)
    rep = validate_model(sys.argv[1], run=True, device="cpu", prompt_ids=json.loads(sys.argv[3]))
    print(json.dumps(rep.as_dict()))
""")


@needs_kernels
def test_corrupted_kernel_input_fails(sample_dir):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", _CORRUPT_SCRIPT, str(sample_dir), CORRUPT, json.dumps(FEW_IDS)],
                       capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    check_schema(doc, SCHEMA["$defs"]["validate"])
    assert doc["result"] == "FAIL" and doc["exit_code"] == 1
    fails = [(c["check"], c["code"], c["tensor"]) for c in doc["checks"] if c["status"] == "FAIL"]
    assert fails[0] == ("run", "KERNEL_MISMATCH", CORRUPT)
    assert fails[1:] and set(fails[1:]) == {("run", "RUN_MISMATCH", None)}
    assert any("max |logit_kernel - logit_ref|" in c["message"] for c in doc["checks"])
    run = doc["run"]
    assert run["ids"] == FEW_IDS and run["ids_source"] == "prompt-ids"
    bad = [c for c in run["calls"] if not c["within_bound"]]
    assert [c["key"] for c in bad] == [CORRUPT] and bad[0]["outside"] > 0
    assert len(run["calls"]) == 15  # the forward went on: later layers were checked on the diverged activations
    k, th = run["kernel"], run["thresholds"]
    assert k["max_abs_logit_diff"] > th["max_abs_logit_diff"]
    assert k["mean_kl"] > th["mean_kl"]
    assert not any(c["status"] == "PASS" and c["check"] == "run" for c in doc["checks"])


def _fake_result(ref, io, ker):
    import torch

    from exl2fmt.validate.run import RunResult

    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return RunResult(ids=list(range(len(ref))), reference=t(ref), fp16io=t(io),
                     kernel=None if ker is None else t(ker), counts={"exl2": 1, "gptq": 0, "dense": 0})


def test_verdict_rules_on_hand_made_logits():
    pytest.importorskip("torch")
    from exl2fmt.errors import ErrorCode
    from exl2fmt.validate.run import run_metrics, verdict

    ref = [[4.0, 1.0, 0.0], [2.0, 1.99, -1.0]]        # position 1: margin 0.01, a near-tie
    io = [[4.0, 1.0, 0.01], [2.0, 1.99, -1.0]]        # fp16 I/O noise D = 0.01 -> T = 4 max(0.01, 4/2048) = 0.04
    m = run_metrics(_fake_result(ref, io, [[4.03, 1.0, 0.0], [1.98, 2.0, -1.0]]))
    assert m["thresholds"]["max_abs_logit_diff"] == pytest.approx(0.04, rel=1e-6)
    k = m["kernel"]
    assert k["max_abs_logit_diff"] == pytest.approx(0.03, abs=1e-6)
    assert (k["top1_agree"], k["top1_disagree_clear"], k["top1_disagree_near_tie"]) == (0.5, 0, 1)
    # KL of position 0 by hand: p = softmax(ref), q = softmax(kernel)
    z = np.array(ref[0], dtype=np.float32).astype(np.float64)
    y = np.array([4.03, 1.0, 0.0], dtype=np.float32).astype(np.float64)  # the logits are float32
    p, q = np.exp(z) / np.exp(z).sum(), np.exp(y) / np.exp(y).sum()
    assert m["positions"][0]["kl"] == pytest.approx(float((p * np.log(p / q)).sum()), rel=1e-5)
    assert verdict(m) == []  # within T; the flipped top-1 sits on a near-tie (margin 0.01 <= 2T)

    m = run_metrics(_fake_result(ref, io, [[4.05, 1.0, 0.0], [2.0, 1.99, -1.0]]))  # 0.05 > T
    assert [c for c, _, _ in verdict(m)] == [ErrorCode.RUN_MISMATCH]
    m = run_metrics(_fake_result(ref, io, [[1.0, 4.0, 0.0], [2.0, 1.99, -1.0]]))  # a clear top-1 flip
    assert [c for c, _, _ in verdict(m)] == [ErrorCode.RUN_MISMATCH] * 3  # max diff, KL, top-1
    assert "top-1" in verdict(m)[2][1]
    m = run_metrics(_fake_result(ref, io, [[math.nan, 1.0, 0.0], [2.0, 1.99, -1.0]]))
    assert [(c, "NaN" in msg) for c, msg, _ in verdict(m)] == [(ErrorCode.RUN_MISMATCH, True)]
    m = run_metrics(_fake_result([[math.inf, 0.0]], [[math.inf, 0.0]], [[math.inf, 0.0]]))
    assert [c for c, _, _ in verdict(m)] == [ErrorCode.NONFINITE_VALUES]
    # exact toy data: D = 0, the floor of one float16 rounding of the largest logit applies
    m = run_metrics(_fake_result(ref, ref, ref))
    assert m["thresholds"]["max_abs_logit_diff"] == pytest.approx(4 * 4.0 * 2.0 ** -11)
    assert verdict(m) == []


# ------------------------------------------------------------------------------------------------ errors


def test_run_usage_errors(sample_dir):
    runner = CliRunner()
    for args in (["--prompt-ids", "1,2"], ["--run", "--prompt-ids", "1,x"], ["--run", "--prompt-ids", " , "],
                 ["--run", "--kernel-m", "4"]):
        r = runner.invoke(app, ["validate", str(sample_dir), *args])
        assert r.exit_code == 2, (args, r.output)
        assert "USAGE" in r.output and "Traceback" not in r.output


@needs_kernels
def test_ids_outside_vocab_and_unsupported_arch(sample_dir, tmp_path):
    p = cli("validate", sample_dir, "--run", "--device", "cpu", "--prompt-ids", "5,1000")
    assert p.returncode == 2 and "USAGE" in p.stderr and "1000" in p.stderr and "0..999" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "output.safetensors").write_bytes((sample_dir / "output.safetensors").read_bytes())
    cfg = json.loads((sample_dir / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    p = cli("validate", d, "--run", "--device", "cpu", "--json")
    assert p.returncode == 3, p.stderr[-2000:]
    err = json.loads(p.stdout)["error"]
    # transformers implements GPT-2, but with Conv1D layers: nothing the runner can swap substitutes into
    assert err["code"] == "ARCH_UNSUPPORTED" and "gpt2" in err["message"], err
    cfg.update(model_type="no_such_model", architectures=["NoSuchForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    p = cli("validate", d, "--run", "--device", "cpu", "--json")
    assert p.returncode == 3, p.stderr[-2000:]
    err = json.loads(p.stdout)["error"]
    assert err["code"] == "ARCH_UNSUPPORTED" and "no_such_model" in err["message"], err


def test_missing_triton_is_exit_3(sample_dir, tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "triton.py").write_text('raise ImportError("no module named triton (test shim)")\n')
    p = cli("validate", sample_dir, "--run", "--device", "cpu", pythonpath=str(shim))
    assert p.returncode == 3 and p.stdout == "", (p.stdout[-2000:], p.stderr[-2000:])
    (line,) = p.stderr.strip().splitlines()
    assert "KERNEL_UNAVAILABLE" in line and "--run needs torch and triton" in line and "exl2fmt[kernels]" in line


@needs_kernels
def test_gptq_runs_dequantized_with_a_warning(sample_dir, tmp_path):
    from exl2fmt.converters import convert

    g = tmp_path / "gptq"
    convert(sample_dir, g, "gptq")
    p = cli("validate", g, "--run", "--device", "cpu", "--prompt-ids", "3,14,15,92", "--json")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    doc = json.loads(p.stdout)
    check_schema(doc, SCHEMA["$defs"]["validate"])
    run = doc["run"]
    # the converter writes layers outside the decoder blocks (lm_head) dense, as GPTQ checkpoints do
    assert run["linears"] == {"exl2": 0, "gptq": 14, "dense": 1} and run["calls"] == []
    # no kernel in the loop: the kernel pass is the reference pass, exactly
    assert run["kernel"]["max_abs_logit_diff"] == 0.0 and run["kernel"]["top1_agree"] == 1.0
    warns = sorted(c["message"][:40] for c in doc["checks"] if c["check"] == "run")
    assert [c["code"] for c in doc["checks"] if c["check"] == "run"] == ["FORMAT_UNSUPPORTED"] * 2, warns
    assert any("GPTQ layer(s) ran over their dequantized weights" in c["message"] for c in doc["checks"])


@pytest.mark.slow  # CI time (the gemv path is also run by tests/test_runtime.py)
@needs_kernels
def test_single_id_takes_the_gemv_path(sample_dir):
    p = cli("validate", sample_dir, "--run", "--device", "cpu", "--prompt-ids", "7", "--json")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    run = json.loads(p.stdout)["run"]
    assert {(c["M"], c["path"], c["within_bound"]) for c in run["calls"]} == {(1, "gemv", True)}
    assert len(run["calls"]) == 15 and run["kernel"]["top1_agree"] == 1.0


@pytest.mark.slow
@needs_kernels
def test_quantizer_output_runs(tmp_path):
    """A tiny Qwen2 (q/k/v bias) quantized by exl2fmt's own quantizer (about 1 min on 2 cores)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=320,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1 if p.dim() == 2 else 0.3)
    model.to(torch.float16).save_pretrained(tmp_path / "fp16", safe_serialization=True)
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).integers(0, 320, size=(8, 64)))
    quantize_model(tmp_path / "fp16", tmp_path / "exl2", QuantOptions(calibration=str(tmp_path / "calib.npy"),
                                                                      rows=8, length=64, bits=4.0, device="cpu"),
                   verify_output=validate_quantized_output)
    p = cli("validate", tmp_path / "exl2", "--run", "--device", "cpu", "--json")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    run = json.loads(p.stdout)["run"]
    assert run["arch"] == "qwen2" and run["linears"]["exl2"] == 15
    assert all(c["within_bound"] for c in run["calls"]) and run["kernel"]["top1_agree"] == 1.0
    assert run["kernel"]["max_abs_logit_diff"] <= run["thresholds"]["max_abs_logit_diff"]
