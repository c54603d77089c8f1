"""The EXL2 measurement fanned out over Ray workers (``measure_distributed``; the ``distributed`` extra).

The measurement feeds the FP16 model's own outputs forward, so a decoder layer's measurement depends on nothing
but the FP16 hidden state at its input.  The driver (the ``exl2fmt convert`` process) starts one ``MeasureWorker``
actor per worker slot; each opens the source itself (the shared-filesystem set-up of a cluster) once, while the
driver streams the reference trajectory layer by layer (a plain forward of each layer with its FP16 weights), and
keeps it, with its warm libraries, for the whole run.  For every layer not yet measured the driver puts the
layer's input into Ray's object store and hands the layer to the next idle actor (``measure_layer``): it runs
``measure.measure_block`` for the layer's attention and MLP halves exactly as the one-process ``measure`` does,
and returns the scored rows, a digest of the layer's output and where its time went.  The driver checks that
digest against its own next input, so a worker that computes other bits (other thread counts, hardware or
libraries) stops the run (``CLUSTER_MISMATCH``) instead of giving output that differs from the one-process run.

The reference pass runs at most one layer ahead of the busy workers (so at most ``workers + 2`` layer inputs are
in the object store); the driver records each layer's rows in ``job.json`` as they arrive (in any order) and
snapshots the input of the first layer not yet measured, so a killed driver resumes (``--resume``) from there.
When an actor's process dies its layer goes to another actor, a new actor takes the lost one's place, and the
report notes it; ``MAX_ATTEMPTS`` losses of one layer stop the run (``WORKER_LOST``).

Byte identity: the output depends on the intra-op thread counts of torch and Numba (they share one OpenMP
runtime here); every worker runs with the driver's counts (``thread_env``), so ``--workers N`` gives the bytes
that the same command without ``--workers``, under the same thread settings, gives.  The data flow, the memory per
worker and how to run on a cluster: ``spec/quantizer.md``.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import socket
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..errors import ErrorCode, Exl2Error
from .common import model_blocks, release_memory
from .job import Work
from .measure import measure_block, score_plan
from .sensitivity import save_gain_candidates
from .options import QuantOptions
from .qparams import block_options
from ..runner.weights import WeightSource, dense_linear

__all__ = ["measure_distributed", "measure_layer", "quantize_group", "catalog_of", "MeasureWorker", "versions", "thread_env", "Pool", "check_address",
           "MAX_ATTEMPTS"]

#: How often one layer's task may be lost with its worker before the run stops.
MAX_ATTEMPTS = 3
#: Seconds to wait for the head's port to accept a connection before ``CLUSTER_UNREACHABLE``.
CONNECT_SECONDS = 5.0


@dataclass
class Context:
    """What every task needs besides its layer (put into the object store once per run): the source model
    ``src`` (a path every worker reads: the shared filesystem; None where workers do not open it), the resolved
    options, the driver's ``versions()`` and its thread counts (``thread_counts``).  Without a shared filesystem
    (``shared_fs`` False) a measuring worker builds its model from ``config`` (config.json's dict) and
    ``catalog`` (every tensor name of the source -> (shape, safetensors dtype)), and each task ships the layer's
    tensors."""

    src: str | None
    options: QuantOptions
    versions: dict
    threads: dict
    shared_fs: bool = True
    catalog: dict | None = None
    config: dict | None = None
    probe: str | None = None          # the driver's group_quant.probe_digest (the quantize pass's tasks)


# ------------------------------------------------------------------------------------------------ the environment

def _code_digest() -> str:
    """sha256 over the exl2fmt package's Python sources (path and bytes, in path order): a worker with another
    checkout is refused even when the version string is the same."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def versions() -> dict:
    """What must be equal on the driver and every worker for equal bits: Python, Ray, exl2fmt (its version and a
    digest of its sources), torch, transformers, numpy and Numba."""
    import numba
    import ray
    import transformers

    from .. import __version__
    return {"python": sys.version.split()[0], "ray": ray.__version__, "exl2fmt": __version__,
            "exl2fmt_sources": _code_digest(), "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "numba": numba.__version__}


def thread_counts() -> dict:
    """This process's intra-op thread counts: torch's and Numba's."""
    import numba
    return {"torch": torch.get_num_threads(), "numba": numba.get_num_threads()}


def thread_env(threads: dict) -> dict[str, str]:
    """The environment a worker process starts with so that it computes with ``threads`` (``thread_counts`` of
    the driver): OpenMP and MKL at torch's count, Numba at its own."""
    t, n = str(int(threads["torch"])), str(int(threads["numba"]))
    # (EXL2FMT_DRIVER: which run a worker process serves, for whoever looks at the machine's processes)
    env = {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "NUMBA_NUM_THREADS": n,
           "EXL2FMT_DRIVER": f"{socket.gethostname()}:{os.getpid()}"}
    if os.environ.get("EXL2FMT_TEST_FAULT"):       # the fault-injection tests' hook reaches the workers too
        env["EXL2FMT_TEST_FAULT"] = os.environ["EXL2FMT_TEST_FAULT"]
    return env


def _import_ray():
    from ..extras import require

    require("distributed", "--workers / --ray-address (distributed quantization)")
    import ray
    return ray


def check_address(o: QuantOptions) -> None:
    """``CLUSTER_UNREACHABLE`` before any work when ``o.ray_address`` names a head that does not answer."""
    if o.ray_address and o.ray_address != "auto":
        _check_reachable(o.ray_address)


def _check_reachable(address: str) -> None:
    """``CLUSTER_UNREACHABLE`` unless HOST:PORT accepts a TCP connection within ``CONNECT_SECONDS`` (Ray itself
    retries for about a minute before it gives up)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS):
            pass
    except OSError as e:
        raise Exl2Error(ErrorCode.CLUSTER_UNREACHABLE, f"--ray-address {address}: no Ray cluster answers there "
                        f"({e.strerror or e}); start one with `ray start --head --port {port}` on that machine, "
                        "or check the address and the firewall") from None


def _token_auth() -> None:
    """Join with token authentication when this machine has a Ray token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token) and RAY_AUTH_MODE does not say otherwise: what ``ray start`` does on the head, where a
    token exists; a driver that joins without it is refused as if the cluster were unreachable."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:      # Ray's own rule (it also refreshes the configuration this process has already read)
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


class Pool:
    """The Ray session and the ``MeasureWorker`` actors of one run, started in a background thread as soon as the
    run starts (``quantize_model``), so that Ray's start and each worker's imports and model set-up (seconds:
    bench/RESULTS.md) overlap the driver's own set-up and reference pass.  A local cluster of ``o.workers`` CPUs
    (each actor takes one; with a CUDA device also one GPU each of the GPUs torch sees), or the running cluster at
    ``o.ray_address``; a caller that initialised Ray already keeps its own session.  ``ready()`` waits for the
    start (raising what it raised); ``close()`` shuts down what the run started (idempotent).  While the pool is
    open, what is printed to stdout goes to stderr: Ray prints its cluster's error messages there ("A worker died
    ..."), which would break the report that ``--json`` writes to stdout."""

    def __init__(self, o: QuantOptions, src: str, catalog: dict | None = None, config: dict | None = None,
                 measure: bool = True):
        import threading

        self.o, self.src = o, str(src)
        # what the workers' set-up gets: the source's path to open (a measurement on a shared filesystem), or
        # the model's names and config (a measurement without one: ``shared_fs`` False), or neither
        self.catalog, self.config, self.measure = catalog, config, measure
        self.ray = None
        self.own = False              # this run initialised Ray (its workers then have the session's environment)
        self.actors: list = []        # [(actor, ObjectRef of its set-up call)]
        self.error: BaseException | None = None
        self.seconds = 0.0            # from the start to the actors' creation
        # (intra-op thread counts are per thread in OpenMP and Numba: read them here, in the caller's thread)
        self.threads = thread_counts()
        self.stdout = redirect_stdout(sys.stderr)
        self.stdout.__enter__()
        self.closed = False
        self.started, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._start, name="exl2fmt-ray-start", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        t0 = time.monotonic()
        try:
            ray = self.ray = _import_ray()
            if not ray.is_initialized():
                _init(ray, self.o, self.threads)
                self.own = True
            gpu = str(self.o.device).startswith("cuda")
            if self.o.workers is not None:
                self.slots = int(self.o.workers)
            else:
                res = ray.cluster_resources()
                self.slots = max(1, int(res.get("GPU" if gpu else "CPU", 1)))
            opts = {"num_cpus": 1, "num_gpus": 1 if gpu else 0, "max_restarts": 0, "max_task_retries": 0}
            if not self.own:          # a caller's session: its job-wide environment is not ours
                opts["runtime_env"] = {"env_vars": thread_env(self.threads)}
            self.actor_class = ray.remote(MeasureWorker).options(**opts)
            self.setup_ctx = ray.put(self.context())
            for _ in range(self.slots):
                self.new_actor()
        except BaseException as e:         # (raised again in the caller's thread by ready())
            self.error = e
        self.seconds = time.monotonic() - t0
        self.started.set()
        # the thread lives until the pool is closed: Ray's daemons (raylet, GCS) die with the thread that started
        # them (their parent-death signal fires when that thread exits, not the process)
        self.stop.wait()

    def context(self) -> Context:
        """The run's ``Context`` for the workers (``shared_fs`` from the options)."""
        shared = bool(getattr(self.o, "shared_fs", True))
        ship = self.measure and not shared
        return Context(self.src if (self.measure and shared) else None, self.o, versions(), self.threads,
                       shared_fs=shared, catalog=self.catalog if ship else None, config=self.config if ship else None)

    def new_actor(self) -> tuple:
        """A new actor and its set-up call (it opens the model while the driver works), counted among the
        pool's live ``actors``."""
        a = self.actor_class.remote()
        self.actors.append((a, a.setup.remote(self.setup_ctx)))
        return self.actors[-1]

    def forget(self, actor) -> None:
        """``actor``'s process is gone: no longer one of the pool's ``actors``."""
        self.actors = [(a, r) for a, r in self.actors if a is not actor]

    def ready(self) -> "Pool":
        self.started.wait()
        if self.error is not None:
            raise self.error
        return self

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.started.wait()
        try:
            if self.own and self.ray is not None and self.ray.is_initialized():
                self.ray.shutdown()
        finally:
            self.stop.set()
            self.thread.join()
            self.stdout.__exit__(None, None, None)


def _init(ray, o: QuantOptions, threads: dict) -> None:
    import logging

    kw = dict(runtime_env={"env_vars": thread_env(threads)}, logging_level=logging.ERROR,
              log_to_driver=False, include_dashboard=False)
    try:
        if o.ray_address:
            check_address(o)
            _token_auth()
            ray.init(address=o.ray_address, **kw)
        else:
            gpus = torch.cuda.device_count() if str(o.device).startswith("cuda") else 0
            # address "local": a new cluster of this run's own, even where RAY_ADDRESS or a `ray start` on this
            # machine would make a plain ray.init() join that one
            # worker_niceness 0: Ray starts its workers 15 steps nicer than itself by default (to keep its own
            # daemons responsive); here the workers are the job, and on a busy machine a nice-19 worker ran a
            # layer 2.5x slower than the driver would (bench/RESULTS.md, issue 36)
            ray.init(address="local", num_cpus=int(o.workers), num_gpus=gpus,
                     _system_config={"worker_niceness": 0}, **kw)
    except ConnectionError as e:
        raise Exl2Error(ErrorCode.CLUSTER_UNREACHABLE, f"--ray-address {o.ray_address}: {e} (a cluster with token "
                        "authentication, Ray's default, admits a driver that has its token: RAY_AUTH_TOKEN, "
                        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, as `ray get-auth-token` prints it on the head)"
                        ) from None
    except RuntimeError as e:
        if "version" in str(e).lower():
            raise Exl2Error(ErrorCode.CLUSTER_MISMATCH, f"the Ray cluster does not match this driver: {e}") from None
        raise


