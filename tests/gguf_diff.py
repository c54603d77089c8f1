"""Field-by-field and tensor-by-tensor comparison of two GGUF files (used against llama.cpp's goldens).

``gguf_diff(a, b, ignore=())`` -> list of human-readable differences (empty = same): every metadata key (name,
value type, value; ``ignore`` holds keys to skip, e.g. ``general.quantized_by`` that only one writer sets), every
tensor (name, order, ggml type, shape, the exact data bytes).  Read with ``gguf.GGUFReader`` only.
"""

from __future__ import annotations

import numpy as np


def _fields(r):
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            v = f.contents()
        except Exception:  # noqa: BLE001
            v = "<undecodable>"
        out[k] = ([int(t) for t in f.types], v)
    return out


def gguf_diff(a, b, ignore=(), max_items: int = 20) -> list[str]:
    from gguf import GGUFReader

    ra, rb = GGUFReader(str(a)), GGUFReader(str(b))
    fa, fb = _fields(ra), _fields(rb)
    diffs = []
    for k in sorted(set(fa) | set(fb)):
        if k in ignore:
            continue
        if k not in fa or k not in fb:
            diffs.append(f"key {k}: only in {'first' if k in fa else 'second'} "
                         f"({str((fa.get(k) or fb.get(k))[1])[:80]})")
        elif fa[k] != fb[k]:
            va, vb = fa[k], fb[k]
            diffs.append(f"key {k}: {va[0]} {str(va[1])[:120]!s} != {vb[0]} {str(vb[1])[:120]!s}")
    ta = [t.name for t in ra.tensors]
    tb = [t.name for t in rb.tensors]
    if ta != tb:
        diffs.append(f"tensor order/names differ: only first {sorted(set(ta) - set(tb))[:5]}, only second "
                     f"{sorted(set(tb) - set(ta))[:5]}" + ("" if set(ta) != set(tb) else f"; order {ta} vs {tb}"))
    bt = {t.name: t for t in rb.tensors}
    for t in ra.tensors:
        u = bt.get(t.name)
        if u is None:
            continue
        if t.tensor_type != u.tensor_type or list(t.shape) != list(u.shape):
            diffs.append(f"tensor {t.name}: {t.tensor_type.name} {list(t.shape)} != {u.tensor_type.name} "
                         f"{list(u.shape)}")
            continue
        x = np.asarray(t.data).reshape(-1).view(np.uint8)
        y = np.asarray(u.data).reshape(-1).view(np.uint8)
        if x.shape != y.shape or not np.array_equal(x, y):
            diffs.append(f"tensor {t.name}: data bytes differ ({int(np.count_nonzero(x != y)) if x.shape == y.shape else 'size'})")
    return diffs[:max_items] + ([f"... {len(diffs) - max_items} more"] if len(diffs) > max_items else [])


if __name__ == "__main__":  # pragma: no cover
    import sys

    for d in gguf_diff(sys.argv[1], sys.argv[2]):
        print(d)
