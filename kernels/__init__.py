"""GPU kernels for EXL2 (``exl2fmt.kernels``).

This package never imports torch or triton at import time: the CLI's inspect/validate must start without
them.  ``available()`` says whether the optional kernel stack is installed (``pip install exl2fmt[kernels]``).
The kernels import the layout from ``exl2fmt.layout``; they never define it.

    from exl2fmt.kernels import load_triton
    kt = load_triton("cpu")          # or "cuda"; None = cuda when available, else cpu
    y = kt.exl2_matmul(x, q_weight, q_scale, q_scale_max, q_groups, q_invperm, out_features=N, bias=b)
    y = kt.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits=4, bias=b)      # GPTQ 2/4/8-bit, same family

``load_triton`` imports ``exl2fmt.kernels.exl2_triton``.  For a CPU device it first sets ``TRITON_INTERPRET=1``
(Triton's CPU interpreter; slow, for tests and small models): Triton fixes the mode when a kernel is defined,
so the choice holds for the whole process and cannot be switched once the module is imported.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys


def _yield_the_top_level_name() -> None:
    """Imported as top-level ``kernels`` - a checkout's root on ``sys.path`` (``python -m pytest`` or ``python -c``
    run from it) makes this directory shadow the ``kernels`` distribution (Hugging Face's, which transformers
    >= 5.25 requires and imports): put that package in ``sys.modules`` instead, so the import that reached
    here gets it.  Without it installed, nothing changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", paths)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    real = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = real         # the import system returns what sys.modules holds once this returns
    try:
        spec.loader.exec_module(real)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise


if __name__ == "kernels":
    _yield_the_top_level_name()

__all__ = ["available", "load_triton"]

_MODULE = "exl2fmt.kernels.exl2_triton"


def available() -> dict[str, bool]:
    """Which optional kernel dependencies are importable, without importing them."""
    return {name: importlib.util.find_spec(name) is not None for name in ("torch", "triton")}


def load_triton(device: str | None = None):
    """Import and return the Triton kernel module for ``device`` ("cpu", "cuda", "cuda:1", ... or None).

    None picks "cuda" when torch sees a CUDA device, else "cpu".  CPU selects Triton's interpreter by setting
    ``TRITON_INTERPRET=1`` before the import; that must happen before anything in the process imports triton
    (triton's own library functions are fixed in one mode when triton is imported).  Raises ImportError when
    torch or triton is missing, and RuntimeError when the module or triton is already loaded in the other mode.
    """
    missing = [k for k, ok in available().items() if not ok]
    if missing:
        raise ImportError(f"the Triton kernels need {' and '.join(missing)}: pip install 'exl2fmt[kernels]'")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    want_interp = str(device).split(":")[0] == "cpu"
    mod = sys.modules.get(_MODULE)
    if mod is not None:
        if mod.interpreted() != want_interp:
            mode = "interpreter (CPU)" if mod.interpreted() else "compiled (GPU)"
            raise RuntimeError(f"the Triton kernels are already loaded in {mode} mode; device {device!r} needs "
                               "the other mode (start a new process)")
        return mod
    if want_interp:
        os.environ["TRITON_INTERPRET"] = "1"
        tl = sys.modules.get("triton.language")
        if tl is not None and type(tl.zeros).__name__ != "InterpretedFunction":
            # triton's own @jit library functions were created in compiled mode: the interpreter cannot run them
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot "
                               "run here; call exl2fmt.kernels.load_triton('cpu') before anything imports triton")
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} is set but device {device!r} "
                           "needs compiled kernels")
    return importlib.import_module(_MODULE)
