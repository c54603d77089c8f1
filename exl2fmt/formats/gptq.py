"""GPTQ (AutoGPTQ / GPTQModel): the layer class, its pack entry point and its inspect row (also AWQ's,
whose shapes give the same facts).  Bit packing itself is ``exl2fmt.codec.gptq``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping

from ..lazynp import np  # numpy on first use: inspect reads headers only

from ..errors import ErrorCode, Exl2Error, Issue, Severity
from ..layout import GPTQ_BITS, Format, GptqGeometry, GptqSlot
from .common import LinearBase, as_float32

__all__ = ["GptqLinear", "gptq_layer_tensors", "inspect_facts"]


@dataclass(frozen=True, eq=False)
class GptqLinear(LinearBase):
    """A GPTQ linear layer (qweight / qzeros / scales / g_idx / bias).

    ``bits`` None = inferred from the shapes (qzeros columns * 32 / N).  ``v2`` selects the zero convention
    (``checkpoint_format == "gptq_v2"``).  ``group_size`` is only used when there is no g_idx.
    """

    format: ClassVar[Format] = Format.GPTQ
    key: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    bits_hint: int | None = None
    v2: bool = False
    group_size_hint: int | None = None
    file: str | None = None

    @property
    def N(self) -> int:
        return int(self.tensors[GptqSlot.QWEIGHT].shape[1])

    @property
    def bits(self) -> int:
        if self.bits_hint is not None:
            return self.bits_hint
        qz = self.tensors.get(GptqSlot.QZEROS)
        N = self.N
        if qz is not None and len(qz.shape) == 2 and N and (qz.shape[1] * 32) % N == 0:
            return qz.shape[1] * 32 // N
        return 4

    @property
    def K(self) -> int:
        return int(self.tensors[GptqSlot.QWEIGHT].shape[0]) * 32 // self.bits

    @property
    def G(self) -> int:
        return int(self.tensors[GptqSlot.QZEROS].shape[0])

    in_features = K

    @property
    def out_features(self) -> int:
        return self.N

    @property
    def group_size(self) -> int:
        if self.group_size_hint and self.group_size_hint > 0:
            return self.group_size_hint
        return math.ceil(self.K / self.G) if self.G else self.K

    @property
    def geometry(self) -> GptqGeometry:
        return GptqGeometry(K=self.K, N=self.N, bits=self.bits, G=self.G)

    def plan(self) -> str:
        self.raise_if_invalid()
        gs = self.group_size
        return f"1:{self.bits}b_{gs}g" + (" act-order" if self.act_order() else "")

    def act_order(self) -> bool:
        g = self.tensors.get(GptqSlot.G_IDX)
        if g is None:
            return False
        g = np.asarray(g)
        return not np.array_equal(g, np.arange(g.size) // max(self.group_size, 1))

    def validate(self, deep: bool = False) -> list[Issue]:
        issues = self._slot_presence_and_dtypes()
        if any(i.code is ErrorCode.SLOT_MISSING for i in issues):
            return issues
        qw, qz = self.tensors[GptqSlot.QWEIGHT], self.tensors[GptqSlot.QZEROS]
        if len(qw.shape) != 2 or len(qz.shape) != 2:
            return issues + [self._issue(ErrorCode.SLOT_SHAPE, "qweight and qzeros must be 2-D")]
        N = int(qw.shape[1])
        if N == 0 or qw.shape[0] == 0 or qz.shape[0] == 0:
            return issues + [self._issue(ErrorCode.SLOT_SHAPE, f"empty layer: qweight {list(qw.shape)}, qzeros "
                                         f"{list(qz.shape)}; a layer needs K, N and G > 0")]
        shape_bits = qz.shape[1] * 32 / N
        if self.bits_hint is None:
            if shape_bits not in GPTQ_BITS:
                return issues + [self._issue(ErrorCode.GPTQ_BITS, f"qzeros has {qz.shape[1]} words per row for "
                                             f"N = {N}, i.e. {shape_bits:g} bits; expected one of {GPTQ_BITS}",
                                             GptqSlot.QZEROS)]
        elif self.bits_hint not in GPTQ_BITS:
            return issues + [self._issue(ErrorCode.GPTQ_BITS, f"quantization_config.bits = {self.bits_hint}; "
                                         f"expected one of {GPTQ_BITS}")]
        elif shape_bits != self.bits_hint:
            return issues + [self._issue(ErrorCode.GPTQ_BITS, f"quantization_config.bits = {self.bits_hint} but "
                                         f"qzeros has {qz.shape[1]} words per row for N = {N} "
                                         f"({shape_bits:g} bits)", GptqSlot.QZEROS)]
        b = self.bits
        if (qw.shape[0] * 32) % b or (qw.shape[0] * 32 // b) % 32:
            return issues + [self._issue(ErrorCode.GPTQ_BITS, f"qweight has {qw.shape[0]} rows, not a multiple of "
                                         f"{b} ({b}-bit rows pack 32 codes in {b} words)", GptqSlot.QWEIGHT)]
        if GptqSlot.G_IDX not in self.tensors and self.G and math.ceil(self.K / self.group_size) != self.G:
            issues.append(self._issue(ErrorCode.SLOT_SHAPE, f"group_size {self.group_size} implies "
                                      f"{math.ceil(self.K / self.group_size)} groups for K = {self.K}, but qzeros and "
                                      f"scales have {self.G}", GptqSlot.QZEROS))
        issues += self._slot_shapes(self.geometry)
        if deep and not issues:
            if GptqSlot.G_IDX in self.tensors:
                g = np.asarray(self.tensors[GptqSlot.G_IDX]).astype(np.int64)
                if g.size and (g.min() < 0 or g.max() >= self.G):
                    issues.append(self._issue(ErrorCode.GPTQ_G_IDX, f"g_idx values span {int(g.min())}.."
                                              f"{int(g.max())}; expected 0..{self.G - 1}", GptqSlot.G_IDX))
            if not self.v2:
                from ..codec.gptq import unpack_qzeros

                fields = unpack_qzeros(np.asarray(qz), b)
                n_amb = int(np.count_nonzero(fields == (1 << b) - 1))
                if n_amb:
                    issues.append(self._issue(ErrorCode.GPTQ_ZEROS_AMBIGUOUS, f"{n_amb} v1 zero fields equal "
                                              f"{(1 << b) - 1}; tools disagree on their meaning (read as "
                                              f"{1 << b})", GptqSlot.QZEROS, severity=Severity.WARNING))
            issues += self._finite(GptqSlot.SCALES) + self._finite(GptqSlot.BIAS)
        return issues

    def scales_f16(self) -> np.ndarray:
        """``scales`` as float16 [G, N]: F16 as stored; BF16 / F32 rounded to fp16 once, as ExLlamaV2 does."""
        sc = self.tensors[GptqSlot.SCALES]
        if self.dtypes[GptqSlot.SCALES] == "F16":
            return np.asarray(sc)
        return as_float32(sc, self.dtypes[GptqSlot.SCALES]).astype(np.float16)

    def group_index(self) -> np.ndarray:
        """The group of every input row, int32 [K]: ``g_idx`` when stored, else contiguous groups of
        ``group_size`` (the last one may be short)."""
        if GptqSlot.G_IDX in self.tensors:
            return np.asarray(self.tensors[GptqSlot.G_IDX]).astype(np.int32)
        return np.minimum(np.arange(self.K) // max(self.group_size, 1), max(self.G - 1, 0)).astype(np.int32)

    def dequantize(self) -> np.ndarray:
        from ..codec.gptq import dequantize

        self.raise_if_invalid(deep=True)  # the rules validate --deep and convert apply, before decoding
        t = self.tensors
        try:
            return dequantize(np.asarray(t[GptqSlot.QWEIGHT]), np.asarray(t[GptqSlot.QZEROS]), self.scales_f16(),
                              self.group_index(), self.bits, v2=self.v2)
        except ValueError as e:
            raise Exl2Error(ErrorCode.GPTQ_G_IDX if GptqSlot.G_IDX in str(e) else ErrorCode.SLOT_SHAPE, str(e),
                            tensor=self.key, file=self.file) from None

    def bias(self) -> np.ndarray | None:
        if GptqSlot.BIAS not in self.tensors:
            return None
        return as_float32(self.tensors[GptqSlot.BIAS], self.dtypes[GptqSlot.BIAS]).astype(np.float16)


# ---------------------------------------------------------------------------------------------------- pack


def gptq_layer_tensors(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, g_idx: np.ndarray, bits: int,
                       *, v2: bool = False, bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Pack one GPTQ layer: slot name -> array, dtypes as the layout table writes them (qweight/qzeros I32,
    scales F16, g_idx I32, bias F16).  K and N must be multiples of 32; v1 needs every zero >= 1."""
    from ..codec.gptq import fields_from_zeros, pack_qweight, pack_qzeros

    out = {
        GptqSlot.QWEIGHT.value: pack_qweight(np.ascontiguousarray(codes, dtype=np.uint8), bits),
        GptqSlot.QZEROS.value: pack_qzeros(fields_from_zeros(zeros, bits, v2), bits),
        GptqSlot.SCALES.value: np.ascontiguousarray(scales, dtype=np.float16),
        GptqSlot.G_IDX.value: np.ascontiguousarray(g_idx, dtype=np.int32),
    }
    if bias is not None:
        out[GptqSlot.BIAS.value] = np.ascontiguousarray(bias, dtype=np.float16)
    return out


# ---------------------------------------------------------------------------------------------------- inspect


def inspect_facts(model, info, config, issues: list[Issue]) -> dict:
    """The GPTQ (and AWQ) part of an ``inspect`` layer row, from the headers alone; ``info`` is a
    ``detect.LayerInfo``.  Returns ``{"K", "N", "G", "plan", "hist", "act", "bpw", "error"}``."""
    K, N, G = info.in_features, info.out_features, info.groups
    out = {"K": K, "N": N, "G": G, "plan": None, "hist": {}, "act": None, "bpw": None, "error": None}
    if K and N and info.bits:
        gs = math.ceil(K / G) if G else None
        out["plan"] = f"1:{info.bits}b_{gs}g" if gs else f"1:{info.bits}b"
        out["hist"][info.bits] = K * N
    if info.format is Format.AWQ:
        out["act"] = False
    else:
        from ..arch import gptq_config

        desc_act = gptq_config(config).desc_act
        out["act"] = False if GptqSlot.G_IDX not in info.slots else (desc_act if desc_act is not None else None)
    return out
