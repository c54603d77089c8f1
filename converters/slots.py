"""Slot names used by the converters, read from the layout table (``exl2fmt.layout.LAYOUTS``).

The converters never spell a tensor suffix themselves; they use these constants.  The tuple unpacking below
fails at import time if the layout table changes shape, and ``tests/test_converters.py`` checks the values.
"""

from __future__ import annotations

from ..layout import LAYOUTS, Format

(Q_WEIGHT, Q_SCALE, Q_SCALE_MAX, Q_GROUPS, Q_INVPERM, Q_PERM, EXL2_BIAS,
 Q_GROUP_MAP) = (s.name for s in LAYOUTS[Format.EXL2])
QWEIGHT, QZEROS, SCALES, G_IDX, GPTQ_BIAS = (s.name for s in LAYOUTS[Format.GPTQ])
WEIGHT, BIAS = (s.name for s in LAYOUTS[Format.DENSE])

__all__ = ["Q_WEIGHT", "Q_SCALE", "Q_SCALE_MAX", "Q_GROUPS", "Q_INVPERM", "Q_PERM", "EXL2_BIAS", "Q_GROUP_MAP",
           "QWEIGHT", "QZEROS", "SCALES", "G_IDX", "GPTQ_BIAS", "WEIGHT", "BIAS"]
