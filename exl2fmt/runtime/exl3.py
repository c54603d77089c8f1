"""A packed EXL3 (ExLlamaV3 trellis) linear for the CPU: the stored trellis stays as it is, y = x W^T + b is
computed by decoding the weight a stripe of input rows at a time into a bounded scratch.

Every step of EXL3's reconstruction (spec/exl3.md section 5: W_hat from the codebook, the left Hadamard over input
rows and the ``suh`` scales, the right Hadamard over output columns and the ``svh`` scales) stays inside a
128 x 128 block of the padded weight, so input rows [128 s0, 128 s1) of W depend only on tile rows [8 s0, 8 s1)
of the trellis and on ``suh[128 s0 : 128 s1]``.  The forward therefore hands those trellis rows to the codec's
``dequantize`` (``exl2fmt.codec.exl3``, bit-exact with ``convert --to fp16``), which writes float16
[N, rows] into a scratch, and accumulates ``x[:, rows] @ stripe^T`` in float32; the scratch (at most
``STRIPE_ELEMENTS`` halves) is reused by every layer.  No fp16 / fp32 copy of the weight outlives a forward.

The trellis decode costs the same whatever the batch, so batch-1 decode is compute-bound here (about the cost of
``convert --to fp16`` of the layer per token); the activation-side alternative (Hadamard-transform x, multiply by
the inner codebook values, transform back) would skip the two Hadamard stages but not the codebook decode, and
would no longer reproduce the stored weight's fp16 rounding points.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..layout import EXL3_CODEBOOKS, EXL3_PAD, Exl3Slot
from .linear import PackedLinear

__all__ = ["Exl3PackedLinear", "STRIPE_ELEMENTS"]

#: float16 elements of one decoded stripe (input rows x output columns; 8 MiB)
STRIPE_ELEMENTS = 1 << 22

_MARKERS = {Exl3Slot.MCG: EXL3_CODEBOOKS[1], Exl3Slot.MUL1: EXL3_CODEBOOKS[2]}


class Exl3PackedLinear(PackedLinear):
    """An EXL3 linear: buffers ``trellis`` int16 [K_p/16, N_p/16, 16 rate], ``suh`` fp16 [K_p] and ``svh`` fp16
    [N_p] (or the legacy sign words ``su`` int16 [K_p/16], ``sv`` int16 [N_p/16]), the codebook marker ``mcg`` /
    ``mul1`` int32 [] when the codebook is not 3INST, ``bias`` fp16 [N_p] or [N].  K_p / N_p: the features padded
    to 128."""

    fmt = "exl3"

    def __init__(self, in_features: int, out_features: int, k_pad: int, n_pad: int, rate2: int, *,
                 codebook: str = EXL3_CODEBOOKS[0], legacy_signs: bool = False, bias: int | None = None,
                 device: Any = None):
        super().__init__(in_features, out_features)
        if k_pad % EXL3_PAD or n_pad % EXL3_PAD or not (0 <= k_pad - in_features < EXL3_PAD) \
                or not (0 <= n_pad - out_features < EXL3_PAD):
            raise ValueError(f"EXL3 padded shape {k_pad}x{n_pad} does not pad {in_features}x{out_features} to 128")
        self.k_pad, self.n_pad, self.rate2, self.codebook = int(k_pad), int(n_pad), int(rate2), codebook
        self.legacy_signs = bool(legacy_signs)
        kw = {"device": device}
        self.register_buffer(str(Exl3Slot.TRELLIS), torch.empty((k_pad // 16, n_pad // 16, 8 * rate2),
                                                                 dtype=torch.int16, **kw))
        if legacy_signs:
            self.register_buffer(str(Exl3Slot.SU), torch.empty((k_pad // 16,), dtype=torch.int16, **kw))
            self.register_buffer(str(Exl3Slot.SV), torch.empty((n_pad // 16,), dtype=torch.int16, **kw))
        else:
            self.register_buffer(str(Exl3Slot.SUH), torch.empty((k_pad,), dtype=torch.float16, **kw))
            self.register_buffer(str(Exl3Slot.SVH), torch.empty((n_pad,), dtype=torch.float16, **kw))
        for slot, cb in _MARKERS.items():
            if cb == codebook:
                self.register_buffer(str(slot), torch.empty((), dtype=torch.int32, **kw))
        self.register_buffer("bias", torch.empty((bias,), dtype=torch.float16, **kw) if bias else None)

    @classmethod
    def from_layer(cls, layer: Any, device: Any = None) -> "Exl3PackedLinear":
        """From an ``exl2fmt.formats.Exl3Linear`` (validated; its arrays copied into the buffers)."""
        layer.raise_if_invalid(deep=False)
        t = layer.tensors
        K_p, N_p = layer.padded
        b = t.get(Exl3Slot.BIAS)
        m = cls(layer.in_features, layer.out_features, K_p, N_p, int(2 * layer.rate), codebook=layer.codebook,
                legacy_signs=Exl3Slot.SUH not in t, bias=None if b is None else int(b.shape[0]))
        for name, buf in list(m._buffers.items()):
            if buf is not None and name in t:
                a = np.array(t[name])
                if name == Exl3Slot.BIAS:
                    a = layer.bias() if a.shape[0] == layer.out_features else a.astype(np.float16)
                m._buffers[name] = torch.from_numpy(np.ascontiguousarray(a)).to(buf.dtype)
        if device is not None:
            m.to(device)
        return m.prepare()

    def _prepare(self) -> None:
        # the loader may have widened the fp16 slots to the model dtype: back to their exact fp16 values
        for name in (Exl3Slot.SUH, Exl3Slot.SVH, "bias"):
            b = self._buffers.get(str(name))
            if b is not None and b.dtype != torch.float16:
                self._buffers[str(name)] = b.to(torch.float16)
        for name in (Exl3Slot.SU, Exl3Slot.SV, Exl3Slot.TRELLIS):
            b = self._buffers.get(str(name))
            if b is not None and b.dtype != torch.int16:
                self._buffers[str(name)] = b.to(torch.int16)

    # --- decode ----------------------------------------------------------------------------------------
    def _signs(self) -> tuple[np.ndarray, np.ndarray]:
        if self.legacy_signs:
            return self.su.cpu().numpy(), self.sv.cpu().numpy()
        return self.suh.cpu().numpy(), self.svh.cpu().numpy()

    def stripe_rows(self) -> int:
        """Input rows decoded at a time: a multiple of 128, at most ``STRIPE_ELEMENTS`` / N."""
        return max(EXL3_PAD, STRIPE_ELEMENTS // max(self.out_features, 1) // EXL3_PAD * EXL3_PAD)

    def decode_stripe(self, k0: int, k1: int) -> np.ndarray:
        """float16 [N, k1 - k0] = W[:, k0:k1] (C order), bit-exact with the layer's ``dequantize``; k0 a multiple
        of 128, k1 one or ``in_features``."""
        from ..codec.exl3 import dequantize

        su, sv = self._signs()
        s0, s1 = k0 // EXL3_PAD, -(-k1 // EXL3_PAD)
        tr = self.trellis.cpu().numpy()[8 * s0:8 * s1]
        su = su[s0 * EXL3_PAD // 16:s1 * EXL3_PAD // 16] if self.legacy_signs else su[s0 * EXL3_PAD:s1 * EXL3_PAD]
        return dequantize(tr, su, sv, self.rate2, self.codebook, k1 - k0, self.out_features,
                          legacy_signs=self.legacy_signs)

    def _cpu_forward(self, x2: torch.Tensor) -> torch.Tensor:
        K = self.in_features
        xs = x2.to(torch.float32)
        y = torch.zeros((x2.shape[0], self.out_features), dtype=torch.float32)
        rows = self.stripe_rows()
        for k0 in range(0, K, rows):
            k1 = min(K, k0 + rows)
            w = torch.from_numpy(self.decode_stripe(k0, k1))          # float16 [N, k1 - k0]
            y.addmm_(xs[:, k0:k1], w.to(torch.float32).t())
        if self.bias is not None:
            y += self.bias[: self.out_features].to(torch.float32)
        return y.to(x2.dtype)

    def _accel(self, x: torch.Tensor) -> torch.Tensor:
        # no bundled EXL3 GPU kernel: the same stripes, decoded on the CPU, multiplied on the device
        K = self.in_features
        y = torch.zeros((x.shape[0], self.out_features), dtype=torch.float32, device=x.device)
        rows = self.stripe_rows()
        for k0 in range(0, K, rows):
            k1 = min(K, k0 + rows)
            w = torch.from_numpy(self.decode_stripe(k0, k1)).to(x.device, torch.float32)
            y.addmm_(x[:, k0:k1].to(torch.float32), w.t())
        if self.bias is not None:
            y += self.bias[: self.out_features].to(x.device, torch.float32)
        return y.to(x.dtype)