def layer_tensors(spec, i: int) -> dict:
    """Decoder layer ``i``'s tensors as stored (name -> torch tensor, float16 / bfloat16 / float32)."""
    pre = spec.layer_prefix(i) + "."
    return {n: spec.src.get(n, spec.src.stored_dtype(n)) for n in spec.src.names() if n.startswith(pre)}


def catalog_of(src) -> dict:
    """name -> (shape, safetensors dtype) of every tensor of ``src`` (a ``WeightSource`` or ``ModelFiles``)."""
    files = src.files if isinstance(src, WeightSource) else src
    return {n: (tuple(files.info(n).shape), files.info(n).dtype) for n in files.names()}


# ------------------------------------------------------------------------------------------------ the worker side

_WORKER: dict = {}        # per worker process: the opened source model, kept between tasks


def _worker_spec(ctx: Context, device: str):
    """The worker's ``HFModel`` of ``ctx.src`` (opened on its first task, reused after), checked against the
    driver's versions and thread counts."""
    from ..container import open_model
    from ..container.partials import fault_point
    from ..runner.model import HFModel
    from ..runner.weights import WeightSource

    key = (ctx.src, ctx.shared_fs, device)
    hit = _WORKER.get("model")
    if hit is not None and hit[0] == key:
        return hit[2]
    _worker_checked(ctx)
    if hit is not None:
        _WORKER.pop("model")[1].close()
    if not ctx.shared_fs:             # no shared filesystem: the model's skeleton, each task ships its layer
        model = ShippedSource(ctx.catalog or {})
        spec = HFModel(ctx.config, model, device, split_fused=True)
    else:
        fault_point("worker-open-source")      # (the tests' hook: a worker that would open the source dies)
        model = open_model(Path(ctx.src))
        try:
            spec = HFModel(model.config, WeightSource(model), device, split_fused=True)
        except BaseException:
            model.close()
            raise
    _WORKER["model"] = (key, model, spec)
    # what exists now (torch, transformers, Ray, the model's skeleton) lives as long as the worker: set aside from
    # the cyclic GC, as the driver does (pipeline.quantize_model), so that each block's gc.collect walks only what
    # the task made (in a worker it took 0.47 s a call on the fixture without this)
    gc.freeze()
    return spec


