"""``device_map`` for packed models: spread a loaded model over accelerators, the CPU and the disk (accelerate).

A packed model's weights are mostly *buffers* (EXL2 ``q_weight`` ..., GPTQ ``qweight`` ..., EXL3 ``trellis``), so
the placement counts and moves buffers as well as parameters:

* ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"``: accelerate's ``infer_auto_device_map``
  over the model's sizes (buffers included), never splitting a decoder layer (``_no_split_modules``), within
  ``max_memory`` (device -> bytes or "2GiB"; default: what accelerate measures free);
* a dict module path -> device (``0``, ``"cuda:1"``, ``"cpu"``, ``"disk"``) covering every module with tensors;
* a single device (``"cpu"``, ``"cuda:0"``): the whole model there.

Modules mapped to ``"disk"`` have their stored tensors written to ``offload_folder`` and read back for each
forward (accelerate's ``offload_buffers=True``); the packed modules' small derived tables (row tables, unpacked
zero points) are non-persistent buffers and stay in memory.  On a machine with accelerators, modules mapped to
``"cpu"`` are held in CPU memory and run on the first accelerator (accelerate's CPU offload); modules on an
accelerator run there (EXL2 / GPTQ through the bundled Triton kernels; EXL3 decodes its stripes on the CPU).

Errors: ``PLACEMENT_INFEASIBLE`` for a device this machine lacks, a ``"disk"`` placement without an offload
folder, a dict that leaves a module out, or a ``max_memory`` with no room for the model even on disk.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from ..errors import ErrorCode, Exl2Error

__all__ = ["place_model", "AUTO_MAPS"]

AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _err(msg: str) -> Exl2Error:
    return Exl2Error(ErrorCode.PLACEMENT_INFEASIBLE, msg)


def _check_device(dev: Any) -> None:
    if dev in ("disk", "cpu", "meta"):
        if dev == "meta":
            raise _err("a device_map cannot place a module on 'meta'")
        return
    try:
        d = torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    except (RuntimeError, TypeError) as e:
        raise _err(f"device_map names {dev!r}, which is not a device ({e})") from None
    if d.type == "cuda":
        n = torch.cuda.device_count()
        if (d.index or 0) >= n:
            raise _err(f"device_map places modules on {d}, but this machine has {n} CUDA device(s)")
    elif d.type == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise _err(f"device_map places modules on {d}, but this machine has no XPU")
    elif d.type != "cpu":
        raise _err(f"device_map places modules on {d}: only cpu, disk, cuda and xpu devices are supported")


def _covers(model: nn.Module, dm: dict) -> None:
    keys = set(dm)
    if "" in keys:
        return
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        parts = name.split(".")
        if not any(".".join(parts[:i]) in keys for i in range(1, len(parts))):
            raise _err(f"the device_map places no module holding {name!r} (give its module, a parent or '')")


def place_model(model: nn.Module, device_map: "str | dict", max_memory: dict | None = None,
                offload_folder: "str | os.PathLike | None" = None) -> dict:
    """Place the loaded (CPU) ``model`` by ``device_map`` (see the module docstring); returns the device map used
    (also set as ``model.hf_device_map``).  Raises ``Exl2Error`` PLACEMENT_INFEASIBLE."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if isinstance(device_map, (str, int, torch.device)) and str(device_map) not in AUTO_MAPS:
        _check_device(device_map if not isinstance(device_map, torch.device) else str(device_map))
        if device_map == "disk":
            dm = {"": "disk"}
        else:
            model.to(f"cuda:{device_map}" if isinstance(device_map, int) else device_map)
            model.hf_device_map = {"": device_map}
            return model.hf_device_map
    elif isinstance(device_map, str):
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        if max_memory is not None:
            for dev in max_memory:
                _check_device(dev)
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
        dm = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
        if not dm:
            raise _err("accelerate found no placement of the model within max_memory")
    else:
        dm = dict(device_map)
        for dev in dm.values():
            _check_device(dev)
        _covers(model, dm)
    if dm.get("") == "disk":   # accelerate writes no offload index for the root module: name its children
        dm = {name: "disk" for name, _ in model.named_children()}
    if "disk" in dm.values() and offload_folder is None:
        disk = [k for k, v in dm.items() if v == "disk"]
        raise _err(f"{len(disk)} modules do not fit max_memory and go to 'disk' (first: {disk[0] or 'the model'}); "
                   "pass offload_folder (a directory for their tensors) or more max_memory")
    if offload_folder is not None:
        os.makedirs(offload_folder, exist_ok=True)
    dispatch_model(model, dm, offload_dir=None if offload_folder is None else str(offload_folder),
                   offload_buffers=True, force_hooks=len(set(dm.values())) > 1 or "disk" in dm.values())
    from .linear import PackedLinear

    for m in model.modules():   # offloaded: accelerate swaps its buffers in per forward
        if isinstance(m, PackedLinear) and any(b.device.type == "meta" for b in m.buffers(recurse=False)):
            m.mark_offloaded()
    model.hf_device_map = dm
    return dm
