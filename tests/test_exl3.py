"""EXL3 models end to end (issue 39): small EXL3 models made by the test-side encoder (``tests/exl3_oracle.py``:
its own bit writer, ``pack_trellis``) from the trained tiny-llama fixture and from a seeded qwen2 made from
transformers' config class (hidden 64: every dimension padded to 128, q/k/v biases).  Every rate and codebook
occurs; each layer's weight is what the oracle decodes.

Checked: ``validate --deep`` passes, ``inspect``'s numbers, ``dequantize_layer`` == the oracle bit for bit,
``convert --to fp16`` loads in transformers and gives the logits of the oracle's weights, ``--to bf16`` / ``gguf``
write, and a corrupt copy of each rule fails through the CLI with its code (exit code, ``--json``, no traceback).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import exl3_oracle as R  # tests/ is on sys.path under pytest
from exl2fmt.layout import pad128

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny-llama"

#: (rate, codebook) handed to the linears in turn: all 11 rates, the three codebooks
PLAN = [(4, "mul1"), (2.5, "mul1"), (3, "mcg"), (2, "3inst"), (1.5, "mul1"), (5, "mcg"), (3.5, "mul1"),
        (6, "3inst"), (8, "mul1"), (1, "mcg"), (7, "3inst")]
HEAD = (6, "mul1")
VISION = (5, "mcg")  # exllamav3 gives a vision tower one fixed rate (vision_bits)
MARKER = {"3inst": {}, "mcg": {"mcg": np.array(R.MCG_MARKER, np.int32)}, "mul1": {"mul1": np.array(R.MUL1_MARKER, np.int32)}}


# ------------------------------------------------------------------------------------------------ the encoder


def encode_linear(rng, w: np.ndarray, rate, cb: str, bias: np.ndarray | None = None, legacy: bool = False) -> dict:
    """One EXL3 linear for ``w`` [N, K]: random symbols written by the oracle's packer (its weight is what the
    codes decode to, not an approximation of ``w``), signs x scales sized like ``w``'s rows, the marker of
    ``cb``, the bias padded to N_p (as exllamav3 writes it)."""
    N, K = w.shape
    K_p, N_p = pad128(K), pad128(N)
    tk, tn = K_p // 16, N_p // 16
    d = R.step_bits(rate)
    sym = (rng.integers(0, 1 << 16, size=(tk * tn, 256)) & ((1 << d) - 1)).astype(np.uint16)
    ring = R.states_from_symbols(sym, rate)
    rowmajor = np.empty_like(ring)
    rowmajor[:, R.tc_perm()] = ring
    states = rowmajor.reshape(tk, tn, 16, 16).transpose(0, 2, 1, 3).reshape(K_p, N_p)
    t = {"trellis": R.pack_trellis(states, rate), **MARKER[cb]}
    sign_k = rng.choice([-1.0, 1.0], K_p)
    sign_n = rng.choice([-1.0, 1.0], N_p)
    if legacy:
        for name, s in (("su", sign_k), ("sv", sign_n)):
            bits = (s < 0).reshape(-1, 16).astype(np.uint32) << np.arange(16, dtype=np.uint32)
            t[name] = bits.sum(axis=1).astype(np.uint16).view(np.int16)
    else:
        rms = np.sqrt(np.mean(np.asarray(w, np.float32) ** 2, axis=1))
        svh = np.full(N_p, 0.01, np.float32)
        svh[:N] = np.maximum(rms, 1e-4)
        t["suh"] = (sign_k * rng.uniform(0.8, 1.25, K_p)).astype(np.float16)
        t["svh"] = (sign_n * svh).astype(np.float16)
    if bias is not None:
        b = np.zeros(N_p, np.float16)
        b[:N] = np.asarray(bias, np.float32).astype(np.float16)
        t["bias"] = b
    return t


def make_exl3(src: Path, dst: Path, seed: int, keep_dense=lambda key: False) -> dict:
    """An EXL3 copy of the dense model ``src`` in ``dst``; returns {layer key: (rate, codebook, K, N)}.
    ``keep_dense(key)``: layers left unquantized (exllamav3 keeps MoE routers in float16)."""
    from safetensors.numpy import load_file, save_file

    from exl2fmt.model import find_layers

    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    from exl2fmt.names import is_mtp, is_vision

    cfg = json.loads((src / "config.json").read_text())
    layers = find_layers(tensors, {n: a.shape for n, a in tensors.items()})
    rng = np.random.default_rng(seed)
    out, plan, storage = {}, {}, {}
    for i, key in enumerate(sorted(k for k in layers if not keep_dense(k))):
        w = tensors.pop(f"{key}.weight")
        b = tensors.pop(f"{key}.bias", None)
        rate, cb = HEAD if key == "lm_head" else VISION if is_vision(key) else PLAN[i % len(PLAN)]
        t = encode_linear(rng, w.astype(np.float32), rate, cb, b)
        plan[key] = (rate, cb, w.shape[1], w.shape[0])
        for s, a in t.items():
            out[f"{key}.{s}"] = a
        storage[key] = {"stored_tensors": {f"{key}.{s}": {"shape": list(a.shape), "n_bytes": a.nbytes}
                                           for s, a in t.items()},
                        "quant_format": "exl3", "bits_per_weight": rate,
                        **({f"{cb}_multiplier": int(MARKER[cb][cb].view(np.uint32))} if cb != "3inst" else {})}
    out.update(tensors)
    save_file(out, str(dst / "model.safetensors"))
    # bits: the text decoder's linears (exllamav3 reports vision and MTP rates apart)
    nl, nextn = cfg.get("num_hidden_layers"), cfg.get("num_nextn_predict_layers")
    dec = [(r, K, N) for k, (r, _, K, N) in plan.items()
           if k != "lm_head" and not is_vision(k) and not is_mtp(k, nl, nextn)]
    bits = sum(r * pad128(K) * pad128(N) for r, K, N in dec) / sum(pad128(K) * pad128(N) for _, K, N in dec)
    qc = {"quant_method": "exl3", "version": "0.0.18", "bits": round(bits, 2), "head_bits": HEAD[0],
          "codebook": "mul1"}
    # exllamav3 writes vision_bits (one fixed rate for the tower) only when it is not 16, mtp_bits (a floor: --hq
    # promotes some MTP linears) for MTP models
    if any(is_vision(k) for k in plan):
        qc["vision_bits"] = VISION[0]
    mtp = [r for k, (r, _, _, _) in plan.items() if is_mtp(k, nl, nextn)]
    if mtp:
        qc["mtp_bits"] = min(mtp)
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": storage}, indent=2))
    return plan


def oracle_weight(model_dir: Path, key: str, K: int, N: int) -> np.ndarray:
    from safetensors.numpy import load_file

    t = {k.rsplit(".", 1)[1]: v for k, v in load_file(str(model_dir / "model.safetensors")).items()
         if k.rsplit(".", 1)[0] == key}
    return R.dequantize(t, K, N)


@pytest.fixture(scope="module")
def llama_exl3(tmp_path_factory):
    d = tmp_path_factory.mktemp("exl3") / "llama"
    return d, make_exl3(TINY, d, seed=39)


@pytest.fixture(scope="module")
def qwen2_exl3(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_hf import make_tiny

    base = tmp_path_factory.mktemp("exl3")
    src = make_tiny("qwen2", base / "qwen2-fp16", tokenizer=None)
    d = base / "qwen2"
    return d, make_exl3(src, d, seed=40)


def _cli(*args):
    from typer.testing import CliRunner

    from exl2fmt.cli.app import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    text = r.output if isinstance(r.output, str) else ""
    assert "Traceback" not in text, text[-3000:]
    return r.exit_code, text


# ------------------------------------------------------------------------------------------------ good models


@pytest.mark.parametrize("which", ["llama_exl3", "qwen2_exl3"])
def test_validate_deep_passes(which, request):
    d, plan = request.getfixturevalue(which)
    code, out = _cli("validate", d, "--deep", "--json")
    doc = json.loads(out)
    assert code == 0, [c for c in doc["checks"] if c["status"].lower() != "pass"]
    codes = {c["code"] for c in doc["checks"]}
    assert {"FORMAT_OK", "LAYERS_OK", "DECODE_OK", "BITS_OK", "CONFIG_OK"} <= codes
    assert [c for c in doc["checks"] if c["status"].lower() == "warn" and c["check"] != "loader"] == []


def test_covers_every_rate_and_codebook(llama_exl3, qwen2_exl3):
    seen = {(r, cb) for _, plan in (llama_exl3, qwen2_exl3) for r, cb, _, _ in plan.values()}
    assert {r for r, _ in seen} == set(R.RATES) and {cb for _, cb in seen} == {"3inst", "mcg", "mul1"}


@pytest.mark.parametrize("which", ["llama_exl3", "qwen2_exl3"])
def test_inspect_numbers(which, request):
    from exl2fmt import inspect_model

    d, plan = request.getfixturevalue(which)
    rep = inspect_model(d)
    assert rep["format"]["name"] == "exl3" and rep["issues"] == []
    assert rep["format"]["variant"]["head_bits"] == HEAD[0]
    rows = {r["key"]: r for r in rep["layers"]}
    assert set(rows) == set(plan)
    for key, (rate, cb, K, N) in plan.items():
        r = rows[key]
        assert (r["in_features"], r["out_features"], r["codebook"]) == (K, N, cb)
        assert r["out_features_stored"] == pad128(N) and r["plan"] == f"{rate:g}b trellis {cb}"
        assert r["bits"] == {f"{rate:g}": K * N}
        marker = 4 if cb != "3inst" else 0
        stored = (pad128(K) * pad128(N) * rate / 8 + 2 * (pad128(K) + pad128(N)) + marker
                  + (2 * pad128(N) if r["bias"] else 0))
        assert r["stored_bytes"] == stored
        assert r["bpw"] == pytest.approx(stored * 8 / (K * N + (N if r["bias"] else 0)), abs=1e-6)
    assert {h["bits"] for h in rep["bits_histogram"]["head"]} == {HEAD[0]}
    assert sum(h["weights"] for h in rep["bits_histogram"]["decoder"]) == sum(
        K * N for k, (_, _, K, N) in plan.items() if k != "lm_head")


def test_dequantize_layer_is_the_oracle(qwen2_exl3, llama_exl3):
    import exl2fmt

    for d, plan in (qwen2_exl3, llama_exl3):
        for key, (_, _, K, N) in plan.items():
            got = exl2fmt.dequantize_layer(d, key)
            want = oracle_weight(d, key, K, N)
            assert got.shape == (N, K) and np.array_equal(got.view(np.uint16), want.view(np.uint16)), key


def test_layer_api_and_legacy_signs():
    from exl2fmt.formats import layer_from_tensors

    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.02, (200, 300)).astype(np.float32)
    for legacy in (False, True):
        t = encode_linear(rng, w, 3.5, "mul1", bias=np.arange(200, dtype=np.float32) / 100, legacy=legacy)
        layer = layer_from_tensors("x.proj", t, in_features=300, out_features=200)
        assert type(layer).__name__ == "Exl3Linear" and layer.validate(deep=True) == []
        assert (layer.in_features, layer.out_features, layer.codebook, layer.rate) == (300, 200, "mul1", 3.5)
        assert layer.plan() == "3.5b trellis mul1"
        assert np.array_equal(layer.dequantize().view(np.uint16), R.dequantize(t, 300, 200).view(np.uint16))
        assert np.array_equal(layer.bias(), (np.arange(200) / 100).astype(np.float16))
        assert layer.bpw() == pytest.approx(8 * sum(a.nbytes for a in t.values()) / (300 * 200 + 200))


def _logits(model_dir: Path, state: dict | None = None):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("rotary_emb.inv_freq") for k in missing)
    model.eval()
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 7]])
    with torch.no_grad():
        return model(ids).logits.numpy()


def _convert_and_compare(d: Path, plan: dict, tmp_path: Path):
    """convert --to fp16 (CLI), load in transformers; the same architecture with the oracle's weights put in by
    hand gives the same logits."""
    import torch
    from safetensors.numpy import load_file

    out = tmp_path / "fp16"
    code, text = _cli("convert", d, out, "--to", "fp16")
    assert code == 0, text
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    written = load_file(str(out / "model.safetensors"))
    state = {}
    for key, (_, _, K, N) in plan.items():
        want = oracle_weight(d, key, K, N)
        assert np.array_equal(written[f"{key}.weight"].view(np.uint16), want.view(np.uint16)), key
        state[f"{key}.weight"] = torch.from_numpy(want.astype(np.float32))
    for n, a in load_file(str(d / "model.safetensors")).items():
        if n.rsplit(".", 1)[0] not in plan:
            state[n] = torch.from_numpy(a.astype(np.float32))
        elif n.endswith(".bias"):
            N = plan[n.rsplit(".", 1)[0]][3]
            state[n] = torch.from_numpy(a[:N].astype(np.float32))
    got = _logits(out)
    want = _logits(out, state)  # the converted directory's config, every parameter replaced by the oracle's
    assert np.isfinite(got).all() and np.array_equal(got, want)


def test_convert_fp16_logits_qwen2(qwen2_exl3, tmp_path):
    pytest.importorskip("transformers")
    _convert_and_compare(*qwen2_exl3, tmp_path)


@pytest.mark.slow
def test_convert_fp16_logits_llama(llama_exl3, tmp_path):
    pytest.importorskip("transformers")
    _convert_and_compare(*llama_exl3, tmp_path)


def test_convert_bf16_and_gguf(qwen2_exl3, tmp_path):
    import torch
    from safetensors.torch import load_file

    import exl2fmt
    from exl2fmt.container import f16_to_bf16_bits

    d, plan = qwen2_exl3
    rep = exl2fmt.convert(d, tmp_path / "bf16", "bf16")
    assert rep.verified
    w = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj"
    _, _, K, N = plan[key]
    got = w[f"{key}.weight"]
    assert got.dtype == torch.bfloat16
    assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), f16_to_bf16_bits(oracle_weight(d, key, K, N)))
    pytest.importorskip("gguf")
    code, text = _cli("convert", d, tmp_path / "m.gguf", "--to", "gguf", "--gguf-type", "f16")
    assert code == 0, text
    import gguf

    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    t = {x.name: x for x in r.tensors}
    got = np.asarray(t["blk.1.attn_k.weight"].data).reshape(N, K)
    assert np.array_equal(got.view(np.uint16), oracle_weight(d, key, K, N).view(np.uint16))


# ------------------------------------------------------------------------------------------------ corrupt copies

_KEY = "model.layers.0.mlp.down_proj"
_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 200, "intermediate_size": 300,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64,
        "quantization_config": {"quant_method": "exl3", "version": "0.0.18"}}


def _one_layer(dst: Path, rate=3, cb="mcg", **change) -> Path:
    """A model of one EXL3 linear (down_proj: 300 -> 200, padded 384 x 256), with ``change`` applied: a slot ->
    new array, or None to drop it."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    t = encode_linear(rng, rng.normal(0, 0.02, (200, 300)).astype(np.float32), rate, cb)
    for s, a in change.items():
        if a is None:
            t.pop(s, None)
        else:
            t[s] = a
    dst.mkdir(parents=True)
    save_file({f"{_KEY}.{s}": a if a.ndim == 0 else np.ascontiguousarray(a) for s, a in t.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(_CFG))
    return dst


def _rand_trellis(tiles_k, tiles_n, last):
    return np.random.default_rng(2).integers(-32768, 32768, (tiles_k, tiles_n, last)).astype(np.int16)


_NAN_SVH = np.full(256, 0.01, np.float16)
_NAN_SVH[7] = np.nan

CORRUPT = {
    # case: (changes, deep, expected code, exit code)
    "trellis_last_dim": (dict(trellis=_rand_trellis(24, 16, 20)), False, "EXL3_RATE", 1),
    "rate_out_of_range": (dict(trellis=_rand_trellis(24, 16, 144)), False, "EXL3_RATE", 1),
    "half_rate_without_mul1": (dict(trellis=_rand_trellis(24, 16, 40)), False, "EXL3_HALF_RATE", 1),
    "marker_value": (dict(mcg=np.array(12345, np.int32)), False, "EXL3_MARKER", 1),
    "both_markers": (dict(mul1=np.array(R.MUL1_MARKER, np.int32)), False, "EXL3_MARKER", 1),
    "suh_length": (dict(suh=np.ones(300, np.float16)), False, "SLOT_SHAPE", 1),
    "svh_length": (dict(svh=np.ones(200, np.float16)), False, "SLOT_SHAPE", 1),
    "svh_missing": (dict(svh=None), False, "SLOT_MISSING", 1),
    "padding_not_128": (dict(trellis=_rand_trellis(20, 16, 48), suh=np.ones(320, np.float16)), False,
                        "EXL3_PADDING", 1),
    "padding_vs_config": (dict(trellis=_rand_trellis(32, 16, 48), suh=np.ones(512, np.float16)), False,
                          "EXL3_PADDING", 1),
    "legacy_scale": (dict(scale=np.array(0.5, np.float16)), False, "FORMAT_UNSUPPORTED", 1),
    "nan_scale": (dict(svh=_NAN_SVH), True, "NONFINITE_VALUES", 1),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_copy_fails_with_its_code(case, tmp_path):
    changes, deep, want, exit_code = CORRUPT[case]
    d = _one_layer(tmp_path / "m", **changes)
    code, out = _cli("validate", d, *(["--deep"] if deep else []), "--json")
    doc = json.loads(out)
    failed = [c["code"] for c in doc["checks"] if c["status"].lower() == "fail"]
    assert want in failed and code == exit_code, (code, failed)
    # the layer API names the same code; dequantize_layer refuses with it
    import exl2fmt
    from exl2fmt.errors import Exl2Error

    with pytest.raises(Exl2Error) as e:
        exl2fmt.dequantize_layer(d, _KEY)
    assert e.value.code.value == want


def test_the_good_one_layer_model_passes(tmp_path):
    d = _one_layer(tmp_path / "m")
    code, out = _cli("validate", d, "--deep", "--json")
    assert code == 0, out


def test_tensor_storage_mismatch(qwen2_exl3, tmp_path):
    d, _ = qwen2_exl3
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    doc = json.loads((bad / "quantization_config.json").read_text())
    doc["tensor_storage"]["model.layers.0.mlp.up_proj"]["bits_per_weight"] = 9
    (bad / "quantization_config.json").write_text(json.dumps(doc))
    code, out = _cli("validate", bad, "--json")
    failed = [c for c in json.loads(out)["checks"] if c["status"].lower() == "fail"]
    assert code == 1 and [c["code"] for c in failed] == ["CONFIG_MISMATCH"]
    assert "bits_per_weight" in failed[0]["message"]
