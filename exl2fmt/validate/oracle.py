"""``compare_with_oracle``: the Numba codec against the slow NumPy oracle (``exl2fmt.codec.oracle``), bit for bit,
layer by layer (``exl2fmt demo``'s last step; small models only)."""

from __future__ import annotations

import os
import time

__all__ = ["compare_with_oracle"]


def compare_with_oracle(path: str | os.PathLike, keys: list[str] | None = None) -> list[dict]:
    """Dequantize every EXL2 layer of a model with the Numba codec and with the slow NumPy oracle
    (``exl2fmt.codec.oracle``, no shared code) and compare the float16 results bit for bit.

    Returns one row per layer: {"key", "shape", "plan", "mismatches", "bit_exact", "seconds_fast",
    "seconds_oracle"}.  Meant for small models (the oracle is pure Python per element).
    """
    import numpy as np

    from ..codec import oracle
    from ..container import open_model
    from ..detect import detect_layers
    from ..layout import Format
    from ..names import layer_order_key
    from ..layout import Exl2Slot
    from ..model import load_layer

    model = open_model(path)
    rows = []
    try:
        layers = detect_layers(model.tensors)
        todo = [k for k, l in layers.items() if l.format is Format.EXL2] if keys is None else list(keys)
        for key in sorted(todo, key=layer_order_key):
            layer = load_layer(model, key)
            t0 = time.perf_counter()
            fast = layer.dequantize()
            t1 = time.perf_counter()
            t = layer.tensors
            slow = oracle.dequantize(np.asarray(t[Exl2Slot.Q_WEIGHT]), np.asarray(t[Exl2Slot.Q_SCALE]),
                                     np.asarray(t[Exl2Slot.Q_SCALE_MAX]), layer.groups.bits_rows(),
                                     np.asarray(t[Exl2Slot.Q_INVPERM]), out_features=layer.out_features)
            t2 = time.perf_counter()
            same_shape = fast.shape == slow.shape
            mism = int(np.count_nonzero(fast.view(np.uint16) != slow.view(np.uint16))) if same_shape else int(fast.size)
            rows.append({"key": key, "shape": [int(x) for x in fast.shape], "plan": layer.plan(),
                         "mismatches": mism, "bit_exact": same_shape and mism == 0,
                         "seconds_fast": t1 - t0, "seconds_oracle": t2 - t1})
    finally:
        model.close()
    return rows
