"""EXL2 (ExLlamaV2): the layer class, its pack entry points and its inspect row.

``Exl2Linear`` holds a layer's arrays under their slot names (``Exl2Slot``); ``exl2_tensors`` packs chosen
codes into those slots; ``quantize_rtn`` chooses codes by round-to-nearest with ExLlamaV2's per-group scale
search (``AdaptiveQuantizer.find_params``: base scales, 4-bit quadratic codes, a 97-point grid over p in
[0.70, 1.20] minimising sum |err|^3.5) but without GPTQ error feedback - what the embedded sample and the
golden vectors use; the calibrated GPTQ quantizer is ``exl2fmt.quant``.  ``inspect_facts`` is the EXL2 part
of an ``inspect`` layer row.  Bit packing itself is ``exl2fmt.codec.exl2``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Mapping

from ..lazynp import np  # numpy on first use: inspect reads headers only

from ..errors import ErrorCode, Exl2Error, Issue, Severity
from ..groups import GroupTable, decode_q_groups, encode_q_groups, group_table_from_rows, q_groups_plan
from ..layout import BIT_WIDTHS, Exl2Geometry, Exl2Slot, Format, Tier, bpw, pad32, plan_desc, plan_rows
from .common import LinearBase

__all__ = ["Exl2Linear", "exl2_tensors", "quantize_rtn", "find_scales", "inspect_facts"]


@dataclass(frozen=True, eq=False)
class Exl2Linear(LinearBase):
    """An EXL2 linear layer.  ``tensors`` maps slot name (``q_weight`` ...) -> array; ``dtypes`` maps slot
    name -> safetensors dtype string.  ``out_features`` is the true N (None: N_pad, i.e. unknown)."""

    format: ClassVar[Format] = Format.EXL2
    key: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    out_features_hint: int | None = None
    file: str | None = None

    @cached_property
    def groups(self) -> GroupTable:
        """Decoded q_groups; raises Exl2Error if they break a rule."""
        qw = self.tensors.get(Exl2Slot.Q_WEIGHT)
        qg = self.tensors.get(Exl2Slot.Q_GROUPS)
        if qw is None or qg is None:
            missing = Exl2Slot.Q_WEIGHT if qw is None else Exl2Slot.Q_GROUPS
            raise Exl2Error(ErrorCode.SLOT_MISSING, f"required exl2 tensor '{missing}' is missing",
                            tensor=f"{self.key}.{missing}", file=self.file)
        if len(qw.shape) != 2 or len(qg.shape) != 1:
            raise Exl2Error(ErrorCode.SLOT_SHAPE, "q_weight must be 2-D and q_groups 1-D",
                            tensor=self.key, file=self.file)
        return decode_q_groups(np.asarray(qg), int(qw.shape[0]), tensor=f"{self.key}.{Exl2Slot.Q_GROUPS}", file=self.file)

    @property
    def in_features(self) -> int:
        return self.groups.K

    @property
    def n_pad(self) -> int:
        return int(self.tensors[Exl2Slot.Q_WEIGHT].shape[1])

    @property
    def out_features(self) -> int:
        n = self.out_features_hint
        return n if n is not None and pad32(n) == self.n_pad else self.n_pad

    @property
    def geometry(self) -> Exl2Geometry:
        g = self.groups
        return Exl2Geometry(K=g.K, N_pad=self.n_pad, G=g.G, Q=g.Q)

    def plan(self) -> str:
        """Group plan in ExLlamaV2's notation, e.g. ``0.05:8b_32g/0.95:4b_128g``."""
        self.raise_if_invalid()
        return plan_desc(self.groups.bits_rows())

    def validate(self, deep: bool = False) -> list[Issue]:
        issues = self._slot_presence_and_dtypes()
        if any(i.code is ErrorCode.SLOT_MISSING for i in issues):
            return issues
        qw = self.tensors[Exl2Slot.Q_WEIGHT]
        if len(qw.shape) != 2:
            return issues + [self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(qw.shape)}; expected [Q, N_pad]",
                                         Exl2Slot.Q_WEIGHT)]
        if qw.shape[1] % 32 or qw.shape[1] == 0:
            issues.append(self._issue(ErrorCode.N_PADDING, f"{qw.shape[1]} columns; N_pad must be a positive "
                                      "multiple of 32", Exl2Slot.Q_WEIGHT))
            return issues
        if len(self.tensors[Exl2Slot.Q_GROUPS].shape) != 1:
            return issues + [self._issue(ErrorCode.SLOT_SHAPE, "q_groups must be 1-D (2G,)", Exl2Slot.Q_GROUPS)]
        try:
            g = self.groups
        except Exl2Error as e:
            return issues + [e.as_issue()]
        inv = self.tensors[Exl2Slot.Q_INVPERM]
        if tuple(inv.shape) != (g.K,):
            issues.append(self._issue(ErrorCode.K_MISMATCH, f"the groups hold {g.K} input rows but q_invperm has "
                                      f"shape {list(inv.shape)}", Exl2Slot.Q_INVPERM))
        issues += self._slot_shapes(self.geometry, skip=(Exl2Slot.Q_INVPERM,))
        if deep and not issues:
            issues += self._deep_checks()
        return issues

    def permutation(self, slot: str) -> np.ndarray:
        """A permutation slot as int64; I16 storage is read as uint16, as ExLlamaV2's kernels do."""
        a = np.asarray(self.tensors[slot])
        if self.dtypes.get(slot) == "I16":
            a = a.view(np.uint16)
        return a.astype(np.int64)

    def _deep_checks(self) -> list[Issue]:
        from ..codec.exl2 import invert_permutation, is_permutation

        issues = []
        inv = self.permutation(Exl2Slot.Q_INVPERM)
        if not is_permutation(inv):
            issues.append(self._issue(ErrorCode.PERM_INVALID, f"not a permutation of 0..{inv.size - 1} "
                                      "(duplicate or out-of-range entries)", Exl2Slot.Q_INVPERM))
        elif Exl2Slot.Q_PERM in self.tensors:
            perm = self.permutation(Exl2Slot.Q_PERM)
            if not np.array_equal(perm, invert_permutation(inv)):
                issues.append(self._issue(ErrorCode.PERM_MISMATCH, "q_perm is not argsort(q_invperm)", Exl2Slot.Q_PERM))
        qsm = np.asarray(self.tensors[Exl2Slot.Q_SCALE_MAX]).astype(np.float32)
        bad = ~np.isfinite(qsm) | (qsm < 0)
        if bad.any():
            g = int(np.flatnonzero(bad)[0])
            issues.append(self._issue(ErrorCode.SCALE_MAX_INVALID, f"{int(bad.sum())} of {qsm.size} groups have a "
                                      f"non-finite or negative scale (first: group {g} = {qsm[g]})",
                                      Exl2Slot.Q_SCALE_MAX))
        zero = qsm == 0
        if zero.any():
            # ExLlamaV2 writes 0 for an all-zero group (its max scale underflows fp16); it decodes to zeros.
            issues.append(self._issue(ErrorCode.SCALE_MAX_INVALID, f"{int(zero.sum())} of {qsm.size} groups have "
                                      f"q_scale_max = 0 (first: group {int(np.flatnonzero(zero)[0])}); they decode "
                                      "to all-zero weights", Exl2Slot.Q_SCALE_MAX, severity=Severity.WARNING))
        issues += self._finite(Exl2Slot.BIAS)
        return issues

    def codes(self) -> np.ndarray:
        """Integer codes uint8 [K, N_pad] in stored (permuted) row order."""
        from ..codec.exl2 import unpack_q_weight

        return unpack_q_weight(np.asarray(self.tensors[Exl2Slot.Q_WEIGHT]), self.groups)

    def scale_codes(self) -> np.ndarray:
        from ..codec.exl2 import unpack_q_scale

        return unpack_q_scale(np.asarray(self.tensors[Exl2Slot.Q_SCALE]))

    def dequantize(self) -> np.ndarray:
        """``nn.Linear`` weight float16 [out_features, in_features], bit-exact with ExLlamaV2."""
        from ..codec.exl2 import dequantize

        self.raise_if_invalid(deep=True)  # the rules validate --deep and convert apply, before decoding
        t = self.tensors
        try:
            return dequantize(np.asarray(t[Exl2Slot.Q_WEIGHT]), np.asarray(t[Exl2Slot.Q_SCALE]), np.asarray(t[Exl2Slot.Q_SCALE_MAX]),
                              self.groups, self.permutation(Exl2Slot.Q_INVPERM), out_features=self.out_features)
        except ValueError as e:
            raise Exl2Error(ErrorCode.PERM_INVALID if "permutation" in str(e) else ErrorCode.SLOT_SHAPE, str(e),
                            tensor=self.key, file=self.file) from None

    def _decode_is_finite(self) -> bool:
        """No decoded weight can be NaN or Inf when, for every group, the largest magnitude the decode can reach
        stays finite: w = fp16((q - 2^(b-1)) * s) with |q - 2^(b-1)| <= 2^(b-1) and s <= fp16(256 * m) (scale
        code 15; rounding is monotone), m = fp16(q_scale_max / 256) finite and >= 0 (the deep checks).  O(G), so
        the output need not be scanned; a layer near the fp16 range is counted in the output instead."""
        qsm = np.asarray(self.tensors[Exl2Slot.Q_SCALE_MAX]).astype(np.float32)
        if qsm.shape != (self.groups.G,):
            return False
        with np.errstate(over="ignore", invalid="ignore"):
            m = (qsm * np.float32(2.0 ** -8)).astype(np.float16).astype(np.float32)
            s_max = (m * np.float32(256.0)).astype(np.float16).astype(np.float32)
            reach = s_max * np.ldexp(np.float32(1.0), self.groups.bits.astype(np.int32) - 1).astype(np.float32)
            return bool(np.isfinite(s_max).all() and (s_max >= 0).all() and (reach <= np.float32(65504.0)).all())

    def stats(self) -> dict:
        """Decode every weight and return {"mean", "std", "absmax", "nonfinite", "numel"} of the dequantized
        ``nn.Linear`` weight (exact fp16 values, padding excluded) without materializing it."""
        from ..codec.exl2_stats import layer_stats

        self.raise_if_invalid(deep=True)
        t = self.tensors
        return layer_stats(np.asarray(t[Exl2Slot.Q_WEIGHT]), np.asarray(t[Exl2Slot.Q_SCALE]), np.asarray(t[Exl2Slot.Q_SCALE_MAX]),
                           self.groups, out_features=self.out_features)

    def bias(self) -> np.ndarray | None:
        if Exl2Slot.BIAS not in self.tensors:
            return None
        return np.asarray(self.tensors[Exl2Slot.BIAS])[: self.out_features].astype(np.float16)


