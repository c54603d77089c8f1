"""What the per-format layer classes share: slot presence / dtype / shape checks against the layout table,
finiteness checks, the decode-or-raise rule, and the numpy -> safetensors dtype names."""

from __future__ import annotations

from typing import ClassVar, Mapping

from ..lazynp import np  # numpy on first use: inspect reads headers only

from ..container.dtypes import bf16_bits_to_f32, count_nonfinite, numpy_to_safetensors_dtype
from ..errors import ErrorCode, Exl2Error, Issue, Severity
from ..layout import LAYOUTS, SLOT_NAMES, Format, SlotStatus, bpw

__all__ = ["LinearBase", "numpy_to_st_dtype", "as_float32"]

def numpy_to_st_dtype(a: np.ndarray) -> str:
    """The safetensors dtype string (``"F16"``, ``"I32"`` ...) of an array's dtype (its numpy name if safetensors
    has none)."""
    dt = np.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype
    return numpy_to_safetensors_dtype(dt) or str(getattr(a, "dtype", "?"))


def as_float32(a: np.ndarray, st_dtype: str) -> np.ndarray:
    """A stored float tensor (``st_dtype`` F16 / BF16 / F32; BF16 held as its uint16 bits) as float32."""
    return bf16_bits_to_f32(a) if st_dtype == "BF16" else np.asarray(a).astype(np.float32)


class LinearBase:
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
            elif s.name in self.tensors and s.status not in (SlotStatus.DERIVED, SlotStatus.REFUSED):
                dt = self.dtypes[s.name]
                if dt not in s.dtypes:
                    issues.append(self._issue(ErrorCode.SLOT_DTYPE, f"dtype {dt}; expected "
                                              f"{' or '.join(s.dtypes)}", s.name))
        return issues

    def _slot_shapes(self, geometry, skip=()) -> list[Issue]:
        issues = []
        for s in LAYOUTS[self.format]:
            if s.name in self.tensors and s.name not in skip and s.status not in (SlotStatus.DERIVED, SlotStatus.REFUSED):
                want = tuple(s.shape(geometry))
                got = tuple(self.tensors[s.name].shape)
                if got != want:
                    issues.append(self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(got)}; expected {list(want)} "
                                              f"{s.shape_text}", s.name))
        return issues

    def _finite(self, slot: str) -> list[Issue]:
        if slot not in self.tensors:
            return []
        a = self.tensors[slot]
        bad = count_nonfinite(a, self.dtypes[slot])
        if bad:
            return [self._issue(ErrorCode.NONFINITE_VALUES, f"{bad} of {a.size} values are NaN or Inf", slot)]
        return []

    @property
    def has_bias(self) -> bool:
        return SLOT_NAMES[self.format].BIAS in self.tensors

    def bpw(self) -> float:
        """Bits per weight with all overhead (ExLlamaV2's accounting); raises Exl2Error on an invalid layer."""
        self.raise_if_invalid()
        return bpw(self.format, self.geometry, dict(self.dtypes))

    def raise_if_invalid(self, deep: bool = False) -> None:
        for issue in self.validate(deep=deep):
            if issue.severity is Severity.ERROR:
                raise issue.to_error()

    def _decode_is_finite(self) -> bool:
        """True when the layer's own (already deep-checked) tensors prove that ``dequantize`` cannot produce a
        NaN or Inf, so ``dequantize_finite`` need not count them in the output; False means "count them"."""
        return False

    def dequantize_finite(self) -> np.ndarray:
        """``dequantize()`` under the rule every decoding command shares (validate --deep, dequantize,
        convert): the layer passes the deep checks (``dequantize`` runs them) and the decoded weight is finite -
        a finite layer can still overflow float16 in ExLlamaV2's arithmetic, which ``dequantize`` reproduces
        bit for bit; here that is NONFINITE_VALUES naming the layer.  float16 [out_features, in_features]."""
        w = self.dequantize()
        # counted from the float16 bit patterns (NumPy's float16 isfinite is emulated: slower than the decode
        # itself), and skipped where the format proves from its scales that no value can overflow
        bad = 0 if self._decode_is_finite() else count_nonfinite(w, "F16")
        if bad:
            raise Exl2Error(ErrorCode.NONFINITE_VALUES, f"the dequantized weight holds {bad} NaN/Inf of {w.size}",
                            tensor=self.key, file=self.file)
        return w

    def stored_bytes(self) -> int:
        return sum(int(np.asarray(self.tensors[n]).nbytes) if not hasattr(self.tensors[n], "nbytes")
                   else int(self.tensors[n].nbytes) for n in self.tensors)

