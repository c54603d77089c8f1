"""The quantize pass on Ray workers and workers without a shared filesystem (quant/distributed_quant.py,
quant/group_quant.py, distributed.py's ``--no-shared-fs`` path; issue 36).

Oracles: the one-process run of the same options (every output file byte for byte); for the waves of a MoE
block, the one-process pass's own way of gathering an expert's Hessian (one sweep per group) against one sweep
for all of them; for the shipped weights, the measurement of the same layer read from the files.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import MOE_EXTRA, make_tiny  # noqa: E402

from exl2fmt.converters import validate_quantized_output  # noqa: E402
from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.quant.options import QuantOptions  # noqa: E402

try:
    import ray  # noqa: F401
    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'exl2fmt[distributed]')")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A 2-layer Mixtral (4 experts, top 2) and 4 x 32 calibration ids."""
    d = tmp_path_factory.mktemp("distq")
    src = make_tiny("mixtral", d / "mixtral")
    ids = d / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (4, 32)))
    return src, str(ids)


def _opts(ids, target="gptq", **kw):
    return QuantOptions(**{**dict(target=target, bits=5.0 if target == "exl2" else 4, calibration=ids, rows=4,
                                  length=32, device="cpu"), **kw})


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _spec(src):
    from exl2fmt.container import open_model
    from exl2fmt.runner.model import HFModel
    from exl2fmt.runner.weights import WeightSource

    m = open_model(src)
    return m, HFModel(m.config, WeightSource(m), "cpu", split_fused=True)


def test_moe_groups_fall_into_one_chain_per_expert(moe):
    from exl2fmt.quant.distributed_quant import chains

    m, spec = _spec(moe[0])
    try:
        ch = chains(spec.groups("mlp", 0))
    finally:
        m.close()
    assert ch == [[(f"experts.{e}.gate_proj", f"experts.{e}.up_proj"), (f"experts.{e}.down_proj",)]
                  for e in range(4)]
    assert chains([("shared_expert.gate_proj", "shared_expert.up_proj"), ("shared_expert.down_proj",)]) == \
        [[("shared_expert.gate_proj", "shared_expert.up_proj"), ("shared_expert.down_proj",)]]
    with pytest.raises(ValueError):
        chains([("experts.0.gate_proj", "experts.1.up_proj")])


def test_one_sweep_for_every_expert_gives_each_expert_the_hessian_of_its_own_sweep(moe):
    """The waves' premise: expert e's gate/up Hessian gathered in one sweep with every other expert's, while
    other experts are already quantized, is bit for bit the one a sweep for e alone gathers (the one-process
    pass); its down Hessian depends only on its own gate/up."""
    from exl2fmt.quant.gptq import HessianAccumulator
    from exl2fmt.runner.weights import dense_linear

    m, spec = _spec(moe[0])
    try:
        h = torch.randn((2, 16, 64), generator=torch.Generator().manual_seed(0))
        blk = spec.block(0, "attn", [slice(0, 1), slice(1, 2)], "cpu")
        blk.sweep(h, None, record=True)
        blk = spec.block(0, "mlp", [slice(0, 1), slice(1, 2)], "cpu")
        W = blk.weights()
        dense = {n: dense_linear(w, b) for n, (w, b) in W.items()}
        ups = [f"experts.{e}.gate_proj" for e in range(4)]
        together = {n: HessianAccumulator(64) for n in ups}
        blk.sweep(h, dense, together)
        # one expert at a time, the experts before it replaced by other weights (as if quantized)
        changed = dict(dense)
        for e, n in enumerate(ups):
            alone = HessianAccumulator(64)
            blk.sweep(h, changed, {n: alone})
            assert torch.equal(alone.H, together[n].H) and alone.rows == together[n].rows
            for r in ("gate_proj", "up_proj", "down_proj"):
                w, b = W[f"experts.{e}.{r}"]
                changed[f"experts.{e}.{r}"] = dense_linear((w * 0.5).contiguous(), b)
        downs = {f"experts.{e}.down_proj": HessianAccumulator(spec.experts.inter) for e in range(4)}
        blk.sweep(h, changed, downs)
        only = dict(dense)
        only.update({k: changed[k] for k in ("experts.2.gate_proj", "experts.2.up_proj")})
        alone = HessianAccumulator(spec.experts.inter)
        blk.sweep(h, only, {"experts.2.down_proj": alone})
        assert torch.equal(alone.H, downs["experts.2.down_proj"].H)
    finally:
        m.close()


