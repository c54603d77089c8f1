"""EXL2 -> GPTQ for vLLM (issue 35): the exact re-pack says when its result needs activation order and offers the
command that re-quantizes; ``--order static`` re-quantizes the decoded weights (calibrated GPTQ, desc_act false) and
reports each layer's weight error; the compatibility verdicts follow vLLM 0.32's own rules
(``AutoGPTQConfig.TYPE_MAP``, ``normalize_and_validate_gptq_desc_act``, ``CPUWNA16LinearKernel.can_implement``)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from exl2fmt import ErrorCode, Exl2Error, dequantize_layer
from exl2fmt.converters import convert
from exl2fmt.converters.exl2_to_gptq import gptq_compatibility, static_order_command, vllm_group_size
from exl2fmt.sample import write_sample

OK_SHAPES = [(256, 256), (768, 256), (256, 768)]   # (N, K): K a multiple of every group size


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.mark.parametrize("bits,gs,sym,act,shapes,vllm,cpu", [
    (4, 128, True, False, OK_SHAPES, True, True),
    (4, -1, True, True, OK_SHAPES, True, True),       # act-order with one group is no act-order (vLLM drops it)
    (4, 128, True, True, OK_SHAPES, False, False),    # desc_act: refused on every platform
    (8, 128, True, False, OK_SHAPES, True, False),    # the CPU kernel is 4-bit only
    (4, 128, False, False, OK_SHAPES, False, False),  # no asymmetric GPTQ in vLLM 0.32
    (3, 64, True, False, OK_SHAPES, False, False),
    (4, 32, True, False, [(256, 256), (100, 256)], True, False),   # N not a multiple of 32
    (4, 128, True, False, [(576, 576), (1536, 576)], False, False),  # SmolLM2: K = 576 needs 64-row groups
    (4, 64, True, False, [(576, 576), (576, 1536)], True, True),
])
def test_vllm_verdicts_follow_vllms_rules(bits, gs, sym, act, shapes, vllm, cpu):
    c = gptq_compatibility(bits, gs, sym, act, shapes)
    assert c["vllm"]["compatible"] is vllm and c["vllm_cpu"]["compatible"] is cpu, c
    assert "AVX-512" in c["vllm_cpu"]["note"]
    if act and gs != -1:
        assert "--order static" in c["summary"] and not c["vllm_gptq_marlin"]["compatible"]
    elif cpu:
        assert c["summary"].endswith("vLLM's CPU kernel: yes (x86 with AVX-512)")


def test_static_order_command_is_quoted_for_a_shell():
    cmd = static_order_command("/m/my model", "/out/x y/", 64)
    assert shlex.split(cmd) == ["exl2fmt", "convert", "/m/my model", "/out/x y-static", "--to", "gptq", "--bits", "4",
                                "--group-size", "64", "--order", "static"]
    assert vllm_group_size([4096, 11008]) == 128 and vllm_group_size([576, 1536]) == 64
    assert vllm_group_size([256, 704]) == 64 and vllm_group_size([256, 736]) == 32 and vllm_group_size([]) == 128
    assert "--group-size 64" in gptq_compatibility(4, 128, True, False, [(576, 576)])["vllm"]["reasons"][0]


@pytest.fixture(scope="module")
def exl2_sample(tmp_path_factory):
    d = tmp_path_factory.mktemp("rq")
    src = write_sample(d / "exl2")
    ids = d / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 1000, (4, 32)))
    return src, ids


def test_the_exact_repack_offers_the_static_command(exl2_sample, tmp_path):
    src, _ = exl2_sample
    rep = convert(src, tmp_path / "g", "gptq", bits=4)
    assert rep.quantization_config["desc_act"] is True     # EXL2's permutation: act-order g_idx
    cmd = rep.compatibility["vllm"]["fix"]
    assert not rep.compatibility["vllm"]["compatible"] and not rep.compatibility["vllm_cpu"]["compatible"]
    warn = [w for w in rep.warnings if "needs activation order" in w]
    assert len(warn) == 1 and warn[0].endswith(cmd)
    argv = shlex.split(cmd)
    assert argv[2:4] == [str(src), str(tmp_path / "g") + "-static"] and argv[-2:] == ["--order", "static"]
    assert argv[argv.index("--group-size") + 1] == "64"     # the sample's K = 704 (MLP down) takes 64-row groups


def test_order_static_without_a_tokenizer_asks_for_calibration_and_leaves_nothing(exl2_sample, tmp_path):
    pytest.importorskip("torch")
    src, _ = exl2_sample
    before = _digest(src)
    with pytest.raises(Exl2Error) as e:
        convert(src, tmp_path / "g", "gptq", quant={"order": "static"})
    assert e.value.code is ErrorCode.CALIBRATION_INVALID and "--calibration" in e.value.message
    assert not any(tmp_path.iterdir()) and _digest(src) == before


@pytest.fixture(scope="module")
def static_gptq(exl2_sample, tmp_path_factory):
    pytest.importorskip("torch")
    src, ids = exl2_sample
    before = _digest(src)
    out = tmp_path_factory.mktemp("rq-out") / "gptq-static"
    rep = convert(src, out, "gptq", bits=4, group_size=32,   # 32 divides the sample's K = 704 (vLLM needs it)
                  quant={"order": "static", "calibration": str(ids), "rows": 4, "length": 32, "device": "cpu"})
    return src, out, rep, before


def test_order_static_requantizes_without_activation_order(static_gptq):
    from exl2fmt.container import open_model

    src, out, rep, before = static_gptq
    assert _digest(src) == before                          # the source is only read
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # what vLLM's AutoGPTQConfig.from_config reads, with the values its CPU kernel takes
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"], qc["lm_head"]) == \
        ("gptq", 4, 32, False, True, False)
    assert qc["checkpoint_format"] == "gptq" and qc["meta"]["exl2fmt_order"] == "static"
    side = json.loads((out / "quantize_config.json").read_text())
    assert side["desc_act"] is False and side["bits"] == 4 and side["sym"] is True
    m = open_model(out)
    try:
        gidx = [n for n in m.names() if n.endswith(".g_idx")]
        for n in gidx:                                     # groups of consecutive input rows
            g = m.get(n)
            assert np.array_equal(g, np.arange(g.size) // 32), n
    finally:
        m.close()
    assert rep.compatibility["vllm"]["compatible"] and rep.compatibility["vllm_cpu"]["compatible"], rep.compatibility
    assert rep.options["source_format"] == "exl2" and rep.source == str(src)
    assert any("re-quantized" in w for w in rep.warnings)


def test_order_static_reports_each_layers_weight_error_against_the_exl2_decode(static_gptq):
    src, out, rep, _ = static_gptq
    assert len(rep.layers) == 14
    for l in rep.layers:
        ref = dequantize_layer(src, l.key).astype(np.float64)     # the EXL2 decode (ExLlamaV2's fp16)
        got = dequantize_layer(out, l.key).astype(np.float64)     # the written GPTQ, decoded
        want = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert l.weight_error == pytest.approx(want, rel=1e-9), l.key
        assert 0 < l.weight_error < 0.5, l.key                    # lossy, but a 4-bit re-quantization
    d = rep.as_dict()
    assert all(isinstance(x["weight_error"], float) for x in d["layers"])
    assert any("weight error against the source's decode" in s for s in rep.summary_lines())


@pytest.mark.slow
def test_order_static_through_the_cli_prints_the_weight_error_column(exl2_sample, tmp_path):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from exl2fmt.cli.app import app

    src, ids = exl2_sample
    r = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "g"), "--to", "gptq", "--order", "static",
                                 "--group-size", "32", "--calibration", str(ids), "--rows", "2", "--length", "32",
                                 "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["compatibility"]["vllm_cpu"]["compatible"] and len(doc["layers"]) == 14
    assert all(x["weight_error"] > 0 for x in doc["layers"])


def test_the_vllm_bench_skips_without_avx512_and_says_why(tmp_path):
    """bench/vllm_cpu_check.py: vLLM's CPU GPTQ kernel exists only in its AVX-512 builds, so the check skips, with
    the reason, on a CPU without avx512f, on another architecture, and where vLLM cannot be imported."""
    from conftest import load_bench

    b = load_bench("vllm_cpu_check")
    avx2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
    avx512 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16\n"
    why = b.cpu_skip_reason(avx2, "x86_64")
    assert "no AVX-512" in why and "cpu_gemm_wna16" in why
    assert b.cpu_skip_reason(avx512, "x86_64") is None
    assert "aarch64" in b.cpu_skip_reason(avx512, "aarch64")
    why, version = b.vllm_skip_reason(str(tmp_path / "no-python"))
    assert version is None and "no interpreter" in why
    if importlib.util.find_spec("vllm") is None:      # the project's own environment has no vLLM
        import sys

        why, version = b.vllm_skip_reason(sys.executable)
        assert version is None and why.startswith(f"{sys.executable} cannot import vllm"), why


@pytest.mark.slow
def test_a_gptq_quantized_from_fp16_reports_whether_vllm_loads_it(tmp_path):
    """The FP16 -> GPTQ quantizer states the same verdicts, read from what it wrote: 512-row groups cannot split
    the fixture's K = 256 and 768 (vLLM sizes the scales as K // group size), 128-row groups can."""
    pytest.importorskip("torch")
    fixture = Path(__file__).parent / "fixtures" / "tiny-llama"
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 2048, (2, 32)))
    common = {"calibration": str(ids), "rows": 2, "length": 32, "device": "cpu"}
    bad = convert(fixture, tmp_path / "g512", "gptq", bits=4, group_size=512, quant=common)
    assert not bad.compatibility["vllm"]["compatible"]
    assert bad.compatibility["vllm"]["reasons"][0].startswith("K = 256, 768 not a multiple of the group size 512")
    good = convert(fixture, tmp_path / "g128", "gptq", bits=4, group_size=128, quant=common)
    assert good.compatibility["vllm"]["compatible"] and good.compatibility["vllm_cpu"]["compatible"]
