"""Layer objects: one quantized (or dense) linear layer, built from its tensors.

``Exl2Linear``, ``GptqLinear`` and ``DenseLinear`` are frozen dataclasses holding the layer's arrays under
their on-disk names.  Arrays may be memory maps: building a layer and ``validate()`` (not deep) touch only
shapes, dtypes and the tiny ``q_groups`` vector.  Every check reads the slot table of ``exl2fmt.layout``.

    layer = Exl2Linear.from_tensors("model.layers.0.mlp.down_proj", {"q_weight": ..., "q_scale": ..., ...})
    issues = layer.validate(deep=True)      # [] when the layer is valid
    w = layer.dequantize()                  # float16 [out_features, in_features]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar, Mapping

import numpy as np

from .container.dtypes import bf16_bits_to_f32, numpy_to_safetensors_dtype
from .errors import ErrorCode, Exl2Error, Issue, Severity
from .groups import GroupTable, decode_q_groups
from .layout import (GPTQ_BITS, LAYOUTS, DenseGeometry, Exl2Geometry, Format, GptqGeometry, SlotStatus, bpw,
                     marker_slot, pad32, plan_desc)

__all__ = ["Exl2Linear", "GptqLinear", "DenseLinear", "Linear", "layer_from_tensors", "numpy_to_st_dtype"]


def numpy_to_st_dtype(a: np.ndarray) -> str:
    dt = np.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype
    return numpy_to_safetensors_dtype(dt) or str(getattr(a, "dtype", "?"))


def _as_float32(a: np.ndarray, st_dtype: str) -> np.ndarray:
    return bf16_bits_to_f32(a) if st_dtype == "BF16" else np.asarray(a).astype(np.float32)


class _Base:
    format: ClassVar[Format]
    key: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]

    def _issue(self, code, msg, slot=None, severity=Severity.ERROR) -> Issue:
        name = self.key if slot is None else f"{self.key}.{slot}"
        return Issue(code, msg, tensor=name, file=self.file, severity=severity)

    def _slot_presence_and_dtypes(self) -> list[Issue]:
        issues = []
        for s in LAYOUTS[self.format]:
            if s.status is SlotStatus.REQUIRED and s.name not in self.tensors:
                issues.append(self._issue(ErrorCode.SLOT_MISSING, f"required {self.format.value} tensor "
                                          f"'{s.name}' is missing", s.name))
            elif s.name in self.tensors and s.status is not SlotStatus.DERIVED:
                dt = self.dtypes[s.name]
                if dt not in s.dtypes:
                    issues.append(self._issue(ErrorCode.SLOT_DTYPE, f"dtype {dt}; expected "
                                              f"{' or '.join(s.dtypes)}", s.name))
        return issues

    def _slot_shapes(self, geometry, skip=()) -> list[Issue]:
        issues = []
        for s in LAYOUTS[self.format]:
            if s.name in self.tensors and s.name not in skip and s.status is not SlotStatus.DERIVED:
                want = tuple(s.shape(geometry))
                got = tuple(self.tensors[s.name].shape)
                if got != want:
                    issues.append(self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(got)}; expected {list(want)} "
                                              f"{s.shape_text}", s.name))
        return issues

    def _finite(self, slot: str) -> list[Issue]:
        if slot not in self.tensors:
            return []
        a = _as_float32(self.tensors[slot], self.dtypes[slot])
        bad = int(np.count_nonzero(~np.isfinite(a)))
        if bad:
            return [self._issue(ErrorCode.NONFINITE_VALUES, f"{bad} of {a.size} values are NaN or Inf", slot)]
        return []

    def raise_if_invalid(self, deep: bool = False) -> None:
        for issue in self.validate(deep=deep):
            if issue.severity is Severity.ERROR:
                raise issue.to_error()

    def dequantize_finite(self) -> np.ndarray:
        """``dequantize()`` under the rule every decoding command shares (validate --deep, dequantize,
        convert): the layer passes the deep checks (``dequantize`` runs them) and the decoded weight is finite -
        a finite layer can still overflow float16 in ExLlamaV2's arithmetic, which ``dequantize`` reproduces
        bit for bit; here that is NONFINITE_VALUES naming the layer.  float16 [out_features, in_features]."""
        w = self.dequantize()
        bad = int(np.count_nonzero(~np.isfinite(w)))
        if bad:
            raise Exl2Error(ErrorCode.NONFINITE_VALUES, f"the dequantized weight holds {bad} NaN/Inf of {w.size}",
                            tensor=self.key, file=self.file)
        return w

    def stored_bytes(self) -> int:
        return sum(int(np.asarray(self.tensors[n]).nbytes) if not hasattr(self.tensors[n], "nbytes")
                   else int(self.tensors[n].nbytes) for n in self.tensors)


# ---------------------------------------------------------------------------------------------------- EXL2


@dataclass(frozen=True, eq=False)
class Exl2Linear(_Base):
    """An EXL2 linear layer.  ``tensors`` maps slot name (``q_weight`` ...) -> array; ``dtypes`` maps slot
    name -> safetensors dtype string.  ``out_features`` is the true N (None: N_pad, i.e. unknown)."""

    format: ClassVar[Format] = Format.EXL2
    key: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    out_features_hint: int | None = None
    file: str | None = None

    @cached_property
    def groups(self) -> GroupTable:
        """Decoded q_groups; raises Exl2Error if they break a rule."""
        qw = self.tensors.get("q_weight")
        qg = self.tensors.get("q_groups")
        if qw is None or qg is None:
            missing = "q_weight" if qw is None else "q_groups"
            raise Exl2Error(ErrorCode.SLOT_MISSING, f"required exl2 tensor '{missing}' is missing",
                            tensor=f"{self.key}.{missing}", file=self.file)
        if len(qw.shape) != 2 or len(qg.shape) != 1:
            raise Exl2Error(ErrorCode.SLOT_SHAPE, "q_weight must be 2-D and q_groups 1-D",
                            tensor=self.key, file=self.file)
        return decode_q_groups(np.asarray(qg), int(qw.shape[0]), tensor=f"{self.key}.q_groups", file=self.file)

    @property
    def in_features(self) -> int:
        return self.groups.K

    @property
    def n_pad(self) -> int:
        return int(self.tensors["q_weight"].shape[1])

    @property
    def out_features(self) -> int:
        n = self.out_features_hint
        return n if n is not None and pad32(n) == self.n_pad else self.n_pad

    @property
    def geometry(self) -> Exl2Geometry:
        g = self.groups
        return Exl2Geometry(K=g.K, N_pad=self.n_pad, G=g.G, Q=g.Q)

    @property
    def has_bias(self) -> bool:
        return "bias" in self.tensors

    def plan(self) -> str:
        """Group plan in ExLlamaV2's notation, e.g. ``0.05:8b_32g/0.95:4b_128g``."""
        self.raise_if_invalid()
        return plan_desc(self.groups.bits_rows())

    def bpw(self) -> float:
        """Bits per weight with all overhead (ExLlamaV2's accounting); raises Exl2Error on an invalid layer."""
        self.raise_if_invalid()
        return bpw(Format.EXL2, self.geometry, dict(self.dtypes))

    def validate(self, deep: bool = False) -> list[Issue]:
        issues = self._slot_presence_and_dtypes()
        if any(i.code is ErrorCode.SLOT_MISSING for i in issues):
            return issues
        qw = self.tensors["q_weight"]
        if len(qw.shape) != 2:
            return issues + [self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(qw.shape)}; expected [Q, N_pad]",
                                         "q_weight")]
        if qw.shape[1] % 32 or qw.shape[1] == 0:
            issues.append(self._issue(ErrorCode.N_PADDING, f"{qw.shape[1]} columns; N_pad must be a positive "
                                      "multiple of 32", "q_weight"))
            return issues
        if len(self.tensors["q_groups"].shape) != 1:
            return issues + [self._issue(ErrorCode.SLOT_SHAPE, "q_groups must be 1-D (2G,)", "q_groups")]
        try:
            g = self.groups
        except Exl2Error as e:
            return issues + [e.as_issue()]
        inv = self.tensors["q_invperm"]
        if tuple(inv.shape) != (g.K,):
            issues.append(self._issue(ErrorCode.K_MISMATCH, f"the groups hold {g.K} input rows but q_invperm has "
                                      f"shape {list(inv.shape)}", "q_invperm"))
        issues += self._slot_shapes(self.geometry, skip=("q_invperm",))
        if deep and not issues:
            issues += self._deep_checks()
        return issues

    def _perm(self, slot: str) -> np.ndarray:
        """A permutation slot as int64; I16 storage is read as uint16, as ExLlamaV2's kernels do."""
        a = np.asarray(self.tensors[slot])
        if self.dtypes.get(slot) == "I16":
            a = a.view(np.uint16)
        return a.astype(np.int64)

    def _deep_checks(self) -> list[Issue]:
        from .codec.exl2 import invert_permutation, is_permutation

        issues = []
        inv = self._perm("q_invperm")
        if not is_permutation(inv):
            issues.append(self._issue(ErrorCode.PERM_INVALID, f"not a permutation of 0..{inv.size - 1} "
                                      "(duplicate or out-of-range entries)", "q_invperm"))
        elif "q_perm" in self.tensors:
            perm = self._perm("q_perm")
            if not np.array_equal(perm, invert_permutation(inv)):
                issues.append(self._issue(ErrorCode.PERM_MISMATCH, "q_perm is not argsort(q_invperm)", "q_perm"))
        qsm = np.asarray(self.tensors["q_scale_max"]).astype(np.float32)
        bad = ~np.isfinite(qsm) | (qsm < 0)
        if bad.any():
            g = int(np.flatnonzero(bad)[0])
            issues.append(self._issue(ErrorCode.SCALE_MAX_INVALID, f"{int(bad.sum())} of {qsm.size} groups have a "
                                      f"non-finite or negative scale (first: group {g} = {qsm[g]})",
                                      "q_scale_max"))
        zero = qsm == 0
        if zero.any():
            # ExLlamaV2 writes 0 for an all-zero group (its max scale underflows fp16); it decodes to zeros.
            issues.append(self._issue(ErrorCode.SCALE_MAX_INVALID, f"{int(zero.sum())} of {qsm.size} groups have "
                                      f"q_scale_max = 0 (first: group {int(np.flatnonzero(zero)[0])}); they decode "
                                      "to all-zero weights", "q_scale_max", severity=Severity.WARNING))
        issues += self._finite("bias")
        return issues

    def codes(self) -> np.ndarray:
        """Integer codes uint8 [K, N_pad] in stored (permuted) row order."""
        from .codec.exl2 import unpack_q_weight

        return unpack_q_weight(np.asarray(self.tensors["q_weight"]), self.groups)

    def scale_codes(self) -> np.ndarray:
        from .codec.exl2 import unpack_q_scale

        return unpack_q_scale(np.asarray(self.tensors["q_scale"]))

    def dequantize(self) -> np.ndarray:
        """``nn.Linear`` weight float16 [out_features, in_features], bit-exact with ExLlamaV2."""
        from .codec.exl2 import dequantize

        self.raise_if_invalid(deep=True)  # the rules validate --deep and convert apply, before decoding
        t = self.tensors
        try:
            return dequantize(np.asarray(t["q_weight"]), np.asarray(t["q_scale"]), np.asarray(t["q_scale_max"]),
                              self.groups, self._perm("q_invperm"), out_features=self.out_features)
        except ValueError as e:
            raise Exl2Error(ErrorCode.PERM_INVALID if "permutation" in str(e) else ErrorCode.SLOT_SHAPE, str(e),
                            tensor=self.key, file=self.file) from None

    def stats(self) -> dict:
        """Decode every weight and return {"mean", "std", "absmax", "nonfinite", "numel"} of the dequantized
        ``nn.Linear`` weight (exact fp16 values, padding excluded) without materializing it."""
        from .codec.exl2_stats import layer_stats

        self.raise_if_invalid(deep=True)
        t = self.tensors
        return layer_stats(np.asarray(t["q_weight"]), np.asarray(t["q_scale"]), np.asarray(t["q_scale_max"]),
                           self.groups, out_features=self.out_features)

    def bias(self) -> np.ndarray | None:
        if "bias" not in self.tensors:
            return None
        return np.asarray(self.tensors["bias"])[: self.out_features].astype(np.float16)