def _worker_checked(ctx: Context) -> None:
    """The worker runs the driver's versions (``CLUSTER_MISMATCH`` otherwise) with its thread counts (set here);
    checked once per process and context."""
    if _WORKER.get("checked") == (tuple(sorted(ctx.versions.items())), tuple(sorted(ctx.threads.items()))):
        return
    mine = versions()
    diff = {k: (v, mine.get(k)) for k, v in ctx.versions.items() if mine.get(k) != v}
    if diff:
        raise Exl2Error(ErrorCode.CLUSTER_MISMATCH, f"worker on {socket.gethostname()} differs from the driver: "
                        + "; ".join(f"{k} {w} here, {d} on the driver" for k, (d, w) in diff.items()))
    import numba
    if torch.get_num_threads() != ctx.threads["torch"]:
        torch.set_num_threads(int(ctx.threads["torch"]))
    if numba.get_num_threads() != ctx.threads["numba"]:
        numba.set_num_threads(int(ctx.threads["numba"]))
    _WORKER["checked"] = (tuple(sorted(ctx.versions.items())), tuple(sorted(ctx.threads.items())))


def _digest(h: torch.Tensor) -> str:
    return hashlib.blake2b(h.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def measure_layer(ctx: Context, i: int, h: np.ndarray, batches: list, n_score: int, keys: list[str],
                  attempt: int = 0, tensors: dict | None = None, probe: dict | None = None) -> dict:
    """Measure decoder layer ``i`` (its attention and MLP blocks whose keys are in ``keys``) on its FP16 input ``h``
    float32 [rows, T, hidden] (C order, rows in ``measure.score_plan``'s order): what a ``MeasureWorker`` runs for
    each layer, callable in any process.  Returns {"rows": {block key: [[option, bits, accuracy]]}, "gain": {block
    key: its ``measure_block`` gain candidates} (with ``block_gain``), "digest": of
    the layer's FP16 output, "where": host and pid, "seconds", "phases": {phase: seconds}} (the phases: "setup",
    this process's model opened and checked, zero once it is; "input", the input copied out of the object store;
    "attn" and "mlp", the two blocks; "digest").  ``attempt``: how many times this layer was lost before (the
    fault-injection hook, ``EXL2FMT_TEST_FAULT=measure-layer-I:SIGKILL``, fires on the first attempt only).  ``tensors``: the layer's stored tensors (name -> torch tensor in its
    stored dtype) where the worker does not read the source (``ctx.shared_fs`` False); ``probe``: {the first
    layer of each build of the model's layers: an object reference to its tensors (or the tensors)}, each fetched
    only by a worker that has not yet probed that build (``HFModel.structure_of``)."""
    from ..container.partials import fault_point

    t0 = t = time.monotonic()
    phases = {}

    def lap(name):
        nonlocal t
        now = time.monotonic()
        phases[name] = phases.get(name, 0.0) + now - t
        t = now

    where = f"{socket.gethostname()} pid {os.getpid()}"
    o = _worker_options(ctx.options)
    spec = _worker_spec(ctx, o.device)
    if not ctx.shared_fs:
        for first, got in (probe or {}).items():   # each build's structure is probed on its first layer
            if spec.probe_layer(first) is None:
                continue
            if not isinstance(got, dict):     # (an object reference: Ray leaves those inside a dict alone)
                import ray
                got = ray.get(got)
            spec.src.ship(got)
            spec.structure_of(first)
            spec.release()
        spec.src.ship(tensors or {})
    lap("setup")
    if attempt == 0:
        fault_point(f"measure-layer-{i}")
    options_of = (lambda kind: block_options(kind, extended=o.extended))
    x = torch.from_numpy(np.array(h)).to(torch.device(o.device))      # (a writable copy of the store's array)
    del h
    lap("input")
    vdir = Path(tempfile.mkdtemp(prefix="exl2fmt-measure-"))
    out, gain = {}, {}
    try:
        for kind in ("attn", "mlp"):
            key = spec.block_key(i, kind)
            cands = {} if o.block_gain else None
            rows, x = measure_block(spec, i, kind, x, batches, n_score, o, options_of, vdir / "variants",
                                    score=key in keys, gain_candidates=cands)
            if rows is not None:
                out[key] = rows
                if cands is not None:
                    gain[key] = cands
            lap(kind)
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise Exl2Error(ErrorCode.WORKER_OUT_OF_MEMORY, f"worker {where} ran out of memory measuring "
                        f"{spec.layer_prefix(i)} ({type(e).__name__}: {str(e)[:200]})",
                        tensor=spec.layer_prefix(i)) from None
    finally:
        spec.release()
        if not ctx.shared_fs:
            spec.src.ship({})
        shutil.rmtree(vdir, ignore_errors=True)
    digest = _digest(x)
    del x
    release_memory()
    lap("digest")
    return {"rows": out, "gain": gain, "digest": digest, "where": where, "seconds": time.monotonic() - t0, "phases": phases}


def _worker_options(o: QuantOptions) -> QuantOptions:
    if str(o.device).startswith("cuda"):          # Ray hands the worker one GPU: the first this process sees
        return replace(o, device="cuda")
    return o


class MeasureWorker:
    """A Ray actor that measures layers: one per worker slot, started with the run, it opens the source model once
    (``setup``, submitted as its first call, so that it runs while the driver's reference pass produces the
    first layer inputs) and keeps it, with its warm libraries, for every layer it is given (``measure_layer``)."""

    def setup(self, ctx: Context) -> dict:
        """Check the versions and threads, and open the model where this worker will measure layers
        (``_worker_spec``; not for the quantize pass alone): {"where", "seconds"}."""
        t0 = time.monotonic()
        if ctx.src is not None or (not ctx.shared_fs and ctx.config is not None):
            _worker_spec(ctx, _worker_options(ctx.options).device)
        else:
            _worker_checked(ctx)
        return {"where": f"{socket.gethostname()} pid {os.getpid()}", "seconds": time.monotonic() - t0}

    def measure_layer(self, ctx: Context, i: int, h: np.ndarray, batches: list, n_score: int, keys: list[str],
                      attempt: int = 0, tensors: dict | None = None, probe: dict | None = None) -> dict:
        """The module's ``measure_layer`` in this worker."""
        return measure_layer(ctx, i, h, batches, n_score, keys, attempt, tensors, probe)

    def quantize_group(self, ctx: Context, task, H: np.ndarray, weights: list, attempt: int = 0) -> dict:
        """The module's ``quantize_group`` in this worker (the weights come as object references inside the list,
        which Ray does not resolve: fetched here, one at a time)."""
        import ray

        weights = [(ray.get(w) if isinstance(w, ray.ObjectRef) else w, b) for w, b in weights]
        return quantize_group(ctx, task, H, weights, attempt)


def quantize_group(ctx: Context, task, H: np.ndarray, weights: list, attempt: int = 0) -> dict:
    """``group_quant.quantize_group`` of one task of the distributed quantize pass (``distributed_quant``): the
    group's Hessian ``H`` float32 [K, K] and per linear (weight float32 [N, K], bias float32 [N] or None), as
    the driver put them into the object store; callable in any process.  Returns {"done": [Quantized] with the
    reconstructions as float16 numpy arrays (exact), "where", "seconds"}.  The fault-injection hook
    ``EXL2FMT_TEST_FAULT=quantize-KEY:SIGKILL`` (KEY: the group's first linear) fires on the first attempt."""
    from ..container.partials import fault_point
    from .group_quant import quantize_group as run

    t0 = time.monotonic()
    where = f"{socket.gethostname()} pid {os.getpid()}"
    _worker_checked(ctx)
    if ctx.probe is not None and _WORKER.get("probe") != ctx.probe:
        from .group_quant import probe_digest

        if probe_digest(str(_worker_options(ctx.options).device)) != ctx.probe:
            raise Exl2Error(ErrorCode.CLUSTER_MISMATCH, f"the worker {where} quantizes a test problem to other bits "
                            "than the driver (other CPU or GPU model, BLAS, or thread settings), so the output "
                            "would differ from a one-process run")
        _WORKER["probe"] = ctx.probe
    if not _WORKER.get("frozen"):    # (as _worker_spec: each task's gc.collect then walks only what it made)
        gc.freeze()
        _WORKER["frozen"] = True
    if attempt == 0:
        fault_point(f"quantize-{task.keys[0]}")
    device = torch.device(_worker_options(ctx.options).device)
    Ht = torch.from_numpy(np.array(H)).to(device)
    del H
    ws = [(torch.from_numpy(np.array(w)).to(device), None if b is None else torch.from_numpy(np.array(b)).to(device))
          for w, b in weights]
    try:
        done = run(task, Ht, ws)
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise Exl2Error(ErrorCode.WORKER_OUT_OF_MEMORY, f"worker {where} ran out of memory quantizing "
                        f"{', '.join(task.keys)} ({type(e).__name__}: {str(e)[:200]})", tensor=task.keys[0]) from None
    for q in done:
        q.hat = q.hat.to(torch.float16).cpu().numpy()
    release_memory()
    return {"done": done, "where": where, "seconds": time.monotonic() - t0}


class ShippedSource(WeightSource):
    """The weights of a worker without a shared filesystem: every tensor's name, shape and dtype (``catalog``,
    from the driver), and the values only of the layer its current task shipped (``ship``).  It opens no file;
    asking for a tensor that was not shipped is ``TENSOR_NOT_FOUND``."""

    _DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}

    def __init__(self, catalog: dict):
        super().__init__({})
        self.catalog = catalog

    def ship(self, tensors: dict) -> None:
        self._mem = dict(tensors)

    @property
    def config(self):
        return None

    def has(self, name: str) -> bool:
        return name in self.catalog

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.catalog:
            return super().shape(name)
        return tuple(self.catalog[name][0])

    def stored_dtype(self, name: str) -> torch.dtype:
        return self._DTYPES.get(self.catalog.get(name, (None, "F32"))[1], torch.float32)

    def close(self) -> None:
        self._mem = {}


