"""The distributed EXL2 measurement (exl2fmt/quant/distributed.py, issue 36).

Oracle: the one-process run of the same command; the distributed run must give its bytes (every output file),
whatever the number of workers, after a worker is killed in the middle of a layer, and after an interrupted
driver is resumed.  The option and error checks need no Ray; the runs skip without it (``pip install
'exl2fmt[distributed]'``, which the test extra installs).
"""

from __future__ import annotations

import json
import socket
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import make_tiny  # noqa: E402

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
def tiny(tmp_path_factory):
    """A 2-layer llama and 2 x 32 calibration ids."""
    d = tmp_path_factory.mktemp("dist")
    src = make_tiny("llama", d / "src")
    ids = d / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 160, (2, 32)))
    return src, str(ids)


def _opts(ids, **kw):
    return QuantOptions(**{**dict(target="exl2", bits=4.0, calibration=ids, rows=2, length=32, device="cpu"), **kw})


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cluster_options_are_checked_and_stay_out_of_the_fingerprint():
    for bad in (0, -1, 1025, 2.5, True, "2"):
        with pytest.raises(Exl2Error) as e:
            QuantOptions(workers=bad).resolved()
        assert e.value.code is ErrorCode.USAGE and "--workers" in e.value.message
    for bad in ("localhost", "host:0", "host:x", ":6379", "ray://h:10001"):
        with pytest.raises(Exl2Error) as e:
            QuantOptions(ray_address=bad).resolved()
        assert e.value.code is ErrorCode.USAGE and "--ray-address" in e.value.message
    assert QuantOptions(target="gptq", workers=2).resolved().distributed     # its quantize pass is distributed
    with pytest.raises(Exl2Error) as e:                 # how workers get the weights: only with workers
        QuantOptions(shared_fs=False).resolved()
    assert e.value.code is ErrorCode.USAGE and "--no-shared-fs" in e.value.message and "--workers" in e.value.message
    a = QuantOptions(workers=3, ray_address="10.0.0.1:6379").resolved()
    assert a.distributed and not QuantOptions().resolved().distributed
    # the output (its manifest holds the fingerprint) and a resumed job do not depend on how it was run
    assert a.fingerprint() == QuantOptions().resolved().fingerprint()
    assert QuantOptions(workers=2, shared_fs=False).resolved().fingerprint() == QuantOptions().resolved().fingerprint()


def test_errors_cross_process_boundaries_intact():
    import pickle

    e = Exl2Error(ErrorCode.WORKER_OUT_OF_MEMORY, "out of memory", file="f", tensor="model.layers.3")
    back = pickle.loads(pickle.dumps(e))
    assert (back.code, back.message, back.file, back.tensor, str(back)) == \
        (e.code, e.message, e.file, e.tensor, str(e))


def test_without_ray_the_extra_is_named_before_any_work(tiny, tmp_path, monkeypatch):
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    monkeypatch.setitem(sys.modules, "ray", None)          # import ray -> ImportError
    with pytest.raises(Exl2Error) as e:
        quantize_model(src, tmp_path / "out", _opts(ids, workers=2))
    assert e.value.code is ErrorCode.UNSUPPORTED_INPUT
    assert "pip install 'exl2fmt[distributed]'" in e.value.message and "ray" in e.value.message
    assert list(tmp_path.iterdir()) == []                   # no work directory, no output


@needs_ray
def test_an_unreachable_head_is_refused_before_any_work(tiny, tmp_path):
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    port = _free_port()
    with pytest.raises(Exl2Error) as e:
        quantize_model(src, tmp_path / "out", _opts(ids, ray_address=f"127.0.0.1:{port}"))
    assert e.value.code is ErrorCode.CLUSTER_UNREACHABLE and f"127.0.0.1:{port}" in e.value.message
    assert list(tmp_path.iterdir()) == []


@needs_ray
def test_a_worker_with_other_versions_is_refused():
    from exl2fmt.quant import distributed as D

    ctx = D.Context("/nonexistent", _opts(None).resolved(), dict(D.versions(), torch="0.0.1"), D.thread_counts())
    with pytest.raises(Exl2Error) as e:
        D.measure_layer(ctx, 0, np.zeros((1, 1, 1), np.float32), [slice(0, 1)], 1, [])
    assert e.value.code is ErrorCode.CLUSTER_MISMATCH
    assert "torch" in e.value.message and "0.0.1" in e.value.message