# ---------------------------------------------------------------------------------------------------- GPTQ


@dataclass(frozen=True, eq=False)
class GptqLinear(_Base):
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
        return int(self.tensors["qweight"].shape[1])

    @property
    def bits(self) -> int:
        if self.bits_hint is not None:
            return self.bits_hint
        qz = self.tensors.get("qzeros")
        N = self.N
        if qz is not None and len(qz.shape) == 2 and N and (qz.shape[1] * 32) % N == 0:
            return qz.shape[1] * 32 // N
        return 4

    @property
    def K(self) -> int:
        return int(self.tensors["qweight"].shape[0]) * 32 // self.bits

    @property
    def G(self) -> int:
        return int(self.tensors["qzeros"].shape[0])

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

    @property
    def has_bias(self) -> bool:
        return "bias" in self.tensors

    def plan(self) -> str:
        self.raise_if_invalid()
        gs = self.group_size
        return f"1:{self.bits}b_{gs}g" + (" act-order" if self.act_order() else "")

    def act_order(self) -> bool:
        g = self.tensors.get("g_idx")
        if g is None:
            return False
        g = np.asarray(g)
        return not np.array_equal(g, np.arange(g.size) // max(self.group_size, 1))

    def bpw(self) -> float:
        self.raise_if_invalid()
        return bpw(Format.GPTQ, self.geometry, dict(self.dtypes))

    def validate(self, deep: bool = False) -> list[Issue]:
        issues = self._slot_presence_and_dtypes()
        if any(i.code is ErrorCode.SLOT_MISSING for i in issues):
            return issues
        qw, qz = self.tensors["qweight"], self.tensors["qzeros"]
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
                                             "qzeros")]
        elif self.bits_hint not in GPTQ_BITS:
            return issues + [self._issue(ErrorCode.GPTQ_BITS, f"quantization_config.bits = {self.bits_hint}; "
                                         f"expected one of {GPTQ_BITS}")]
        elif shape_bits != self.bits_hint:
            return issues + [self._issue(ErrorCode.GPTQ_BITS, f"quantization_config.bits = {self.bits_hint} but "
                                         f"qzeros has {qz.shape[1]} words per row for N = {N} "
                                         f"({shape_bits:g} bits)", "qzeros")]
        b = self.bits
        if (qw.shape[0] * 32) % b or (qw.shape[0] * 32 // b) % 32:
            return issues + [self._issue(ErrorCode.GPTQ_BITS, f"qweight has {qw.shape[0]} rows, not a multiple of "
                                         f"{b} ({b}-bit rows pack 32 codes in {b} words)", "qweight")]
        if "g_idx" not in self.tensors and self.G and math.ceil(self.K / self.group_size) != self.G:
            issues.append(self._issue(ErrorCode.SLOT_SHAPE, f"group_size {self.group_size} implies "
                                      f"{math.ceil(self.K / self.group_size)} groups for K = {self.K}, but qzeros and "
                                      f"scales have {self.G}", "qzeros"))
        issues += self._slot_shapes(self.geometry)
        if deep and not issues:
            if "g_idx" in self.tensors:
                g = np.asarray(self.tensors["g_idx"]).astype(np.int64)
                if g.size and (g.min() < 0 or g.max() >= self.G):
                    issues.append(self._issue(ErrorCode.GPTQ_G_IDX, f"g_idx values span {int(g.min())}.."
                                              f"{int(g.max())}; expected 0..{self.G - 1}", "g_idx"))
            if not self.v2:
                from .codec.gptq import unpack_qzeros

                fields = unpack_qzeros(np.asarray(qz), b)
                n_amb = int(np.count_nonzero(fields == (1 << b) - 1))
                if n_amb:
                    issues.append(self._issue(ErrorCode.GPTQ_ZEROS_AMBIGUOUS, f"{n_amb} v1 zero fields equal "
                                              f"{(1 << b) - 1}; tools disagree on their meaning (read as "
                                              f"{1 << b})", "qzeros", severity=Severity.WARNING))
            issues += self._finite("scales") + self._finite("bias")
        return issues

    def scales_f16(self) -> np.ndarray:
        """``scales`` as float16 [G, N]: F16 as stored; BF16 / F32 rounded to fp16 once, as ExLlamaV2 does."""
        sc = self.tensors["scales"]
        if self.dtypes["scales"] == "F16":
            return np.asarray(sc)
        return _as_float32(sc, self.dtypes["scales"]).astype(np.float16)

    def group_index(self) -> np.ndarray:
        """The group of every input row, int32 [K]: ``g_idx`` when stored, else contiguous groups of
        ``group_size`` (the last one may be short)."""
        if "g_idx" in self.tensors:
            return np.asarray(self.tensors["g_idx"]).astype(np.int32)
        return np.minimum(np.arange(self.K) // max(self.group_size, 1), max(self.G - 1, 0)).astype(np.int32)

    def dequantize(self) -> np.ndarray:
        from .codec.gptq import dequantize

        self.raise_if_invalid(deep=True)  # the rules validate --deep and convert apply, before decoding
        t = self.tensors
        try:
            return dequantize(np.asarray(t["qweight"]), np.asarray(t["qzeros"]), self.scales_f16(),
                              self.group_index(), self.bits, v2=self.v2)
        except ValueError as e:
            raise Exl2Error(ErrorCode.GPTQ_G_IDX if "g_idx" in str(e) else ErrorCode.SLOT_SHAPE, str(e),
                            tensor=self.key, file=self.file) from None

    def bias(self) -> np.ndarray | None:
        if "bias" not in self.tensors:
            return None
        return _as_float32(self.tensors["bias"], self.dtypes["bias"]).astype(np.float16)


# ---------------------------------------------------------------------------------------------------- dense


@dataclass(frozen=True, eq=False)
class DenseLinear(_Base):
    """An unquantized linear layer: ``weight`` [N, K] in F16 / BF16 / F32."""

    format: ClassVar[Format] = Format.DENSE
    key: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    file: str | None = None

    @property
    def out_features(self) -> int:
        return int(self.tensors["weight"].shape[0])

    @property
    def in_features(self) -> int:
        return int(self.tensors["weight"].shape[1])

    @property
    def geometry(self) -> DenseGeometry:
        return DenseGeometry(K=self.in_features, N=self.out_features)

    @property
    def has_bias(self) -> bool:
        return "bias" in self.tensors

    def plan(self) -> str:
        self.raise_if_invalid()
        return self.dtypes["weight"].lower()

    def bpw(self) -> float:
        self.raise_if_invalid()
        return bpw(Format.DENSE, self.geometry, dict(self.dtypes))

    def validate(self, deep: bool = False) -> list[Issue]:
        issues = self._slot_presence_and_dtypes()
        if issues:
            return issues
        w = self.tensors["weight"]
        if len(w.shape) != 2 or 0 in w.shape:
            return [self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(w.shape)}; expected [N, K] with N, K > 0",
                                "weight")]
        issues += self._slot_shapes(self.geometry)
        if deep and not issues:
            issues += self._finite("weight") + self._finite("bias")
        return issues

    def dequantize(self) -> np.ndarray:
        """The weight as float16 [N, K] (BF16/F32 are rounded to fp16)."""
        self.raise_if_invalid(deep=True)  # the rules validate --deep and convert apply
        w = self.tensors["weight"]
        if self.dtypes["weight"] == "F16":
            return np.array(w, dtype=np.float16)
        with np.errstate(over="ignore"):
            return _as_float32(w, self.dtypes["weight"]).astype(np.float16)

    def bias(self) -> np.ndarray | None:
        if "bias" not in self.tensors:
            return None
        return _as_float32(self.tensors["bias"], self.dtypes["bias"]).astype(np.float16)