def test_a_shipped_source_opens_no_file_and_serves_only_what_was_shipped(moe):
    from exl2fmt.quant import distributed as D

    m, spec = _spec(moe[0])
    try:
        cat = D.catalog_of(spec.src)
        s = D.ShippedSource(cat)
        assert s.files is None and s.config is None
        name = "model.layers.1.self_attn.q_proj.weight"
        assert s.has(name) and s.shape(name) == (64, 64) and s.stored_dtype(name) is torch.float16
        with pytest.raises(Exl2Error) as e:
            s.get(name)
        assert e.value.code is ErrorCode.TENSOR_NOT_FOUND
        s.ship({name: spec.src.get(name, torch.float16)})
        assert torch.equal(s.get(name), spec.src.get(name))
    finally:
        m.close()


def test_a_layer_measured_from_shipped_tensors_is_the_layer_measured_from_the_files(moe):
    """``measure_layer`` without a shared filesystem (layer 1, whose build is probed on layer 0's shipped
    weights) gives the rows and the output digest of the same call reading the source."""
    from exl2fmt.quant import distributed as D

    src, ids = moe
    m, spec = _spec(src)
    try:
        cat = D.catalog_of(spec.src)
        first, second = D.layer_tensors(spec, 0), D.layer_tensors(spec, 1)
    finally:
        m.close()
    o = _opts(ids, "exl2").resolved()
    o.batch_tokens = 4096
    h = np.random.default_rng(1).standard_normal((4, 32, 64)).astype(np.float32)
    keys = ["model.layers.1.self_attn", "model.layers.1.block_sparse_moe"]
    files = D.measure_layer(D.Context(str(src), o, D.versions(), D.thread_counts()), 1, h, [slice(0, 4)], 1, keys)
    D._WORKER.clear()
    ctx = D.Context(None, o, D.versions(), D.thread_counts(), shared_fs=False, catalog=cat, config=m.config)
    shipped = D.measure_layer(ctx, 1, h, [slice(0, 4)], 1, keys, 0, second, {0: first})
    D._WORKER.clear()
    assert shipped["rows"] == files["rows"] and shipped["digest"] == files["digest"]
    assert set(files["rows"]) == set(keys)


@needs_ray
def test_a_worker_that_quantizes_the_probe_to_other_bits_is_refused():
    """The quantize pass's tasks carry the driver's digest of a fixed GPTQ problem; a worker whose digest
    differs (other libraries or hardware) stops the run instead of writing other bits."""
    from exl2fmt.quant import distributed as D
    from exl2fmt.quant.group_quant import GroupTask, probe_digest

    task = GroupTask(("w",), ("k.w",), "gptq", None, False, (4, 128, True), dict(percdamp=0.01, act_order=True))
    H = np.eye(128, dtype=np.float32)
    w = [(np.full((128, 128), 0.01, np.float32), None)]
    o = _opts(None).resolved()
    D._WORKER.clear()
    try:
        ctx = D.Context(None, o, D.versions(), D.thread_counts(), shared_fs=False, probe="0" * 32)
        with pytest.raises(Exl2Error) as e:
            D.quantize_group(ctx, task, H, list(w))
        assert e.value.code is ErrorCode.CLUSTER_MISMATCH and "other bits" in e.value.message
        ok = D.quantize_group(D.Context(None, o, D.versions(), D.thread_counts(), shared_fs=False,
                                        probe=probe_digest("cpu")), task, H, list(w))
        assert [q.key for q in ok["done"]] == ["k.w"] and ok["done"][0].hat.dtype == np.float16
    finally:
        D._WORKER.clear()


@needs_ray
def test_gptq_on_workers_without_a_shared_filesystem_gives_the_one_process_bytes(moe, tmp_path, monkeypatch):
    """GPTQ of a MoE model on 2 workers shipped only what they need (the quantize pass never opens the source):
    the experts (waves) and q/k/v (one linear per worker) are quantized on the workers, and every output file
    equals the one-process run's."""
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = moe
    quantize_model(src, tmp_path / "ref", _opts(ids), verify_output=validate_quantized_output)
    monkeypatch.setenv("EXL2FMT_TEST_FAULT", "worker-open-source:SIGKILL")
    rep = quantize_model(src, tmp_path / "dist", _opts(ids, workers=2, shared_fs=False),
                         verify_output=validate_quantized_output)
    assert _files(tmp_path / "dist") == _files(tmp_path / "ref")
    assert rep.seconds["quantize/worker_tasks"] > 0, rep.seconds      # the groups ran on the workers


