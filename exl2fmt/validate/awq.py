"""AWQ layers in the ``layers`` check: recognised, checked against the layout table for slots, dtypes and shapes
only (exl2fmt does not decode AWQ data)."""

from __future__ import annotations

from ..errors import ErrorCode, Issue
from ..layout import GPTQ_BITS  # AWQ packs the same code widths as GPTQ

__all__ = ["awq_issues"]


def awq_issues(info, file) -> list[Issue]:
    """The issues of one detected AWQ layer (``info``: a ``detect`` layer record; ``file`` named in messages)."""
    from ..layout import RECOGNISED_LAYOUTS, AwqGeometry, AwqSlot, SlotStatus

    issues = []
    slots = RECOGNISED_LAYOUTS["awq"]
    for s in slots:
        t = info.slots.get(s.name)
        if t is None:
            if s.status is SlotStatus.REQUIRED:
                issues.append(Issue(ErrorCode.SLOT_MISSING, f"required awq tensor '{s.name}' is missing",
                                    tensor=f"{info.key}.{s.name}", file=file))
        elif t.dtype not in s.dtypes:
            issues.append(Issue(ErrorCode.SLOT_DTYPE, f"dtype {t.dtype}; expected {' or '.join(s.dtypes)}",
                                tensor=t.name, file=t.file))
    if issues:
        return issues
    if info.bits not in GPTQ_BITS or not info.groups or not info.in_features or info.in_features % info.groups:
        return [Issue(ErrorCode.SLOT_SHAPE, f"shapes give {info.bits} bits and {info.groups} groups for "
                      f"K = {info.in_features}; expected 4 bits (AWQ GEMM) and G dividing K",
                      tensor=f"{info.key}.{AwqSlot.QWEIGHT}", file=file)]
    g = AwqGeometry(K=info.in_features, N=info.out_features, bits=info.bits, G=info.groups)
    for s in slots:
        t = info.slots.get(s.name)
        if t is not None and tuple(t.shape) != tuple(s.shape(g)):
            issues.append(Issue(ErrorCode.SLOT_SHAPE, f"shape {list(t.shape)}; expected {list(s.shape(g))} "
                                f"{s.shape_text}", tensor=t.name, file=t.file))
    return issues