# ---------------------------------------------------------------------------------------------------- pack


def exl2_tensors(codes: np.ndarray, scale_codes: np.ndarray, q_scale_max: np.ndarray,
                 bits_rows: list[tuple[int, int]], q_invperm: np.ndarray,
                 bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Pack one layer.  ``codes`` uint8 [K, N_pad] (stored order), ``scale_codes`` uint8 [G, N_pad] in 0..15,
    ``q_scale_max`` [G] (stored as float16), ``q_invperm`` [K], ``bias`` [N] or [N_pad] (zero-padded).
    Returns slot name -> array with the dtypes of the layout table."""
    from ..codec.exl2 import pack_q_scale, pack_q_weight

    gt = group_table_from_rows(bits_rows)
    out = {
        Exl2Slot.Q_WEIGHT.value: pack_q_weight(codes, gt),
        Exl2Slot.Q_SCALE.value: pack_q_scale(scale_codes),
        Exl2Slot.Q_SCALE_MAX.value: np.asarray(q_scale_max).astype(np.float16),
        Exl2Slot.Q_GROUPS.value: encode_q_groups(bits_rows),
        Exl2Slot.Q_INVPERM.value: np.asarray(q_invperm).astype(np.int32),
    }
    if bias is not None:
        n_pad = codes.shape[1]
        b = np.zeros(n_pad, dtype=np.float16)
        b[: len(bias)] = np.asarray(bias).astype(np.float16)
        out[Exl2Slot.BIAS.value] = b
    return out


def find_scales(x: np.ndarray, bits: int, refine: bool = False, search: str = "full"):
    """Scale search for one group (ExLlamaV2's ``find_params``).  ``x`` float32 [rows, N_pad].

    Returns (scale_codes uint8 [N_pad] in 0..15, q_scale_max float16 scalar, s float32 [N_pad] = the exact
    fp16 scales used to quantize).  All-zero columns get code 0.  An all-zero group gets the smallest positive
    q_scale_max (the validator requires > 0); its scales round to 0 and every code is the zero point.
    ``refine``: afterwards, each column takes the nearby code with the smallest squared error
    (``codec.scale_search.refine_scale_codes``; exl2fmt's, not ExLlamaV2's).  ``search``: how the multiplier
    grid is searched, ``"full"`` (ExLlamaV2's 97 points) or ``"bracket"`` (``codec.scale_search.best_grid_index``).
    """
    from ..codec.scale_search import P_GRID, best_grid_index, final_scales, refine_scale_codes, search_start

    x = np.ascontiguousarray(x, dtype=np.float32)
    # (the arithmetic of each step is in codec.scale_search's kernels, float32 and fp16 rounding as ExLlamaV2's;
    # tests/test_scale_search.py holds the NumPy twin of this function)
    qs, trial, smax = search_start(x, bits)
    best_p = P_GRID[best_grid_index(x, trial, bits, search)]
    qsm = np.float16(max(float(np.float16(smax * best_p)), 2.0 ** -24))
    m = np.float32(np.float16(np.float32(qsm) * np.float32(1 / 256)))
    if refine:
        qs = refine_scale_codes(x, (qs - 1).astype(np.uint8), qsm, bits).astype(np.int64) + 1
    codes, s = final_scales(qs, m)
    return codes, qsm, s


def quantize_rtn(weight: np.ndarray, tiers: list[Tier], perm: np.ndarray | None = None,
                 bias: np.ndarray | None = None, refine_scales: bool = False) -> dict[str, np.ndarray]:
    """Quantize an ``nn.Linear`` weight [N, K] (any float dtype) to EXL2 tensors by round-to-nearest.

    ``perm`` [K]: stored row k holds input feature perm[k] (act-order); default identity.  K must be a
    multiple of 32; N is zero-padded to a multiple of 32.  ``refine_scales``: see ``find_scales(refine=)``.
    """
    w = np.asarray(weight, dtype=np.float32)
    N, K = w.shape
    n_pad = pad32(N)
    W = np.zeros((K, n_pad), dtype=np.float32)
    W[:, :N] = w.T
    if perm is None:
        perm = np.arange(K)
    perm = np.asarray(perm, dtype=np.int64)
    Ws = W[perm]
    bits_rows = plan_rows(K, tiers)
    codes = np.empty((K, n_pad), dtype=np.uint8)
    scale_codes = np.empty((len(bits_rows), n_pad), dtype=np.uint8)
    qsm = np.empty(len(bits_rows), dtype=np.float16)
    r0 = 0
    for g, (b, r) in enumerate(bits_rows):
        x = Ws[r0:r0 + r]
        c, m, s = find_scales(x, b, refine=refine_scales)
        z = BIT_WIDTHS[b].zero_point
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s > 0, np.rint(x / np.where(s > 0, s, 1)) + z, z)
        codes[r0:r0 + r] = np.clip(q, 0, (1 << b) - 1).astype(np.uint8)
        scale_codes[g] = c
        qsm[g] = m
        r0 += r
    invperm = np.argsort(perm).astype(np.int32)
    return exl2_tensors(codes, scale_codes, qsm, bits_rows, invperm, bias)


# ---------------------------------------------------------------------------------------------------- inspect


# Layers quantized with the same setting share their q_groups byte for byte (in a model from one optimizer run,
# most layers of a kind do), so inspect decodes each distinct vector once: (q_groups bytes, q_weight rows) ->
# (plan text, G, K, Q, ((bits, rows at that width), ...)), and (K, N_pad, G, Q, slot dtypes) -> bpw.  Both are
# pure functions of their keys; only vectors that pass every rule are kept, and at most _MEMO_MAX of each.
_PLAN_MEMO: dict = {}
_BPW_MEMO: dict = {}
_MEMO_MAX = 4096


def _plan_facts(raw: bytes, q_weight_rows: int, tensor: str, file: str | None) -> tuple:
    key = (raw, q_weight_rows)
    hit = _PLAN_MEMO.get(key)
    if hit is not None:
        return hit
    bits_rows = q_groups_plan(struct.unpack(f"<{len(raw) // 2}h", raw), q_weight_rows, tensor=tensor, file=file)
    per_bits: dict[int, int] = {}
    for b, r in bits_rows:
        per_bits[b] = per_bits.get(b, 0) + r
    hit = (plan_desc(bits_rows), len(bits_rows), sum(per_bits.values()), sum(r * b for b, r in bits_rows) // 32,
           tuple(per_bits.items()))
    if len(_PLAN_MEMO) < _MEMO_MAX:
        _PLAN_MEMO[key] = hit
    return hit


def _layer_bpw(K: int, N_pad: int, G: int, Q: int, dtypes: tuple) -> float | None:
    key = (K, N_pad, G, Q, dtypes)
    try:
        return _BPW_MEMO[key]
    except KeyError:
        pass
    try:
        v = bpw(Format.EXL2, Exl2Geometry(K=K, N_pad=N_pad, G=G, Q=Q), dict(dtypes))
    except KeyError:
        v = None
    if len(_BPW_MEMO) < _MEMO_MAX:
        _BPW_MEMO[key] = v
    return v


def inspect_facts(model, info, config, issues: list[Issue], features=None) -> dict:
    """The EXL2 part of an ``inspect`` layer row, from the headers plus the layer's q_groups vector (2G int16).

    ``info`` is a ``detect.LayerInfo``; returns ``{"K", "N", "G", "plan", "hist", "act", "bpw", "error"}``
    (``hist`` bits -> stored weights; ``N`` the true width when config.json names it, else N_pad).  A broken
    q_groups is appended to ``issues`` and named in ``error``.  ``features``: ``arch.features_of(config)``
    when the caller asks for many layers of one config."""
    if features is None:
        from ..arch import features_of

        features = features_of(config)
    K, N_stored, G = info.in_features, info.out_features, info.groups
    N = N_stored
    out = {"plan": None, "hist": {}, "act": True, "bpw": None, "error": None}
    n_cfg = features(info.key)[1]
    if N_stored is not None and n_cfg is not None and pad32(n_cfg) == N_stored:
        N = n_cfg
    slots = info.slots
    qg, qw = slots.get(Exl2Slot.Q_GROUPS), slots.get(Exl2Slot.Q_WEIGHT)
    if qg is not None and qw is not None and len(qw.shape) == 2 and len(qg.shape) == 1 and qg.dtype == "I16":
        raw = bytes(model.get_bytes(qg.name))  # int16 little-endian; plain ints, so inspect never imports numpy
        try:
            plan, G, gK, Q, per_bits = _plan_facts(raw, int(qw.shape[0]), qg.name, qg.file)
        except Exl2Error as e:
            out["error"] = e.message
            issues.append(e.as_issue())
        else:
            out["plan"] = plan
            if K is None:
                K = gK
            out["hist"] = {b: r * N_stored for b, r in per_bits}
            if K == gK:
                out["bpw"] = _layer_bpw(gK, N_stored, G, Q, tuple((s, t.dtype) for s, t in slots.items()))
    else:
        out["error"] = "q_groups or q_weight missing or malformed"
    out.update(K=K, N=N, G=G)
    return out