@needs_ray
@pytest.mark.slow
def test_exl2_on_workers_without_a_shared_filesystem_gives_the_one_process_bytes(moe, tmp_path, monkeypatch):
    """EXL2 of a MoE model with 2 workers that never open the source (a worker that tried would kill itself:
    the test hook): the layers are measured from shipped tensors, the experts (waves) and q/k/v (one linear per
    worker) are quantized on the workers, and every output file equals the one-process run's."""
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = moe
    quantize_model(src, tmp_path / "ref", _opts(ids, "exl2"), verify_output=validate_quantized_output)
    monkeypatch.setenv("EXL2FMT_TEST_FAULT", "worker-open-source:SIGKILL")
    rep = quantize_model(src, tmp_path / "dist", _opts(ids, "exl2", workers=2, shared_fs=False),
                         verify_output=validate_quantized_output)
    assert _files(tmp_path / "dist") == _files(tmp_path / "ref")
    assert rep.seconds["quantize/worker_tasks"] > 0, rep.seconds      # the groups ran on the workers
    assert not [w for w in rep.warnings if "lost" in w]


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe_mlp_only"])
def test_exl2_and_gptq_on_1_2_3_workers_give_the_one_process_bytes(tmp_path, arch, monkeypatch):
    """EXL2 (measurement and quantize pass) and GPTQ on 1, 2 and 3 workers, with and without the object-store
    path, on MoE models with a shared expert and with dense MLP layers among the MoE ones."""
    from exl2fmt.quant.pipeline import quantize_model

    name, kw = MOE_EXTRA.get(arch, (arch, {}))
    src = make_tiny(name, tmp_path / "src", **kw)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (4, 32)))
    for target in ("exl2", "gptq"):
        quantize_model(src, tmp_path / f"{target}-ref", _opts(str(ids), target), verify_output=validate_quantized_output)
        want = _files(tmp_path / f"{target}-ref")
        for n, shared in ((1, True), (2, False), (3, True), (3, False)):
            dst = tmp_path / f"{target}-{n}-{shared}"
            if shared:
                monkeypatch.delenv("EXL2FMT_TEST_FAULT", raising=False)
            else:                     # a worker that opened the source would die
                monkeypatch.setenv("EXL2FMT_TEST_FAULT", "worker-open-source:SIGKILL")
            quantize_model(src, dst, _opts(str(ids), target, workers=n, shared_fs=shared),
                           verify_output=validate_quantized_output)
            assert _files(dst) == want, (target, n, shared)


@needs_ray
@pytest.mark.slow
def test_a_worker_lost_in_the_quantize_pass_is_replaced_and_the_bytes_stay(moe, tmp_path, monkeypatch):
    """The worker quantizing expert 1's gate/up of layer 1 kills itself (SIGKILL) on its first attempt: the task
    runs again on a new worker and the output equals the one-process run's; with the shared-filesystem
    measurement on, the source-opening hook shows the shared path does open the source (control)."""
    from exl2fmt.quant import distributed as D
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = moe
    quantize_model(src, tmp_path / "ref", _opts(ids), verify_output=validate_quantized_output)
    monkeypatch.setenv("EXL2FMT_TEST_FAULT", "quantize-model.layers.1.block_sparse_moe.experts.1.w1:SIGKILL")
    quantize_model(src, tmp_path / "dist", _opts(ids, workers=2), verify_output=validate_quantized_output)
    assert _files(tmp_path / "dist") == _files(tmp_path / "ref")
    # control: a measuring worker on a shared filesystem opens the source, and the hook kills it every time
    monkeypatch.setenv("EXL2FMT_TEST_FAULT", "worker-open-source:SIGKILL")
    monkeypatch.setattr(D, "MAX_ATTEMPTS", 1)
    with pytest.raises(Exl2Error) as e:
        quantize_model(src, tmp_path / "out", _opts(ids, "exl2", workers=1))
    assert e.value.code is ErrorCode.WORKER_LOST