# ------------------------------------------------------------------------------------------------ the driver side

def _reference_layer(spec, i: int, h: torch.Tensor, batches: list, device) -> torch.Tensor:
    """The FP16 model's hidden state after decoder layer ``i`` for its input ``h`` (the reference sweeps of
    ``measure_block``, without its Hessians: the same operations on the same values)."""
    for kind in ("attn", "mlp"):
        blk = spec.block(i, kind, batches, device)
        if kind == "mlp":
            blk.drop_attention()
        W = blk.weights()
        y = blk.sweep(h, {n: dense_linear(w, b) for n, (w, b) in W.items()}, record=True)
        h = blk.next_input(h, y)
        del W, y
    return h


def lost_errors(ray) -> tuple:
    """The Ray exceptions that mean a worker process (or its machine, or an object it held) is gone."""
    ex = ray.exceptions
    names = ("WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "ObjectLostError",
             "OwnerDiedError", "ActorDiedError")
    return tuple(getattr(ex, n) for n in names if isinstance(getattr(ex, n, None), type))


class _Fanout:
    """The driver's side of one distributed measurement: the pool of ``MeasureWorker`` actors, the layers waiting
    for one (``queue``), the calls in flight, the results as they arrive, and where the time went (``profile``)."""

    def __init__(self, pool: Pool, spec, work: Work, progress, report, ctx_ref, batches, n_score):
        self.pool, self.ray, self.spec, self.work = pool, pool.ray, spec, work
        self.progress, self.report = progress, report
        self.ctx_ref, self.batches, self.n_score, self.slots = ctx_ref, batches, n_score, pool.slots
        self.measured = work.job["measured"]
        self.blocks = model_blocks(spec)
        self.inflight: dict = {}      # ObjectRef -> ("setup", actor) or (layer, actor)
        self.idle: list = []          # actors whose set-up is submitted and that measure nothing now
        self.queue: list = []         # layers whose input is in the store, waiting for an idle actor
        self.inputs: dict = {}        # layer -> ObjectRef of its FP16 input (until it is measured)
        self.tensors: dict = {}       # layer -> ObjectRef of its weights, without a shared filesystem (until then)
        self.probes: dict = {}        # layer -> {first layer of each build: ObjectRef of its weights}, likewise
        self.digests: dict = {}       # layer -> digest of the driver's FP16 output of the layer
        self.keys: dict = {}          # layer -> the block keys its task scores
        self.attempts: dict = {}      # layer -> lost attempts so far
        self.replaced = 0             # actors started again after a loss
        self.profile: dict = {"worker_setup": [], "worker_phases": {}, "wait": 0.0}
        for a, ref in pool.actors:
            self.inflight[ref] = ("setup", a)
            self.idle.append(a)

    def start_actor(self) -> None:
        """A new actor, its set-up submitted."""
        a, ref = self.pool.new_actor()
        self.inflight[ref] = ("setup", a)
        self.idle.append(a)

    def add(self, i: int) -> None:
        self.queue.append(i)
        self.dispatch()

    def dispatch(self) -> None:
        """Give the waiting layers, lowest first, to the idle actors (a call queues behind an actor's set-up)."""
        self.queue.sort()
        while self.queue and self.idle:
            i, a = self.queue.pop(0), self.idle.pop(0)
            ref = a.measure_layer.remote(self.ctx_ref, i, self.inputs[i], self.batches, self.n_score, self.keys[i],
                                         self.attempts.get(i, 0), self.tensors.get(i), self.probes.get(i))
            self.inflight[ref] = (i, a)

    def busy(self) -> bool:
        return any(what != "setup" for what, _ in self.inflight.values()) or bool(self.queue)

    def collect(self) -> None:
        """Wait for one call to finish; record a layer's rows (or hand a lost layer to another actor)."""
        ray = self.ray
        t = time.monotonic()
        ready, _ = ray.wait(list(self.inflight), num_returns=1)
        self.profile["wait"] += time.monotonic() - t
        ref = ready[0]
        i, actor = self.inflight.pop(ref)
        layer = "the worker's set-up" if i == "setup" else self.spec.layer_prefix(i)
        try:
            res = ray.get(ref)
        except ray.exceptions.OutOfMemoryError as e:
            raise Exl2Error(ErrorCode.WORKER_OUT_OF_MEMORY, f"Ray stopped the worker measuring {layer}: the "
                            f"machine ran out of memory ({str(e).splitlines()[0][:200]})",
                            tensor=None if i == "setup" else layer) from None
        except lost_errors(ray) as e:
            self.lost(i, actor, layer, e)
            return
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exl2Error):
                raise cause from None
            if isinstance(cause, BaseException):
                raise cause
            raise
        if i == "setup":
            self.profile["worker_setup"].append(res["seconds"])
            return
        self.idle.append(actor)
        self.dispatch()
        self.record(i, res)

    def lost(self, i, actor, layer: str, e: BaseException) -> None:
        """``actor``'s process is gone: forget it (and any other call it had), start another in its place, and
        hand its layer to the next idle actor; ``MAX_ATTEMPTS`` losses of one layer stop the run."""
        for ref, (j, a) in list(self.inflight.items()):
            if a is actor:
                del self.inflight[ref]
                if j != "setup":
                    self.queue.append(j)
        if actor in self.idle:
            self.idle.remove(actor)
        self.pool.forget(actor)
        self.replaced += 1
        if self.replaced > MAX_ATTEMPTS * self.slots:
            raise Exl2Error(ErrorCode.WORKER_LOST, f"{self.replaced} workers were lost, the last one during "
                            f"{layer} ({type(e).__name__})")
        if i != "setup":
            n = self.attempts[i] = self.attempts.get(i, 0) + 1
            if n >= MAX_ATTEMPTS:
                raise Exl2Error(ErrorCode.WORKER_LOST, f"{layer}: its worker was lost {n} times ({type(e).__name__}"
                                "; killed by the system for memory?)", tensor=layer) from None
            self.report.warnings.append(f"the worker measuring {layer} was lost ({type(e).__name__}); the layer "
                                        "was measured again on another worker")
            self.queue.append(i)
        self.start_actor()
        self.dispatch()

    def record(self, i: int, res: dict) -> None:
        layer = self.spec.layer_prefix(i)
        if res["digest"] != self.digests[i]:
            raise Exl2Error(ErrorCode.CLUSTER_MISMATCH, f"{layer}: the worker ({res['where']}) computes other FP16 "
                            "bits than the driver (other CPU or GPU model, BLAS, or thread settings), so the output "
                            "would differ from a one-process run", tensor=layer)
        for key, cands in res.get("gain", {}).items():     # (stored before the block counts as measured)
            save_gain_candidates(self.work.root, key, cands)
        for key, rows in res["rows"].items():
            self.measured[key] = rows
        for k, v in res.get("phases", {}).items():
            self.profile["worker_phases"][k] = self.profile["worker_phases"].get(k, 0.0) + v
        self.work.save()
        del self.inputs[i]
        self.tensors.pop(i, None)
        self.probes.pop(i, None)
        self.snapshot()
        if self.progress:
            done = sum(k in self.measured for k in (self.spec.block_key(j, kd) for j, kd in self.blocks))
            running = sum(what != "setup" for what, _ in self.inflight.values())
            self.progress("measure", done * 1000, len(self.blocks) * 1000,
                          f"{layer} measured by {res['where']} in {res['seconds']:.1f} s ({done // 2}/"
                          f"{self.spec.num_layers} layers done, {running} running)")

    def snapshot(self) -> None:
        """The input of the first layer not yet measured, as the one-process snapshot (every layer before it is
        in ``measured``), when one is due."""
        if not self.inputs or not self.work.snapshot_due():
            return
        first = min(self.inputs)
        h = np.array(self.ray.get(self.inputs[first]))
        self.work.snapshot("measure", 2 * first, {"h": torch.from_numpy(h)})


