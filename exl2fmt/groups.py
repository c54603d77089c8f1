"""``q_groups`` encode/decode and the EXL2 group invariants (spec/exl2.md, rules G1-G7).

``q_groups`` is an int16 vector ``[bits_0, qrow_0, bits_1, qrow_1, ...]``: the bit width of each group and
the index of its first *packed int32 row* in ``q_weight`` (not a K row, not a group size).  The number of
input rows of group g is ``(qrow_{g+1} - qrow_g) * 32 / bits_g``, the last group running to the end of
``q_weight``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import repeat

from .lazynp import np  # numpy on first use: inspect reads headers only

from .errors import ErrorCode, Exl2Error
from .layout import BIT_WIDTHS, EXL2_BITS, MAX_INT16, MAX_K, ROW_MULTIPLE

__all__ = ["GroupTable", "decode_q_groups", "q_groups_plan", "encode_q_groups", "group_table_from_rows"]


@dataclass(frozen=True)
class GroupTable:
    """Decoded groups of one EXL2 layer.  All arrays are int64 of length G.

    ``bits``       bit width of each group
    ``qrow``       first packed int32 row of the group in q_weight
    ``qrows``      number of packed int32 rows of the group
    ``row_start``  first stored (permuted) input row of the group
    ``rows``       number of input rows of the group
    """

    bits: np.ndarray
    qrow: np.ndarray
    qrows: np.ndarray
    row_start: np.ndarray
    rows: np.ndarray

    @property
    def G(self) -> int:
        return int(self.bits.shape[0])

    @property
    def K(self) -> int:
        return int(self.rows.sum())

    @property
    def Q(self) -> int:
        return int(self.qrows.sum())

    def bits_rows(self) -> list[tuple[int, int]]:
        return list(zip(self.bits.tolist(), self.rows.tolist()))

    def rows_per_bits(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for b, r in zip(self.bits.tolist(), self.rows.tolist()):
            out[b] = out.get(b, 0) + r
        return out


def group_table_from_rows(bits_rows) -> GroupTable:
    """Build the table for groups given as [(bits, rows)] in stored order (writer side, no checks)."""
    bits = np.array([b for b, _ in bits_rows], dtype=np.int64)
    rows = np.array([r for _, r in bits_rows], dtype=np.int64)
    qrows = rows * bits // 32
    qrow = np.concatenate([[0], np.cumsum(qrows)[:-1]]).astype(np.int64) if len(rows) else np.zeros(0, np.int64)
    row_start = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64) if len(rows) else np.zeros(0, np.int64)
    return GroupTable(bits=bits, qrow=qrow, qrows=qrows, row_start=row_start, rows=rows)


def encode_q_groups(bits_rows) -> np.ndarray:
    """[(bits, rows)] per group -> ``q_groups`` int16 [2G] of (bits, first packed row) pairs.

    Raises ValueError for a group whose rows do not pack into whole words or that breaks the int16 limits.
    """
    out = np.empty(2 * len(bits_rows), dtype=np.int16)
    qrow = 0
    for g, (b, r) in enumerate(bits_rows):
        if b not in BIT_WIDTHS:
            raise ValueError(f"group {g}: bit width {b} not in {sorted(BIT_WIDTHS)}")
        if (r * b) % 32:
            raise ValueError(f"group {g}: {r} rows at {b} bits do not fill whole int32 words")
        if qrow > MAX_INT16:
            raise ValueError(f"group {g}: qrow {qrow} exceeds {MAX_INT16}")
        out[2 * g] = b
        out[2 * g + 1] = qrow
        qrow += r * b // 32
    return out


_VALID_BITS = frozenset(BIT_WIDTHS)
_UNIT_ROWS = {b: w.rows_per_unit for b, w in BIT_WIDTHS.items()}


def _plan_if_valid(vals: list, q_weight_rows: int, require_multiple_of_32: bool) -> list[tuple[int, int]] | None:
    """[(bits, rows)] when ``vals`` passes every rule of ``_q_groups_plan_checked``, else None (the caller then
    runs the rule-by-rule checks, which name the first broken rule).  The same rules as whole-list operations
    (min / max / sorted / map run in C), so a valid q_groups of a few hundred groups costs a few list passes."""
    n = len(vals)
    if not n or n % 2 or n // 2 > MAX_INT16:
        return None
    bits = vals[0::2]
    qrow = vals[1::2]
    if not _VALID_BITS.issuperset(bits) or sorted(bits, reverse=True) != bits:
        return None
    if qrow[0] != 0 or min(qrow) < 0 or max(qrow) > MAX_INT16:
        return None
    nxt = qrow[1:]
    nxt.append(int(q_weight_rows))
    qrows = list(map(operator.sub, nxt, qrow))
    if min(qrows) <= 0:
        return None
    words = list(map(operator.mul, qrows, repeat(32)))
    rows = list(map(operator.floordiv, words, bits))
    if list(map(operator.mul, rows, bits)) != words:  # a fractional number of input rows
        return None
    unit = repeat(ROW_MULTIPLE) if require_multiple_of_32 else map(_UNIT_ROWS.__getitem__, bits)
    if any(map(operator.mod, rows, unit)) or max(rows) > MAX_INT16 or sum(rows) > MAX_K:
        return None
    return list(zip(bits, rows))


def q_groups_plan(values, q_weight_rows: int, *, tensor: str | None = None, file: str | None = None,
                  require_multiple_of_32: bool = True) -> list[tuple[int, int]]:
    """The checks of ``decode_q_groups`` on plain Python ints; returns [(bits, rows)] per group.

    ``values``: the q_groups entries as ints (a list, or the int16 values unpacked from the tensor's bytes).
    Needs no numpy (inspect reads only headers and q_groups).  Python ints cannot overflow, so a hostile
    q_weight row count fails a limit check instead of wrapping.  Raises ``Exl2Error`` (GROUPS_*).
    A valid vector takes the whole-list path (``_plan_if_valid``); anything else the rule-by-rule one.
    """
    vals = list(values)
    plan = _plan_if_valid(vals, q_weight_rows, require_multiple_of_32)
    if plan is not None:
        return plan
    return _q_groups_plan_checked(vals, q_weight_rows, tensor=tensor, file=file,
                                  require_multiple_of_32=require_multiple_of_32)


def _q_groups_plan_checked(vals: list, q_weight_rows: int, *, tensor: str | None = None, file: str | None = None,
                           require_multiple_of_32: bool = True) -> list[tuple[int, int]]:
    """``q_groups_plan`` rule by rule, in the order spec/exl2.md lists them: raises for the first broken one."""
    def fail(code, msg):
        raise Exl2Error(code, msg, tensor=tensor, file=file)

    if not vals or len(vals) % 2:
        fail(ErrorCode.SLOT_SHAPE, f"q_groups has {len(vals)} entries; expected an even, non-zero count (2G)")
    G = len(vals) // 2
    if G > MAX_INT16:
        fail(ErrorCode.GROUPS_LIMIT, f"{G} groups; at most {MAX_INT16} allowed")
    bits = vals[0::2]
    qrow = vals[1::2]
    for g, b in enumerate(bits):
        if b not in BIT_WIDTHS:
            fail(ErrorCode.GROUPS_BITS, f"group {g} has bit width {b}; allowed: "
                 f"{', '.join(map(str, sorted(EXL2_BITS)))}")
    # tiers: non-increasing, each width contiguous (non-increasing already implies contiguity)
    for g in range(1, G):
        if bits[g] > bits[g - 1]:
            fail(ErrorCode.GROUPS_ORDER,
                 f"group {g} has {bits[g]} bits after a {bits[g - 1]}-bit group; "
                 "bit widths must be non-increasing (8, 6, 5, 4, 3, 2)")
    if qrow[0] != 0:
        fail(ErrorCode.GROUPS_QROW, f"group 0 starts at q_weight row {qrow[0]}; expected 0")
    nxt = qrow[1:] + [int(q_weight_rows)]
    qrows = [n - q for n, q in zip(nxt, qrow)]
    for g in range(G):
        if qrow[g] < 0 or qrow[g] > MAX_INT16:
            fail(ErrorCode.GROUPS_LIMIT, f"group {g} starts at q_weight row {qrow[g]}; allowed 0..{MAX_INT16}")
        if qrows[g] <= 0:
            where = f"group {g + 1} at row {nxt[g]}" if g + 1 < G else f"end of q_weight ({q_weight_rows} rows)"
            fail(ErrorCode.GROUPS_QROW,
                 f"group {g} starts at q_weight row {qrow[g]} but the {where} does not lie after it")
        if (qrows[g] * 32) % bits[g]:
            fail(ErrorCode.GROUPS_ROWS,
                 f"group {g}: {qrows[g]} packed rows at {bits[g]} bits is not a whole number of input rows")
    rows = [q * 32 // b for q, b in zip(qrows, bits)]
    for g in range(G):
        unit = BIT_WIDTHS[bits[g]].rows_per_unit
        need = ROW_MULTIPLE if require_multiple_of_32 else unit
        if rows[g] % need:
            fail(ErrorCode.GROUPS_ROWS,
                 f"group {g} holds {rows[g]} input rows at {bits[g]} bits; must be a multiple of {need}")
        if rows[g] > MAX_INT16:
            fail(ErrorCode.GROUPS_LIMIT, f"group {g} holds {rows[g]} rows; at most {MAX_INT16} allowed")
    K = sum(rows)
    if K > MAX_K:
        fail(ErrorCode.GROUPS_LIMIT, f"K = {K} input rows; at most {MAX_K} allowed (uint16 permutations)")
    return list(zip(bits, rows))


def decode_q_groups(q_groups: np.ndarray, q_weight_rows: int, *, tensor: str | None = None,
                    file: str | None = None, require_multiple_of_32: bool = True) -> GroupTable:
    """Decode and check ``q_groups`` against the number of rows of ``q_weight``.

    ``q_groups``: integer array of shape (2G,), as stored (int16).  ``q_weight_rows``: q_weight.shape[0].
    Raises ``Exl2Error`` (GROUPS_*) naming the first broken rule (``q_groups_plan``).  Does not check K against
    q_invperm.
    """
    # one tolist, then Python ints: G is a few hundred, and numpy scalar indexing per group would dominate
    vals = np.asarray(q_groups).astype(np.int64).ravel().tolist()
    return group_table_from_rows(q_groups_plan(vals, q_weight_rows, tensor=tensor, file=file,
                                               require_multiple_of_32=require_multiple_of_32))
