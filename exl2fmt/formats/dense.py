"""Dense (unquantized F16 / BF16 / F32 ``nn.Linear``): the layer class and its inspect row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from ..lazynp import np  # numpy on first use: inspect reads headers only

from ..errors import ErrorCode, Issue
from ..layout import DenseGeometry, DenseSlot, Format
from .common import LinearBase, as_float32

__all__ = ["DenseLinear", "inspect_facts"]


@dataclass(frozen=True, eq=False)
class DenseLinear(LinearBase):
    """An unquantized linear layer: ``weight`` [N, K] in F16 / BF16 / F32."""

    format: ClassVar[Format] = Format.DENSE
    key: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    file: str | None = None

    @property
    def out_features(self) -> int:
        return int(self.tensors[DenseSlot.WEIGHT].shape[0])

    @property
    def in_features(self) -> int:
        return int(self.tensors[DenseSlot.WEIGHT].shape[1])

    @property
    def geometry(self) -> DenseGeometry:
        return DenseGeometry(K=self.in_features, N=self.out_features)

    def plan(self) -> str:
        self.raise_if_invalid()
        return self.dtypes[DenseSlot.WEIGHT].lower()

    def validate(self, deep: bool = False) -> list[Issue]:
        issues = self._slot_presence_and_dtypes()
        if issues:
            return issues
        w = self.tensors[DenseSlot.WEIGHT]
        if len(w.shape) != 2 or 0 in w.shape:
            return [self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(w.shape)}; expected [N, K] with N, K > 0",
                                DenseSlot.WEIGHT)]
        issues += self._slot_shapes(self.geometry)
        if deep and not issues:
            issues += self._finite(DenseSlot.WEIGHT) + self._finite(DenseSlot.BIAS)
        return issues

    def dequantize(self) -> np.ndarray:
        """The weight as float16 [N, K] (BF16/F32 are rounded to fp16)."""
        self.raise_if_invalid(deep=True)  # the rules validate --deep and convert apply
        w = self.tensors[DenseSlot.WEIGHT]
        if self.dtypes[DenseSlot.WEIGHT] == "F16":
            return np.array(w, dtype=np.float16)
        with np.errstate(over="ignore"):
            return as_float32(w, self.dtypes[DenseSlot.WEIGHT]).astype(np.float16)

    def _decode_is_finite(self) -> bool:
        """An F16 weight is returned as stored, and the deep checks ``dequantize`` runs have counted its NaN/Inf
        already; BF16 / F32 can overflow float16 and are counted in the output."""
        return self.dtypes[DenseSlot.WEIGHT] == "F16"

    def bias(self) -> np.ndarray | None:
        if DenseSlot.BIAS not in self.tensors:
            return None
        return as_float32(self.tensors[DenseSlot.BIAS], self.dtypes[DenseSlot.BIAS]).astype(np.float16)



# ---------------------------------------------------------------------------------------------------- inspect


def inspect_facts(model, info, config, issues: list[Issue]) -> dict:
    """The dense part of an ``inspect`` layer row (headers only); ``info`` is a ``detect.LayerInfo``."""
    return {"K": info.in_features, "N": info.out_features, "G": info.groups, "plan": (info.dtype or "?").lower(),
            "hist": {}, "act": False, "bpw": None, "error": None}