def measure_distributed(spec, src: str, ids_h, options_of, work: Work, o: QuantOptions, progress, report,
                        ids_shape: tuple, pool: Pool | None = None) -> tuple[dict, torch.Tensor]:
    """``measure.measure`` on Ray workers (module docstring): the same (measured rows, final FP16 hidden state in
    the calibration's row order), byte for byte.  ``src``: the source model's path, which every worker reads.
    ``pool``: the run's ``Pool``, started early, which the caller closes (None: started here and closed before
    this returns).  Where the
    time went goes into ``report.seconds`` (keys "measure/...": the driver's reference pass and its waits, the
    cluster's start, the slowest worker set-up, the workers' phases summed over the layers)."""
    own = pool is None
    pool = pool or Pool(o, src, catalog_of(spec.src), getattr(spec.src, "config", None))
    try:
        return _measure_on(pool, spec, src, ids_h, work, o, progress, report, ids_shape)
    finally:
        if own:
            pool.close()


def _measure_on(pool: Pool, spec, src: str, ids_h, work: Work, o: QuantOptions, progress, report,
                ids_shape: tuple) -> tuple[dict, torch.Tensor]:
    device = torch.device(o.device)
    blocks = model_blocks(spec)
    start, states = work.restore("measure", (*ids_shape, spec.hidden_size), blocks=len(blocks))
    if start % 2:
        raise Exl2Error(ErrorCode.CHECKPOINT_INVALID, f"job.json: the measurement's snapshot is at block {start}, "
                        "inside a layer", file=str(work.job_path))
    measured = work.job["measured"]
    if progress and work.resumed:
        done = sum(spec.block_key(i, kind) in measured for i, kind in blocks)
        progress("measure", done * 1000, len(blocks) * 1000, f"resumed at block {done + 1} of {len(blocks)}")
        work.resumed = False
    h = ids_h() if states is None else states["h"]
    rows, T = h.shape[0], h.shape[1]
    order, batches, n_score = score_plan(rows, T, o.batch_tokens, o.measure_rows)
    if order is not None and states is None:
        h = h.index_select(0, order.to(h.device))
    h = h.to(device)
    t = time.monotonic()
    ray = pool.ready().ray
    t_start_wait, t_ref = time.monotonic() - t, 0.0
    fan = _Fanout(pool, spec, work, progress, report, ray.put(pool.context()), batches, n_score)
    if progress:
        progress("measure", start * 500, len(blocks) * 1000, f"starting {pool.slots} workers")
    firsts: dict = {}                 # without a shared filesystem: the first layer of each build, for its probe
    for i in range(start // 2, spec.num_layers):
        keys = [spec.block_key(i, k) for k in ("attn", "mlp") if spec.block_key(i, k) not in measured]
        if keys:
            fan.keys[i] = keys
            fan.inputs[i] = ray.put(h.detach().cpu().numpy())
            if not o.shared_fs:       # the layer's stored tensors travel with its task
                fan.tensors[i] = ray.put(layer_tensors(spec, i))
                if not firsts:        # (held for the whole measurement: one layer per build)
                    firsts.update({f: ray.put(layer_tensors(spec, f)) for f in spec.build_firsts()})
                fan.probes[i] = firsts
        t = time.monotonic()
        h = _reference_layer(spec, i, h, batches, device)
        release_memory()
        t_ref += time.monotonic() - t
        if keys:
            fan.digests[i] = _digest(h)
            fan.add(i)
        while len(fan.queue) > 1:       # the reference pass runs at most one layer ahead of the workers
            fan.collect()
    spec.release()
    while fan.busy():
        fan.collect()
    prof = fan.profile
    report.seconds.update({"measure/cluster_start": pool.seconds, "measure/cluster_start_wait": t_start_wait,
                           "measure/reference": t_ref, "measure/driver_wait": prof["wait"],
                           "measure/worker_setup_max": max(prof["worker_setup"], default=0.0),
                           **{f"measure/worker_{k}": v for k, v in prof["worker_phases"].items()}})
    ordered = {k: measured[k] for k in (spec.block_key(i, kind) for i, kind in blocks) if k in measured}
    measured.clear()                 # in block order, as the one-process measurement fills it
    measured.update(ordered)
    if order is not None:
        h = torch.empty_like(h).index_copy_(0, order.to(h.device), h)
    return measured, h
