"""The quantize pass's independent groups on Ray workers (``QuantFanout``; the ``distributed`` extra).

The quantize pass stays sequential across blocks (each block's Hessians come from the quantized model's own
activations), and the driver runs every forward sweep itself.  What it hands to the run's workers (the
``distributed.MeasureWorker`` actors, one per slot) is the GPTQ of groups that do not depend on each other:

* a MoE block: every expert (and a shared expert) is a chain of groups, gate/up then down.  An expert's gate/up
  inputs are the routed tokens of the block's input, whatever the other experts' weights; its down input is its
  own intermediate activation, which depends on its own gate/up only.  So the first group of every chain
  ("wave" 0) is swept at once (one sweep per chunk of Hessians that fits ``moe.LIVE_HESSIAN_BYTES``, instead of
  one sweep per expert), handed out, taken back, then the second group of every chain (wave 1) likewise.  Each
  Hessian is the same sum over the same routed tokens in the same order as in the one-process pass, which sweeps
  once per group, so every byte is the same;
* a dense block: the linears of a group that share one Hessian (q/k/v, gate/up) each go to a worker with that
  Hessian (each worker factors it itself: the same factor everywhere); a group of one linear (o_proj,
  down_proj) stays on the driver (nothing to overlap it with, and it would cost a transfer).

A task ships its Hessian (float32 [K, K]) and its weights (float32 [N, K] each), put into Ray's object store by
the driver (which holds the layer's weights for its own sweeps anyway: workers never read the source here) as
soon as its sweep made the Hessian, so the workers start while the driver sweeps the next chunk, and
returns per linear its packed tensors, its reconstruction in float16 (exact: it holds fp16 values), its plan, bpw
and proxy error.  Results are taken in the order they arrive; what they change (``lin``, the work directory's
layer files, job.json) does not depend on that order.  A worker lost in a task has the task run again elsewhere
(``distributed.MAX_ATTEMPTS``).  Memory per worker: one group's working set (its Hessian, factor, work matrix and
weights).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import ErrorCode, Exl2Error
from . import gptq
from .common import release_memory
from .distributed import MAX_ATTEMPTS, Context, lost_errors, versions
from .group_quant import Quantized, probe_digest
from ..runner.moe import hessian_chunks

__all__ = ["QuantFanout", "chains"]


def chains(groups: list[tuple[str, ...]]) -> list[list[tuple[str, ...]]]:
    """A MoE block's groups as chains (one per expert, and one for a shared expert: consecutive groups whose
    linears share the name's prefix, ``experts.3`` / ``shared_expert``), each in forward order."""
    out: dict[str, list] = {}
    for g in groups:
        prefixes = {n.rpartition(".")[0] for n in g}
        if len(prefixes) != 1:
            raise ValueError(f"a MoE group that spans experts: {g}")
        out.setdefault(prefixes.pop(), []).append(g)
    return list(out.values())


