"""Weights by name and linear layers as functions: what the model runner and the quantizer share.

* ``WeightSource``: the float tensors of a model by name, read lazily (pread, not the memory map) from a model
  directory / ``ModelFiles``, or held in memory (a mapping, e.g. a dequantized or perturbed copy);
* ``Linear``: a linear layer as a callable x float [..., K] -> y float [..., N];
* ``dense_linear``: the ``Linear`` of an ``nn.Linear``-style weight and bias.

The runner (``model.HFModel``) materializes each decoder layer from a ``WeightSource`` and runs it with
substitute ``Linear``s swapped in (quantized candidates in the quantizer; reference, kernel and float16-I/O
linears in ``validate --run``).  This module imports torch but not transformers.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ..container import ModelFiles, bf16_bits_to_f32, open_model
from ..errors import ErrorCode, Exl2Error

__all__ = ["Linear", "dense_linear", "widened_linear", "WeightSource"]

Linear = Callable[[torch.Tensor], torch.Tensor]
"""A linear layer as a function: x float [..., K] -> y float [..., N] (same dtype and device as x)."""


class WeightSource:
    """Float tensors of a model by name, read lazily.

    ``model`` is a ``ModelFiles`` (``exl2fmt.container.open_model``), a model directory / safetensors path, or a
    mapping name -> torch.Tensor / np.ndarray (in-memory weights, e.g. a perturbed copy in a test).  Stored
    F16, BF16 and F32 tensors are supported; nothing is cached, so memory holds only what callers keep.
    """

    def __init__(self, model: "ModelFiles | str | os.PathLike | Mapping[str, Any]"):
        self._files: ModelFiles | None = None
        self._reader = None
        self._mem: dict[str, torch.Tensor] | None = None
        self._owned = False
        if isinstance(model, ModelFiles):
            self._files = model
        elif isinstance(model, (str, os.PathLike)):
            self._files = open_model(model)
            self._owned = True
        elif isinstance(model, Mapping):
            self._mem = {str(k): (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)))
                         for k, v in model.items()}
        else:
            raise TypeError(f"WeightSource needs ModelFiles, a path or a mapping, got {type(model).__name__}")

    @property
    def files(self) -> ModelFiles | None:
        return self._files

    @property
    def config(self) -> dict | None:
        return None if self._files is None else self._files.config

    @property
    def where(self) -> str:
        return "<memory>" if self._files is None else str(self._files.root)

    def names(self) -> list[str]:
        return list(self._mem) if self._mem is not None else self._files.names()

    def has(self, name: str) -> bool:
        return name in self._mem if self._mem is not None else name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mem is not None:
            if name not in self._mem:
                raise Exl2Error(ErrorCode.TENSOR_NOT_FOUND, "expected a tensor of this name, found none",
                                file=self.where, tensor=name)
            return tuple(self._mem[name].shape)
        return tuple(self._files.info(name).shape)

    def stored_dtype(self, name: str) -> torch.dtype:
        """The torch dtype that holds ``name`` exactly as stored: float16, bfloat16 or float32."""
        if self._mem is not None:
            t = self._mem.get(name)
            return t.dtype if t is not None and t.dtype in (torch.float16, torch.bfloat16) else torch.float32
        return {"F16": torch.float16, "BF16": torch.bfloat16}.get(self._files.info(name).dtype, torch.float32)

    def get(self, name: str, dtype: torch.dtype = torch.float32, device: "torch.device | str | None" = None
            ) -> torch.Tensor:
        """The tensor ``name`` as a new torch tensor of ``dtype`` (default float32) on ``device`` (default CPU).

        Raises ``TENSOR_NOT_FOUND`` if absent and ``SLOT_DTYPE`` if it is not F16/BF16/F32.
        """
        if self._mem is not None:
            if name not in self._mem:
                raise Exl2Error(ErrorCode.TENSOR_NOT_FOUND, "expected a tensor of this name, found none",
                                file=self.where, tensor=name)
            t = self._mem[name]
            if not t.is_floating_point():
                raise Exl2Error(ErrorCode.SLOT_DTYPE, f"expected a float tensor, found {t.dtype}",
                                file=self.where, tensor=name)
            return t.to(device=device or "cpu", dtype=dtype, copy=True)
        info = self._files.info(name)
        if info.dtype not in ("F16", "F32", "BF16"):
            raise Exl2Error(ErrorCode.SLOT_DTYPE, f"expected an F16, BF16 or F32 weight, found {info.dtype}",
                            file=info.file, tensor=name)
        arr = self.read_stored(name)
        if info.dtype == "BF16":
            # the container hands BF16 back as its uint16 bit patterns: widen to the top half of an fp32
            t = torch.from_numpy(bf16_bits_to_f32(arr))
        else:
            t = torch.from_numpy(arr)
        return t.to(device=device or "cpu", dtype=dtype)

    def read_stored(self, name: str) -> np.ndarray:
        """The tensor exactly as stored (numpy dtype of its safetensors dtype; BF16 as uint16 bits), in a private
        array read with pread rather than through the memory map: the map's pages would stay in the resident
        set, so a pass over every block would end up holding the whole model.  File-backed sources only."""
        if self._reader is None:
            from ..container import SourceReader

            self._reader = SourceReader(self._files)
        return self._reader.read(name)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close_files()
            self._reader = None
        if self._owned and self._files is not None:
            self._files.close()

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightSource({self.where!r})"


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A ``Linear`` from an ``nn.Linear``-style weight float [N, K] (row n = output feature n) and bias float [N].

    x [..., K] -> x @ weight.T + bias, computed in the weight's dtype on its device.
    """
    def apply(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias)
    apply.weight = weight  # type: ignore[attr-defined]
    apply.bias = bias  # type: ignore[attr-defined]
    return apply


def widened_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """``dense_linear`` of a 16-bit ``weight`` float16/bfloat16 [N, K] widened to the input's dtype at each call
    (a transient, one layer at a time): the same values and bits as ``dense_linear`` of the float32 weight it
    was copied from exactly (``quant.scoring.exact_16bit``), at half the resident bytes."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight.to(x.dtype), bias)
    apply.weight = weight  # type: ignore[attr-defined]
    apply.bias = bias  # type: ignore[attr-defined]
    return apply
