"""Slot names used by the converters, read from the layout table's slot-name enums (``exl2fmt.layout``).

The converters never spell a tensor suffix themselves; they use these constants, each bound to the named
member of its format's enum (``Exl2Slot.Q_WEIGHT`` ...), so a renamed or removed slot fails at import time.
``tests/test_converters.py`` checks the values.
"""

from __future__ import annotations

from ..layout import DenseSlot, Exl2Slot, GptqSlot

Q_WEIGHT, Q_SCALE, Q_SCALE_MAX = Exl2Slot.Q_WEIGHT, Exl2Slot.Q_SCALE, Exl2Slot.Q_SCALE_MAX
Q_GROUPS, Q_INVPERM, Q_PERM = Exl2Slot.Q_GROUPS, Exl2Slot.Q_INVPERM, Exl2Slot.Q_PERM
EXL2_BIAS, Q_GROUP_MAP = Exl2Slot.BIAS, Exl2Slot.Q_GROUP_MAP
QWEIGHT, QZEROS, SCALES, G_IDX, GPTQ_BIAS = (GptqSlot.QWEIGHT, GptqSlot.QZEROS, GptqSlot.SCALES, GptqSlot.G_IDX,
                                             GptqSlot.BIAS)
WEIGHT, BIAS = DenseSlot.WEIGHT, DenseSlot.BIAS

__all__ = ["Q_WEIGHT", "Q_SCALE", "Q_SCALE_MAX", "Q_GROUPS", "Q_INVPERM", "Q_PERM", "EXL2_BIAS", "Q_GROUP_MAP",
           "QWEIGHT", "QZEROS", "SCALES", "G_IDX", "GPTQ_BIAS", "WEIGHT", "BIAS"]
