"""What the model runner's stand-ins and hooks inside transformers' forward share: the exception that ends a
forward early, the context that builds a model skeleton with its parameters on the meta device, and the helpers
that take a module's result apart (a tensor, or a tuple / list led by one) and put it together again.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Stop", "params_on_meta", "to_device", "first", "without_first", "with_first"]


class Stop(Exception):
    """Raised inside a forward to end it once what was wanted has been recorded."""


@contextlib.contextmanager
def params_on_meta():
    """Every parameter registered inside the block lives on the meta device (no memory); buffers are real."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=False)
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def without_first(out: Any) -> Any:
    """A module's result (a tensor, or a tuple / list led by one) with the leading tensor dropped (kept: the rest,
    such as attention weights); ``with_first`` puts another tensor in its place."""
    return (type(out), tuple(out[1:])) if isinstance(out, (tuple, list)) else (None, ())


def with_first(kept: Any, y: torch.Tensor) -> Any:
    kind, rest = kept
    return y if kind is None else kind((y, *rest))
