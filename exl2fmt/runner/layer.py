"""One decoder layer of the model runner (``model.HFModel``) with real weights (``LayerRunner``: substitute
linears swapped in, linear inputs captured, the attention or MLP module's result recorded or replayed), and the
attention or MLP half of a layer over all calibration rows in batches (``LayerBlock``: what the quantizer sweeps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hooks import Stop, first, with_first, without_first
from .moe import pad_expert_hessian, routed_forward
from .weights import Linear

__all__ = ["LayerRunner", "LayerBlock"]


class LayerRunner:
    """Decoder layer ``i`` of ``eng`` (its ``model.HFModel``) with real weights on ``device``."""

    def __init__(self, eng: Any, i: int, device: torch.device):
        self.eng, self.i, self.device = eng, i, device
        self.layer = eng.layers[i]
        self.saved = eng.materialize(self.layer, eng.layer_prefix(i), device)
        self.attn_dropped = False       # drop_attention()
        self.attn_cache: list | None = None
        self.routed: list = []          # per forward with the experts driven: tokens routed to each expert

    def free(self) -> None:
        self.eng.unmaterialize(self.saved)
        self.saved = []
        self.attn_cache = None
        self.attn_dropped = False

    def _attn_params(self) -> list:
        """The ``saved`` entries of the attention module's parameters."""
        child = self.layer.get_submodule(self.eng.structure_of(self.i).attn_child)
        mods = {id(m) for m in child.modules()}
        return [e for e in self.saved if id(e[0]) in mods]

    def drop_attention(self) -> None:
        """Free the attention module's float32 parameters (meta again) while only replays of its recorded result
        run: the MLP half's sweeps.  A later forward that runs the attention
        module loads them again (``forward``)."""
        entries = self._attn_params()
        if self.eng.is_moe(self.i) or any(key is None for *_, key in entries):
            return                       # (fused-expert parameters are not reloaded by key: kept)
        self.eng.unmaterialize(entries)
        self.attn_dropped = True

    def drop_linear(self, n: str) -> bool:
        """Free linear ``n``'s float32 weight (meta again) for the rest of the layer's life: every later forward
        must pass a substitute for it (one that runs the module's own weight fails on the meta tensor).  Not for
        rows of a fused module or for MoE layers (False: kept)."""
        if n in self.eng.part_of or n not in self.eng.path_of or self.eng.is_moe(self.i):
            return False
        mod = self.module(n)
        entries = [e for e in self.saved if e[0] is mod and e[1] == "weight"]
        self.eng.unmaterialize(entries)
        return bool(entries)

    def _reload_attention(self) -> None:
        for sub, leaf, _, key in self._attn_params():
            sub._parameters[leaf] = nn.Parameter(self.eng.src.get(key, torch.float32, self.device),
                                                 requires_grad=False)
        self.attn_dropped = False

    def module(self, name: str) -> nn.Linear:
        return self.layer.get_submodule(self.eng.path_of[name])

    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        out = {}
        for n in self.eng.layer_linears(self.i):
            m = self.module(n)
            w, b = m.weight.data, None if m.bias is None else m.bias.data
            if n in self.eng.part_of:
                a, e = self.eng.part_of[n]
                w, b = w[a:e].clone(), None if b is None else b[a:e].clone()
            out[n] = (w, b)
        lay = self.eng.experts
        if self.eng.is_moe(self.i):
            mod = self.layer.get_submodule(lay.path)
            I = lay.inter
            for e in range(lay.num_experts):      # views of the fused parameters (contiguous row blocks)
                out[lay.name(e, "gate_proj")] = (mod.gate_up_proj.data[e, :I], None)
                out[lay.name(e, "up_proj")] = (mod.gate_up_proj.data[e, I:], None)
                out[lay.name(e, "down_proj")] = (mod.down_proj.data[e], None)
        return out

    def forward(self, h: torch.Tensor, subs: Mapping[str, Linear] | None = None, capture: dict | None = None,
                stop_mid: bool = False, replay_attn: Any = None, record_attn: list | None = None,
                stop_at: str | None = None, replay_mlp: Any = None,
                tail: str | None = None, tail_out: list | None = None) -> torch.Tensor | None:
        """Run the layer on h float [B, T, hidden] with ``subs`` (name -> Linear) swapped in; ``capture`` receives
        the inputs of the linears (name -> float [B, T, K]); ``stop_mid`` returns the residual stream between
        attention and MLP instead of the layer's output; ``replay_attn`` is a recorded result of the attention
        module to use instead of running it; ``record_attn`` (a list) receives the attention module's result;
        ``stop_at`` (a linear's name) ends the forward once that linear's input is captured, returning None;
        ``replay_mlp`` is a result of the MLP module to use instead of running it.  ``tail`` (a linear's name, with
        ``capture``): that linear is not computed, and the forward ends when the attention or MLP module that
        called it returns; ``tail_out`` (a list) receives that module's result with the linear's output left out
        (``without_first``), or None when the module did not return the linear's output as it came (then its
        result cannot be rebuilt from the captured input)."""
        eng = self.eng
        if self.attn_dropped and replay_attn is None:
            self._reload_attention()
        B, T = h.shape[:2]
        args, kw = eng.layer_kwargs(B, T, h.device)[self.i]
        patched: list = []
        hooks: list = []
        emitted: list = []       # the tail linear's stand-in output
        by_module: dict = {}
        for n in eng.layer_linears(self.i):
            by_module.setdefault(eng.path_of[n], []).append(n)
        for path, names in by_module.items():
            mod = self.layer.get_submodule(path)
            fns = [(subs or {}).get(n) for n in names]
            if all(f is None for f in fns) and capture is None:
                continue
            parts = [eng.part_of.get(n) for n in names]

            def fwd(x, _fns=fns, _names=names, _mod=mod, _parts=parts):
                ys = []
                for f, n, rows in zip(_fns, _names, _parts):
                    if capture is not None:
                        capture[n] = x
                    if n == stop_at:
                        raise Stop
                    if n == tail:            # a stand-in of the output's shape: the module's result is rebuilt
                        N = _mod.weight.shape[0] if rows is None else rows[1] - rows[0]
                        ys.append(x.new_empty((*x.shape[:-1], N)))
                        emitted.append(ys[-1])
                    elif f is not None:
                        ys.append(f(x))
                    elif rows is None:
                        ys.append(F.linear(x, _mod.weight, _mod.bias))
                    else:
                        a, e = rows
                        ys.append(F.linear(x, _mod.weight[a:e], None if _mod.bias is None else _mod.bias[a:e]))
                return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
            mod.forward = fwd
            patched.append(mod)
        lay = eng.experts
        if eng.is_moe(self.i) and (capture is not None or any(n in (subs or {}) for n in eng.expert_names)):
            experts = self.layer.get_submodule(lay.path)
            experts.forward = routed_forward(experts, lay, subs, capture, self.routed)
            patched.append(experts)
        st = eng.structure_of(self.i)
        attn = self.layer.get_submodule(st.attn_child)
        if replay_mlp is not None:
            mlp = self.layer.get_submodule(st.mlp_child)
            mlp.forward = lambda *a, **k: replay_mlp
            patched.append(mlp)
        if tail is not None:
            def ended(m, a, o):
                tail_out.append(without_first(o) if emitted and first(o) is emitted[0] else None)
                raise Stop
            child = st.attn_child if eng.kind_of[tail] == "attn" else st.mlp_child
            hooks.append(self.layer.get_submodule(child).register_forward_hook(ended))
        if replay_attn is not None:
            attn.forward = lambda *a, **k: replay_attn
            patched.append(attn)
        elif record_attn is not None:
            def rec(m, a, o):
                record_attn.append(o)
            hooks.append(attn.register_forward_hook(rec))
        got: list = []
        if stop_mid and st.mid_norm is not None:
            def stop(m, a, kw_):
                got.append(a[0] if a else kw_["hidden_states"])
                raise Stop
            hooks.append(self.layer.get_submodule(st.mid_norm).register_forward_pre_hook(
                stop, with_kwargs=True))
        try:
            with torch.no_grad():
                out = first(self.layer(h, *args, **kw))
        except Stop:
            out = got[0] if got else None
        finally:
            for m in patched:
                del m.forward
            for hk in hooks:
                hk.remove()
        return out