class QuantFanout:
    """The driver's side of the distributed quantize pass over the run's ``distributed.Pool``."""

    def __init__(self, pool, o):
        self.pool, self.o = pool.ready(), o
        self.ray = pool.ray
        # (the driver's bits of a small fixed problem: a worker that computes others stops the run)
        self.ctx_ref = self.ray.put(Context(None, o, versions(), pool.threads, shared_fs=False,
                                            probe=probe_digest(str(o.device))))
        self.idle = [a for a, _ in pool.actors]
        self.inflight: dict = {}          # ObjectRef -> (task index, actor)
        self.items: dict = {}             # task index -> (task, Hessian ref, weights, on_result) until taken
        self.queue: list = []             # task indices waiting for an idle worker
        self.attempts: dict = {}          # task index -> lost attempts so far
        self.count = 0
        self.replaced = 0
        self.seconds = {"quantize/worker_tasks": 0.0, "quantize/driver_wait": 0.0, "quantize/put": 0.0}

    # ---------------------------------------------------------------------------------------------- dispatch
    def submit(self, task, H_ref, weights, on_result) -> None:
        """Queue one group task (its ``GroupTask``, the Hessian's object reference, [(weight reference, bias)])
        and hand queued tasks to idle workers; ``on_result([Quantized])`` runs when it comes back."""
        k = self.count
        self.count += 1
        self.items[k] = (task, H_ref, weights, on_result)
        self.queue.append(k)
        self.dispatch()

    def dispatch(self) -> None:
        while self.queue and self.idle:
            k, a = self.queue.pop(0), self.idle.pop(0)
            task, H, weights, _ = self.items[k]
            self.inflight[a.quantize_group.remote(self.ctx_ref, task, H, weights, self.attempts.get(k, 0))] = (k, a)

    def drain(self, limit: int = 0) -> None:
        """Take results back (in the order they arrive) until at most ``limit`` tasks are queued or running."""
        while len(self.queue) + len(self.inflight) > limit:
            t = time.monotonic()
            ready, _ = self.ray.wait(list(self.inflight), num_returns=1)
            self.seconds["quantize/driver_wait"] += time.monotonic() - t
            k, actor = self.inflight.pop(ready[0])
            try:
                res = self.ray.get(ready[0])
            except lost_errors(self.ray) as e:
                self.queue.insert(0, k)
                self.lost(k, actor, self.items[k][0], e, self.attempts)
                self.dispatch()
                continue
            except self.ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, BaseException):
                    raise cause from None
                raise
            self.idle.append(actor)
            self.dispatch()
            self.seconds["quantize/worker_tasks"] += res["seconds"]
            on_result = self.items.pop(k)[3]
            on_result([_back(q) for q in res["done"]])

    def lost(self, k: int, actor, task, e: BaseException, attempts: dict) -> None:
        what = ", ".join(task.keys)
        n = attempts[k] = attempts.get(k, 0) + 1
        self.replaced += 1
        if n >= MAX_ATTEMPTS or self.replaced > MAX_ATTEMPTS * self.pool.slots:
            raise Exl2Error(ErrorCode.WORKER_LOST, f"{what}: its worker was lost {n} times ({type(e).__name__})",
                            tensor=task.keys[0]) from None
        self.pool.forget(actor)
        a, _ = self.pool.new_actor()
        self.idle.append(a)

    def put(self, x):
        t = time.monotonic()
        ref = self.ray.put(x)
        self.seconds["quantize/put"] += time.monotonic() - t
        return ref

    def _weights(self, W, names) -> list:
        return [(self.put(np.ascontiguousarray(W[n][0].detach().cpu().numpy())),
                 None if W[n][1] is None else W[n][1].detach().cpu().numpy()) for n in names]

    # ---------------------------------------------------------------------------------------------- blocks
    def group(self, qp, bi: int, group, H: torch.Tensor, W, lin, blk) -> None:
        """A dense block's group of several linears sharing ``H``: one task per linear, all with that Hessian."""
        i, kind = qp.blocks[bi]
        K = H.shape[0]
        H_ref = self.put(H.cpu().numpy())
        del H
        done: list[Quantized] = []
        took = self._taker(qp, bi, W, lin, blk, done)
        for n in group:
            self.submit(qp.group_task(i, kind, (n,), K), H_ref, self._weights(W, (n,)), took)
        self.drain(0)
        qp.record_errors(done)

    def moe_block(self, qp, bi: int, blk, W, lin, h: torch.Tensor):
        """A MoE block's groups, wave by wave (module docstring).  Returns the block's FP16 output (the first
        sweep's, every linear dense, as the one-process pass's first sweep)."""
        i, kind = qp.blocks[bi]
        ch = chains(qp.spec.groups(kind, i))
        y_d = None
        for j in range(max(len(c) for c in ch)):
            wave = [c[j] for c in ch if len(c) > j]
            Ks = {g[0]: W[g[0]][0].shape[1] for g in wave}
            by_owner = {g[0]: g for g in wave}
            done: list[Quantized] = []
            took = self._taker(qp, bi, W, lin, blk, done)
            for chunk in hessian_chunks([g[0] for g in wave], Ks):
                accs = {ow: gptq.HessianAccumulator(Ks[ow], qp.device) for ow in chunk}
                y = blk.sweep(h, lin, accs)
                if y_d is None:
                    y_d = y
                del y
                for ow in chunk:
                    g = by_owner[ow]
                    H = accs.pop(ow).take()
                    self.submit(qp.group_task(i, kind, g, Ks[ow]), self.put(H.cpu().numpy()), self._weights(W, g),
                                took)
                    del H
                release_memory()
                # results swapped in from here on change no later Hessian of this wave (module docstring); at
                # most one task per worker stays queued while the next chunk is swept (the store's bound)
                self.drain(self.pool.slots)
            self.drain(0)             # the next wave's Hessians read this wave's results
            qp.record_errors(done)
        return y_d

    @staticmethod
    def _taker(qp, bi, W, lin, blk, done: list):
        def took(qs):
            for q in qs:
                qp.take(q, bi, W, lin, blk)
            done.extend(qs)
        return took


def _back(q: Quantized) -> Quantized:
    """A worker's result as the driver uses it: the reconstruction as a torch tensor (float16)."""
    q.hat = torch.from_numpy(np.array(q.hat))
    return q