Linear = Exl2Linear | GptqLinear | DenseLinear

_CLASSES = {Format.EXL2: Exl2Linear, Format.GPTQ: GptqLinear, Format.DENSE: DenseLinear}


def layer_from_tensors(key: str, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None,
                       *, fmt: Format | None = None, file: str | None = None, **hints) -> Linear:
    """Build the layer object for ``key`` from slot-name -> array (format detected by marker slot, in
    ExLlamaV2's precedence: q_weight, qweight, weight)."""
    if dtypes is None:
        dtypes = {k: numpy_to_st_dtype(v) for k, v in tensors.items()}
    if fmt is None:
        for f in (Format.EXL2, Format.GPTQ, Format.DENSE):
            if marker_slot(f) in tensors:
                fmt = f
                break
        else:
            raise Exl2Error(ErrorCode.LAYER_NOT_FOUND, "no q_weight, qweight or weight tensor", tensor=key, file=file)
    names = {s.name for s in LAYOUTS[fmt]}
    t = {k: v for k, v in tensors.items() if k in names}
    d = {k: dtypes[k] for k in t}
    cls = _CLASSES[fmt]
    if cls is Exl2Linear:
        return Exl2Linear(key, t, d, out_features_hint=hints.get("out_features"), file=file)
    if cls is GptqLinear:
        return GptqLinear(key, t, d, bits_hint=hints.get("bits"), v2=bool(hints.get("v2", False)),
                          group_size_hint=hints.get("group_size"), file=file)
    return DenseLinear(key, t, d, file=file)
