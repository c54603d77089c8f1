"""Packed linear modules: EXL2 and GPTQ layers that stay at their stored size and compute y = x W^T + b by decoding
on the fly (CPU: Numba kernels of ``runtime.cpu``; CUDA / ROCm / XPU: the bundled Triton kernels).

The modules hold the layer's stored tensors as buffers under the checkpoint's own names (``q_weight``,
``q_scale`` ... / ``qweight``, ``qzeros`` ...), so a state dict read from the model files fills them (what the
transformers quantizer of ``exl2fmt.hf`` relies on), plus small derived tables (non-persistent buffers: the work
list of the few-rows kernel (``cpu.Pieces``), the row table of the row decoder, EXL2's q_perm, GPTQ's unpacked
zero points).  No fp16 / fp32 copy of a weight is kept: the CPU path runs up to ``SMALL_M`` rows straight from the
packed words (``cpu.exl2_gemv`` / ``cpu.gptq_gemv``, on ``gemv_threads()`` threads), and more rows through a
bounded scratch tile (``SCRATCH_ELEMENTS`` floats, reused by every layer) and BLAS.  Either way every weight is
the FP16 conversion's value bit for bit (see ``runtime.cpu`` for what is exact).

Inference only: the forward runs under the caller's grad mode but is not differentiable.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..groups import decode_q_groups
from ..layout import Exl2Slot, GptqSlot
from . import cpu

__all__ = ["PackedLinear", "Exl2PackedLinear", "GptqPackedLinear", "FusedLinear", "SMALL_M", "SCRATCH_ELEMENTS",
           "packed_modules", "weight_bytes"]

#: up to this many rows the CPU path accumulates straight from the packed words (no weight tile is formed)
SMALL_M = 8
#: float32 elements of the shared decode scratch of the many-rows CPU path (16 MiB)
SCRATCH_ELEMENTS = 1 << 22

_scratch: dict[str, torch.Tensor] = {}


def _scratch_rows(n: int, rows: int) -> torch.Tensor:
    """A float32 [rows, n] view of the shared CPU scratch (grown to the largest request, at most a few MiB)."""
    need = rows * n
    buf = _scratch.get("cpu")
    if buf is None or buf.numel() < need:
        buf = torch.empty(max(need, 1), dtype=torch.float32)
        _scratch["cpu"] = buf
    return buf[:need].view(rows, n)


_gemv_threads: list[int] = []


def gemv_threads() -> int:
    """Threads of the few-rows CPU kernel: ``EXL2FMT_GEMV_THREADS`` (read once; default 1), at most Numba's
    thread count.

    One thread by default: a batch-1 layer takes tens of microseconds, and a parallel region per layer (Numba's
    OpenMP pool, beside torch's own) costs more than it gains once the cores are shared; with 1 the kernel runs
    on the calling thread and enters no parallel region."""
    if not _gemv_threads:
        try:
            n = int(os.environ.get("EXL2FMT_GEMV_THREADS", "1"))
        except ValueError:
            n = 1
        _gemv_threads.append(max(1, min(n, cpu.threads())))
    return _gemv_threads[0]


def _is_accel(device: torch.device) -> bool:
    return device.type in ("cuda", "xpu", "hip")


class PackedLinear(nn.Module):
    """What the packed formats share: sizes, the CPU forward (small-M kernel or scratch tiles + BLAS), the device
    dispatch.  Subclasses fill ``_cpu_small`` / ``_cpu_decode`` / ``_accel``."""

    fmt = "?"

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self._ready = False
        self._kt_tables: Any = None
        self._np_cache: Any = None
        #: False for a module whose buffers accelerate brings in per forward (offloaded): a cached view would
        #: keep the last copy resident and defeat the offload
        self.cache_views = True

    # --- subclass hooks --------------------------------------------------------------------------------
    def _prepare(self) -> None:  # derived tables from the stored buffers (CPU)
        raise NotImplementedError

    def _stored_order(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _cpu_small(self, x: np.ndarray, y: np.ndarray) -> None:
        raise NotImplementedError

    def _cpu_decode(self, k0: int, k1: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def _accel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _bias(self) -> torch.Tensor | None:
        return None

    # --- shared ----------------------------------------------------------------------------------------
    def prepare(self) -> "PackedLinear":
        """Build the derived tables from the stored buffers (called once the buffers hold the real tensors)."""
        if not self._ready:
            self._prepare()
            self._ready = True
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._ready:
            self.prepare()
        shape = x.shape
        x2 = x.detach().reshape(-1, self.in_features)
        if _is_accel(x2.device):
            y = self._accel(x2)
        else:
            y = self._cpu_forward(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def _cpu_forward(self, x2: torch.Tensor) -> torch.Tensor:
        M, K, N = x2.shape[0], self.in_features, self.out_features
        xf = x2 if x2.dtype == torch.float32 else x2.to(torch.float32)
        y = torch.empty((M, N), dtype=torch.float32)
        if M <= SMALL_M:
            self._cpu_small(xf.contiguous().numpy(), y.numpy())
        else:
            xs = self._stored_order(xf).contiguous()
            rows = max(32, min(K, SCRATCH_ELEMENTS // max(N, 1)) // 32 * 32)
            for k0 in range(0, K, rows):
                k1 = min(K, k0 + rows)
                tile = _scratch_rows(N, k1 - k0)
                self._cpu_decode(k0, k1, tile.numpy())
                if k0 == 0:
                    torch.mm(xs[:, k0:k1], tile, out=y)
                else:
                    y.addmm_(xs[:, k0:k1], tile)
        b = self._bias()
        if b is not None:
            y += b.to(torch.float32)
        return y if x2.dtype == torch.float32 else y.to(x2.dtype)

    def _set_pieces(self, pc: "cpu.Pieces") -> None:
        """Keep the gemv work list; its arrays are also registered as non-persistent buffers (shared memory), so
        that ``weight_bytes`` counts them."""
        self._pieces = pc
        for name in ("table", "xidx", "words"):
            self.register_buffer(f"_pc_{name}", torch.from_numpy(getattr(pc, name)), persistent=False)

    def _views(self, *names: str) -> tuple:
        """NumPy views of the named buffers (uint32 for int32, uint16 for float16), cached until a buffer is
        replaced: the per-call ``Tensor.numpy()`` conversions cost more than a small layer's kernel."""
        bufs = tuple(self._buffers[n] for n in names)
        c = self._np_cache
        if c is None or len(c[0]) != len(bufs) or any(a is not b for a, b in zip(c[0], bufs)):
            arrs = tuple(b.numpy().view(np.uint32 if b.dtype == torch.int32 else np.uint16 if b.dtype ==
                                        torch.float16 else b.numpy().dtype) for b in bufs)
            if not self.cache_views:
                self._np_cache = None
                return arrs
            c = self._np_cache = (bufs, arrs)
        return c[1]

    def mark_offloaded(self) -> None:
        """The buffers live elsewhere (disk, or CPU memory for an accelerator) between forwards: no view cache."""
        self.cache_views = False
        self._np_cache = None


class Exl2PackedLinear(PackedLinear):
    """An EXL2 linear: buffers ``q_weight`` int32 [Q, N_pad], ``q_scale`` int32 [G, N_pad/8], ``q_scale_max``
    fp16 [G], ``q_groups`` int16 [2G], ``q_invperm`` [K] (int32 or int16), optional ``q_perm``, ``bias`` [N_pad]."""

    fmt = "exl2"

    def __init__(self, in_features: int, out_features: int, n_pad: int, groups: int, q_rows: int, *,
                 bias: bool = False, invperm_dtype: torch.dtype = torch.int32, has_perm: bool = False,
                 device: Any = None):
        super().__init__(in_features, out_features)
        self.n_pad = int(n_pad)
        kw = {"device": device}
        self.register_buffer(str(Exl2Slot.Q_WEIGHT), torch.empty((q_rows, n_pad), dtype=torch.int32, **kw))
        self.register_buffer(str(Exl2Slot.Q_SCALE), torch.empty((groups, n_pad // 8), dtype=torch.int32, **kw))
        self.register_buffer(str(Exl2Slot.Q_SCALE_MAX), torch.empty((groups,), dtype=torch.float16, **kw))
        self.register_buffer(str(Exl2Slot.Q_GROUPS), torch.empty((2 * groups,), dtype=torch.int16, **kw))
        self.register_buffer(str(Exl2Slot.Q_INVPERM), torch.empty((in_features,), dtype=invperm_dtype, **kw))
        if has_perm:
            self.register_buffer(str(Exl2Slot.Q_PERM), torch.empty((in_features,), dtype=invperm_dtype, **kw))
        self.register_buffer("bias", torch.empty((n_pad,), dtype=torch.float16, **kw) if bias else None)

    @classmethod
    def from_layer(cls, layer: Any, device: Any = None) -> "Exl2PackedLinear":
        """From an ``exl2fmt.formats.Exl2Linear`` (its arrays copied into the buffers)."""
        t = layer.tensors
        inv = np.asarray(t[Exl2Slot.Q_INVPERM])
        m = cls(layer.in_features, layer.out_features, layer.n_pad, layer.groups.G, int(t[Exl2Slot.Q_WEIGHT].shape[0]),
                bias="bias" in t, invperm_dtype=torch.int16 if inv.dtype == np.int16 else torch.int32,
                has_perm=False)
        m.load_arrays(t)
        if device is not None:
            m.to(device)
        return m.prepare()

    def load_arrays(self, t) -> None:
        for name, buf in list(self._buffers.items()):
            if buf is None or name not in t:
                continue
            a = np.array(t[name])
            if name in (Exl2Slot.Q_SCALE_MAX, "bias"):
                a = a.astype(np.float16)
            self._buffers[name] = torch.from_numpy(a).to(buf.dtype)

    def _prepare(self) -> None:
        dev = self.q_weight.device
        qg = self.q_groups.detach().cpu().numpy().astype(np.int16)
        gt = decode_q_groups(qg, int(self.q_weight.shape[0]))
        inv = self.q_invperm.detach().cpu().numpy()
        inv = (inv.view(np.uint16) if inv.dtype == np.int16 else inv).astype(np.int64)
        perm = np.empty_like(inv)
        perm[inv] = np.arange(inv.size)
        # the loader may have widened the fp16 slots to the model dtype: back to their exact fp16 values
        self.q_scale_max = self.q_scale_max.to(torch.float16)
        if self.bias is not None:
            self.bias = self.bias.to(torch.float16)
        self.register_buffer("_perm", torch.from_numpy(perm).to(dev), persistent=False)
        identity = bool((perm == np.arange(perm.size)).all())
        self._identity = identity
        tab = cpu.exl2_row_table(gt.bits, gt.row_start, gt.qrow, gt.rows)
        self.register_buffer("_tab", torch.from_numpy(tab).to(dev), persistent=False)
        self._set_pieces(cpu.exl2_pieces(gt.bits, gt.row_start, gt.qrow, gt.rows, perm))
        self._groups = gt

    def _stored_order(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._identity else x.index_select(1, self._perm)

    def _cpu_small(self, x, y) -> None:
        qw, qs, qsm = self._views(Exl2Slot.Q_WEIGHT, Exl2Slot.Q_SCALE, Exl2Slot.Q_SCALE_MAX)
        pc = self._pieces
        cpu.exl2_gemv(x, qw, qs, qsm, pc.table, pc.xidx, pc.bounds(gemv_threads()), y)

    def _cpu_decode(self, k0, k1, out) -> None:
        qw, qs, qsm = self._views(Exl2Slot.Q_WEIGHT, Exl2Slot.Q_SCALE, Exl2Slot.Q_SCALE_MAX)
        cpu.exl2_decode_rows(qw, qs, qsm, self._tab.numpy(), k0, k1, cpu.decode_block(out.shape[1]),
                             out)

    def _bias(self):
        return None if self.bias is None else self.bias[: self.out_features]

    def _accel(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels import load_triton

        kt = load_triton(str(x.device))
        if self._kt_tables is None or self._kt_tables.device != x.device:
            self._kt_tables = kt.build_tables(self._groups, self.q_invperm, device=x.device)
        xin = x if x.dtype in (torch.float16, torch.bfloat16) else x.to(torch.float16)
        y = kt.exl2_matmul(xin.contiguous(), self.q_weight, self.q_scale, self.q_scale_max, tables=self._kt_tables,
                           out_features=self.out_features,
                           bias=None if self.bias is None else self.bias[: self.out_features].to(xin.dtype))
        return y.to(x.dtype)


class GptqPackedLinear(PackedLinear):
    """A GPTQ linear (2/3/4/8 bits, v1 or v2 zeros, g_idx in any order): buffers ``qweight`` int32 [K*b/32, N],
    ``qzeros`` int32 [G, N*b/32], ``scales`` fp16 [G, N], ``g_idx`` int32 [K] (optional), ``bias`` fp16 [N]."""

    fmt = "gptq"

    def __init__(self, in_features: int, out_features: int, bits: int, groups: int, *, bias: bool = False,
                 g_idx: bool = True, v2: bool = False, group_size: int | None = None, device: Any = None):
        super().__init__(in_features, out_features)
        self.bits, self.v2 = int(bits), bool(v2)
        self.group_size = group_size if group_size and group_size > 0 else math.ceil(in_features / max(groups, 1))
        kw = {"device": device}
        K, N = in_features, out_features
        self.register_buffer(str(GptqSlot.QWEIGHT), torch.empty((K * bits // 32, N), dtype=torch.int32, **kw))
        self.register_buffer(str(GptqSlot.QZEROS), torch.empty((groups, N * bits // 32), dtype=torch.int32, **kw))
        self.register_buffer(str(GptqSlot.SCALES), torch.empty((groups, N), dtype=torch.float16, **kw))
        self.register_buffer(str(GptqSlot.G_IDX), torch.empty((K,), dtype=torch.int32, **kw) if g_idx else None)
        self.register_buffer("bias", torch.empty((N,), dtype=torch.float16, **kw) if bias else None)

    @classmethod
    def from_layer(cls, layer: Any, device: Any = None) -> "GptqPackedLinear":
        """From an ``exl2fmt.formats.GptqLinear``."""
        t = layer.tensors
        m = cls(layer.K, layer.N, layer.bits, layer.G, bias="bias" in t, g_idx=GptqSlot.G_IDX in t, v2=layer.v2,
                group_size=layer.group_size)
        for name in map(str, (GptqSlot.QWEIGHT, GptqSlot.QZEROS, GptqSlot.G_IDX)):
            if name in t:
                m._buffers[name] = torch.from_numpy(np.array(t[name])).to(torch.int32)
        m.scales = torch.from_numpy(np.array(layer.scales_f16()))
        if "bias" in t:
            m.bias = torch.from_numpy(np.array(layer.bias()))
        if device is not None:
            m.to(device)
        return m.prepare()

    def _prepare(self) -> None:
        from ..codec.gptq import unpack_qzeros

        dev = self.qweight.device
        self.scales = self.scales.to(torch.float16)
        if self.bias is not None:
            self.bias = self.bias.to(torch.float16)
        G = self.scales.shape[0]
        if self.g_idx is not None:
            gi = self.g_idx.detach().cpu().numpy().astype(np.int64)
        else:
            gi = np.minimum(np.arange(self.in_features) // self.group_size, G - 1)
        if gi.size and (gi.min() < 0 or gi.max() >= G):
            raise ValueError(f"g_idx values must lie in 0..{G - 1}")
        self._gi = gi
        fields = unpack_qzeros(self.qzeros.detach().cpu().numpy(), self.bits)
        self.register_buffer("_zeros", torch.from_numpy(np.ascontiguousarray(fields, dtype=np.uint8)).to(dev),
                             persistent=False)
        tab = cpu.gptq_row_table(self.in_features, self.bits, gi)
        self.register_buffer("_tab", torch.from_numpy(tab).to(dev), persistent=False)
        self._set_pieces(cpu.gptq_pieces(self.in_features, self.bits, gi))

    def _cpu_small(self, x, y) -> None:
        qw, sc, zeros = self._views(GptqSlot.QWEIGHT, GptqSlot.SCALES, "_zeros")
        pc = self._pieces
        cpu.gptq_gemv(x, qw, sc, zeros, np.float32(0.0 if self.v2 else 1.0), pc.table, pc.xidx,
                      pc.bounds(gemv_threads()), y)

    def _cpu_decode(self, k0, k1, out) -> None:
        qw, sc, zeros = self._views(GptqSlot.QWEIGHT, GptqSlot.SCALES, "_zeros")
        cpu.gptq_decode_rows(qw, sc, zeros, np.float32(0.0 if self.v2 else 1.0), self._tab.numpy(), k0, k1,
                             cpu.decode_block(out.shape[1]), out)

    def _bias(self):
        return self.bias

    def _accel(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels import load_triton

        kt = load_triton(str(x.device))
        g = self.g_idx if self.g_idx is not None else torch.from_numpy(self._gi.astype(np.int32)).to(x.device)
        xin = x if x.dtype in (torch.float16, torch.bfloat16) else x.to(torch.float16)
        y = kt.gptq_matmul(xin.contiguous(), self.qweight, self.qzeros, self.scales, g, bits=self.bits, v2=self.v2,
                           bias=None if self.bias is None else self.bias.to(xin.dtype))
        return y.to(x.dtype)


class FusedLinear(nn.Module):
    """A fused projection (Phi-3 ``qkv_proj`` / ``gate_up_proj``) over the split linears EXL2 stores: the outputs
    of ``parts`` concatenated.  The parts are not registered here (they live, under their checkpoint names, on
    the parent module), so the state dict names each stored tensor once."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self._parts = tuple(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self._parts], dim=-1)


def packed_modules(model: nn.Module) -> dict[str, PackedLinear]:
    """name -> packed linear of every packed module of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (derived tables included) held by ``module``."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen and t.device.type != "meta":
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