@dataclass
class _Tail:
    """What ``LayerBlock.sweep(tail=name)`` keeps per batch: the linear's input float [B, T, K] and its module's
    result without the linear's output (``without_first``)."""

    name: str
    inputs: list
    results: list


class LayerBlock:
    """The attention or MLP half of a decoder layer over all calibration rows in batches.

    ``sweep(h, linears, hessians, out)`` takes the *layer's* input h float [rows, T, hidden] for both halves: the
    attention half returns the residual stream after attention (the whole layer's output for parallel-residual
    layers); the MLP half returns the layer's output with the attention result replayed from what the last
    ``sweep(..., record=True)`` of the attention half recorded."""

    def __init__(self, runner: LayerRunner, kind: str, batches: list[slice]):
        #: the decoder layer this block is half of (its weights, recorded attention results)
        self.runner: LayerRunner = runner
        self.kind, self.batches = kind, batches
        self.names = runner.eng.linear_names(kind, runner.i)
        #: MoE blocks: tokens routed to each expert in the last sweep that drove the experts (None otherwise)
        self.expert_tokens: list[int] | None = None
        #: MoE blocks: expert linear -> prior tokens its Hessian was padded with (moe.pad_expert_hessian)
        self.padded: dict[str, int] = {}
        #: what the last sweep(tail=...) kept for finish() (None: finish runs the block)
        self.tail: _Tail | None = None

    def owner(self, name: str) -> str:
        """The linear whose input Hessian ``name`` shares (the first of its group)."""
        return self.runner.eng.owner(name, self.runner.i)

    def tapeable(self) -> list[str]:
        """The linears the forward calls once per batch with all of the batch's tokens (routed experts are not:
        they see the tokens routed to them)."""
        dense = set(self.runner.eng.layer_linears(self.runner.i))
        return [n for n in self.names if n in dense]

    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        w = self.runner.weights()
        return {n: w[n] for n in self.names}

    def drop_attention(self) -> None:
        """The layer runner's ``drop_attention``: free the attention module's weights while only replays of its
        recorded result run (the MLP half's sweeps)."""
        self.runner.drop_attention()

    def drop_linear(self, name: str) -> bool:
        """The layer runner's ``drop_linear``: free linear ``name``'s weight for the rest of the layer's life
        (every later sweep passes a substitute for it); False when it is kept."""
        return self.runner.drop_linear(name)

    def sweep(self, h: torch.Tensor, linears: Mapping[str, Linear] | None, hessians: dict | None = None,
              out: torch.Tensor | None = None, record: bool = False, stop_at: str | None = None,
              tail: str | None = None) -> torch.Tensor | None:
        """One forward of the block over all batches (see the class docstring); ``stop_at`` (a dense linear of
        the block whose input ``hessians`` collects) ends each batch's forward once that input is captured: the
        sweep then returns None (a sweep that only gathers a later group's Hessian skips the rest of the block).

        ``tail`` (such a linear, the last one its attention or MLP module calls) also returns None, and keeps
        what ``finish`` needs to make the block's output once that linear is replaced, without running the block
        again: per batch the linear's input (float [B, T, K]; the caller budgets rows x T x K x 4 bytes) and the
        module's result without the linear's output.  The linear itself is not computed.  When the module does
        not return that output as it came (so its result cannot be rebuilt), nothing is kept and ``finish``
        runs the block."""
        eng = self.runner.eng
        for name in (stop_at, tail):
            if name is not None and (name not in eng.layer_linears(self.runner.i) or record or not hessians
                                     or name not in hessians or (stop_at and tail)):
                raise ValueError(f"{name!r}: not a dense linear whose Hessian this sweep collects")
        self.tail = None
        if tail is not None:
            st = eng.structure_of(self.runner.i)
            if eng.child_of[tail] != (st.attn_child if self.kind == "attn" else st.mlp_child):
                stop_at, tail = tail, None       # its module is not the one finish() replays: nothing to keep
        kept: _Tail | None = _Tail(tail, [], []) if tail is not None else None
        y = None if stop_at is not None or tail is not None else out if out is not None else torch.empty_like(h)
        if self.kind == "attn" and record:
            self.runner.attn_cache = []
        lay = eng.experts
        experts = [o for o in (hessians or {}) if o in eng.expert_names] if self.kind == "mlp" else []
        prior = None
        if any(eng.role(o) != "down_proj" for o in experts):
            # all tokens entering the MoE block, in an accumulator of the caller's kind (gptq.HessianAccumulator)
            prior = type(hessians[experts[0]])(lay.hidden, h.device)
        self.runner.routed = []
        for bi, sl in enumerate(self.batches):
            cap = {} if hessians else None
            ended: list | None = [] if tail is not None else None
            if self.kind == "attn":
                o = self.runner.forward(h[sl], linears, cap, stop_mid=True,
                                   record_attn=self.runner.attn_cache if record else None, stop_at=stop_at,
                                   tail=tail, tail_out=ended)
            else:
                if self.runner.attn_cache is None:
                    raise RuntimeError("the MLP half needs a recorded attention sweep of the same layer first")
                o = self.runner.forward(h[sl], linears, cap, replay_attn=self.runner.attn_cache[bi], stop_at=stop_at,
                                   tail=tail, tail_out=ended)
            if y is not None:
                y[sl] = o
            del o
            if kept is not None:
                if len(ended) == 1 and ended[0] is not None:
                    kept.inputs.append(cap[tail])
                    kept.results.append(ended[0])
                else:
                    kept = None
            if hessians:
                for owner, acc in hessians.items():
                    acc.add(cap[owner])
                if prior is not None:
                    prior.add(cap[lay.path])
        if self.runner.routed:
            self.expert_tokens = [sum(c[e] for c in self.runner.routed) for e in range(lay.num_experts)]
        for o in experts:                # experts with fewer routed tokens than input features: padded (moe.py)
            self.padded[o] = pad_expert_hessian(hessians[o], None if eng.role(o) == "down_proj" else prior)
        self.tail = kept
        return y

    def finish(self, h: torch.Tensor, linears: Mapping[str, Linear]) -> torch.Tensor:
        """The block's output float [rows, T, hidden] with ``linears`` swapped in (the attention half records its
        attention result for the MLP half, as ``sweep(record=True)``).  After a ``sweep(tail=name)`` that kept
        its tail, only ``linears[name]`` runs on the kept inputs, and the layer around the rebuilt module result:
        the same operations on the same values as a full sweep, so the same bits."""
        kept, self.tail = self.tail, None
        if kept is None:
            return self.sweep(h, linears, record=True)
        f = linears[kept.name]
        y = torch.empty_like(h)
        if self.kind == "attn":
            self.runner.attn_cache = []
        for bi, sl in enumerate(self.batches):
            result = with_first(kept.results[bi], f(kept.inputs[bi]))
            kept.inputs[bi] = kept.results[bi] = None
            if self.kind == "attn":
                self.runner.attn_cache.append(result)
                y[sl] = self.runner.forward(h[sl], stop_mid=True, replay_attn=result)
            else:
                y[sl] = self.runner.forward(h[sl], replay_attn=self.runner.attn_cache[bi], replay_mlp=result)
        return y

    def next_input(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The input of the next block: the same layer input after the attention half, y after the MLP half."""
        return h if self.kind == "attn" else y

    def advance_reference(self, h: torch.Tensor) -> torch.Tensor:
        """The FP16 model's hidden state through this block (whole dense layer at the MLP half)."""
        if self.kind == "attn":
            return h
        y = torch.empty_like(h)
        for sl in self.batches:
            y[sl] = self.runner.forward(h[sl])
        return y