@needs_ray
def test_workers_give_the_one_process_bytes_even_when_a_worker_dies(tiny, tmp_path, monkeypatch):
    """Two local workers; the worker measuring layer 1 kills itself (SIGKILL) on its first attempt: the layer is
    measured again elsewhere, the report says so, and every output file equals the one-process run's."""
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    ref = quantize_model(src, tmp_path / "ref", _opts(ids), verify_output=validate_quantized_output)
    monkeypatch.setenv("EXL2FMT_TEST_FAULT", "measure-layer-1:SIGKILL")
    seen = []
    rep = quantize_model(src, tmp_path / "dist", _opts(ids, workers=2), verify_output=validate_quantized_output,
                         progress=lambda phase, d, t, what: seen.append(what) if phase == "measure" else None)
    assert _files(tmp_path / "dist") == _files(tmp_path / "ref")
    assert [w for w in rep.warnings if "model.layers.1 was lost" in w and "measured again" in w], rep.warnings
    assert not [w for w in ref.warnings if "lost" in w]
    assert any("2/2 layers done" in w for w in seen), seen       # progress counts layers across workers
    # where the time went: the workers' phases came back with the layers (both layers' blocks measured)
    secs = rep.seconds
    assert secs["measure/worker_attn"] > 0 and secs["measure/worker_mlp"] > 0, secs
    assert 0 <= secs["measure/cluster_start_wait"] <= secs["measure"], secs


@needs_ray
@pytest.mark.slow
def test_block_gains_from_the_workers_candidates_give_the_one_process_bytes(tiny, tmp_path):
    """--block-gains measures each block's gain with its own measured candidate: the workers send those back with
    their rows, so the gains (stored in the output's measurement.json) and every output file equal the one-process
    run's, and no round-to-nearest fallback is reported."""
    from exl2fmt.quant.pipeline import quantize_model
    from exl2fmt.quant.qparams import GAINS_KEY

    src, ids = tiny
    ref = quantize_model(src, tmp_path / "ref", _opts(ids, block_gain=True))
    rep = quantize_model(src, tmp_path / "dist", _opts(ids, block_gain=True, workers=2))
    assert _files(tmp_path / "dist") == _files(tmp_path / "ref")
    assert rep.block_gains == ref.block_gains and len(ref.block_gains) == 4
    assert json.loads((tmp_path / "ref" / "measurement.json").read_text())[GAINS_KEY] == ref.block_gains
    assert not [w for w in rep.warnings + ref.warnings if "round-to-nearest" in w]


@needs_ray
@pytest.mark.slow
def test_an_interrupted_distributed_measurement_resumes_to_the_same_bytes(tiny, tmp_path):
    """The driver is interrupted once the first layer's rows are in; --resume (with another worker count, which
    is not part of the job's fingerprint) finishes with the one-process bytes."""
    from exl2fmt.quant import job as J
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    quantize_model(src, tmp_path / "ref", _opts(ids), verify_output=validate_quantized_output)

    def boom(phase, done, total, what):
        if phase == "measure" and "layers done" in what:
            raise KeyboardInterrupt

    old = J.SNAPSHOT_SECONDS
    J.SNAPSHOT_SECONDS = 0.0
    try:
        with pytest.raises(KeyboardInterrupt):
            quantize_model(src, tmp_path / "out", _opts(ids, workers=2), progress=boom,
                           verify_output=validate_quantized_output)
        work = tmp_path / ".out.exl2fmt-work"
        measured = json.loads((work / "job.json").read_text())["measured"]
        assert 2 <= len(measured) < 4                  # the first layer's two blocks, not yet the second's
        quantize_model(src, tmp_path / "out", _opts(ids, workers=1, resume=True),
                       verify_output=validate_quantized_output)
    finally:
        J.SNAPSHOT_SECONDS = old
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
    assert not work.exists()


@needs_ray
def test_a_worker_out_of_memory_is_named_with_its_layer(tiny, monkeypatch):
    """The task's own out-of-memory error (torch's, on a GPU; Python's MemoryError) becomes WORKER_OUT_OF_MEMORY
    naming the worker and the layer (called in this process: the task is a plain function)."""
    from exl2fmt.quant import distributed as D

    src, ids = tiny

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(D, "measure_block", oom)
    ctx = D.Context(str(src), _opts(ids).resolved(), D.versions(), D.thread_counts())
    with pytest.raises(Exl2Error) as e:
        D.measure_layer(ctx, 1, np.zeros((2, 32, 64), np.float32), [slice(0, 2)], 1, ["model.layers.1.self_attn"])
    assert e.value.code is ErrorCode.WORKER_OUT_OF_MEMORY and e.value.tensor == "model.layers.1"
    assert "pid" in e.value.message and "2.00 GiB" in e.value.message


@needs_ray
@pytest.mark.slow
def test_a_layer_whose_worker_keeps_dying_stops_the_run(tiny, tmp_path, monkeypatch):
    from exl2fmt.quant import distributed as D
    from exl2fmt.quant.pipeline import quantize_model

    src, ids = tiny
    monkeypatch.setenv("EXL2FMT_TEST_FAULT", "measure-layer-0:SIGKILL")
    monkeypatch.setattr(D, "MAX_ATTEMPTS", 1)
    with pytest.raises(Exl2Error) as e:
        quantize_model(src, tmp_path / "out", _opts(ids, workers=1))
    assert e.value.code is ErrorCode.WORKER_LOST and e.value.tensor == "model.layers.0"
    assert not (tmp_path / "out").exists()
