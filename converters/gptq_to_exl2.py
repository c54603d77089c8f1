"""GPTQ -> EXL2: keep the GPTQ integers as far as EXL2's scale grid allows.

An EXL2 group stores one fp16 ``q_scale_max`` M and, per output column, a 4-bit code c; the column's scale is
``S = fp16(fp16((c+1)^2) * fp16(M/256))``, the zero point is fixed at ``z = 2^(b-1)``.  A GPTQ column scale s
is arbitrary, so it is generally not on that grid: the conversion re-encodes the scales and, where needed, the
codes, minimising the squared error against the GPTQ reconstruction ``fp16(fp16(q - z) * s)``:

* rows: EXL2 stores rows in act-order; the permutation sorts input rows by ``g_idx`` (stable), so each GPTQ
  group becomes a contiguous run of stored rows, and ``q_invperm = argsort(perm)``.  Trivial ``g_idx`` gives the
  identity permutation.
* plan: one tier of ``--bits`` bits (default: the GPTQ bits) in groups of ``--group-size`` rows (default: the
  GPTQ group size when it is a multiple of 32, K for ``group_size = -1`` when K <= 32767, else 128).
* per EXL2 group and column: the candidate Ms are ExLlamaV2's range rule (max column range / (maxq/2) times a
  grid of 26 multipliers in [0.70, 1.20]) plus, for a symmetric GPTQ group, the values that put the group's
  largest GPTQ scale exactly on the grid divided by t = 1..2^(bits - b) (so the EXL2 codes can be
  ``t * (q - z_gptq) + z``: the GPTQ integers kept, scaled); for each M every column takes the code c of least
  error and the M of least total error wins.  Codes are ``round(x / S) + z``, clamped.
* asymmetric GPTQ (zero points other than 2^(b-1)) has no symmetric equivalent and is always re-quantized.

The error of each layer against the GPTQ reconstruction (relative Frobenius, max abs) is reported; a layer
whose error is 0 is exact.  Dense layers (``lm_head`` of most GPTQ models) and every other tensor are kept.
"""

from __future__ import annotations

import copy

import numpy as np
from numba import njit, prange

from .. import __version__
from ..codec.f16 import f16_bits_to_f32, f32_to_f16_bits
from ..layout import EXL2_BITS, Format
from ..errors import ErrorCode, Exl2Error
from .registry import register
from ..container import SourceReader
from .base import (Converter, LayerReport, OutSpec, Unit, build_layer, error_stats, layer_issues_or_raise)
from ..names import natural_key
from .slots import EXL2_BIAS, G_IDX, Q_GROUPS, Q_INVPERM, Q_SCALE, Q_SCALE_MAX, Q_WEIGHT

__all__ = ["GptqToExl2", "fit_exl2_group", "gptq_layer_to_exl2"]

_P_GRID = np.linspace(0.70, 1.20, 26, dtype=np.float32)


def _f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


@njit(cache=True, parallel=True)
def _grid_errors(vals, weights, mvals, sq, bits, col_err, col_code):
    """For every candidate m (= fp16(M/256)) and column n: the least weighted squared error over the 16 scale
    codes and the code that gives it.  vals/weights float32 [V, N]; mvals float32 [nM]; sq float32 [16] =
    fp16((c+1)^2); outputs col_err float64 [nM, N], col_code uint8 [nM, N]."""
    V, N = vals.shape
    maxq = np.float32((1 << bits) - 1)
    z = np.float32(1 << (bits - 1))
    for n in prange(N):
        for mi in range(mvals.shape[0]):
            best = np.inf
            bc = 0
            for c in range(16):
                s = f16_bits_to_f32(f32_to_f16_bits(sq[c] * mvals[mi]))
                if not s > 0:
                    continue
                e = 0.0
                for v in range(V):
                    w = weights[v, n]
                    if w == 0:
                        continue
                    x = vals[v, n]
                    q = np.rint(x / s) + z
                    q = min(max(q, np.float32(0)), maxq)
                    d = f16_bits_to_f32(f32_to_f16_bits((q - z) * s)) - x
                    e += np.float64(w) * np.float64(d) * np.float64(d)
                if e < best:
                    best = e
                    bc = c
            col_err[mi, n] = best
            col_code[mi, n] = bc


def fit_exl2_group(x: np.ndarray, bits: int, weights: np.ndarray | None = None, m_candidates=()):
    """Choose EXL2 scales for one group.

    ``x`` float32 [R, N]: values to represent (rows of the group, or the distinct values of each column with
    ``weights`` [R, N] = their multiplicities).  Candidates for q_scale_max: ExLlamaV2's range rule (largest
    column max|x| / (maxq/2)) times 26 multipliers in [0.70, 1.20], plus ``m_candidates``; for each, every
    column takes the scale code of least squared error (exact fp16 scale rounding), and the candidate with the
    least total error wins.  Returns (scale codes uint8 [N] in 0..15, q_scale_max float16, S float32 [N] =
    the exact fp16 scales they give).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    N = x.shape[1]
    maxq = (1 << bits) - 1
    amax = np.abs(x).max(axis=0, initial=0)
    smax = float(amax.max(initial=0)) / (maxq / 2)
    if smax == 0:
        return np.zeros(N, dtype=np.uint8), np.float16(1.0), np.full(N, np.float32(1 / 256))
    cands = {float(np.float16(smax * p)) for p in _P_GRID}
    cands |= {float(np.float16(m)) for m in m_candidates if np.isfinite(m) and m > 0}
    cands = np.array(sorted(c for c in cands if np.isfinite(c) and c > 0), dtype=np.float32)
    mvals = _f16(cands * np.float32(1 / 256))
    sq = _f16((np.arange(16, dtype=np.float32) + 1) ** 2)
    w = np.ones_like(x) if weights is None else np.ascontiguousarray(weights, dtype=np.float32)
    col_err = np.empty((cands.size, N), dtype=np.float64)
    col_code = np.empty((cands.size, N), dtype=np.uint8)
    _grid_errors(x, w, mvals, sq, bits, col_err, col_code)
    best = int(np.argmin(col_err.sum(axis=1)))
    codes = col_code[best]
    S = _f16(sq[codes] * mvals[best])
    return codes, np.float16(cands[best]), S


def gptq_layer_to_exl2(layer, bits: int, group_size: int):
    """Convert one ``GptqLinear``: returns (exl2 slot -> array, reference fp16 [N, K], rows plan [(bits, rows)])."""
    from ..codec.gptq import unpack_qweight, unpack_qzeros, zeros_from_fields
    from ..layout import BIT_WIDTHS, Tier, pad32, plan_rows
    from ..formats.exl2 import exl2_tensors
    from .slots import QWEIGHT, QZEROS

    t = layer.tensors
    b_src = layer.bits
    K, N = layer.K, layer.N
    n_pad = pad32(N)
    ref = layer.dequantize()                                          # [N, K] fp16: the GPTQ reconstruction
    codes_g = unpack_qweight(np.asarray(t[QWEIGHT]), b_src)           # [K, N] original order
    zeros = zeros_from_fields(unpack_qzeros(np.asarray(t[QZEROS]), b_src), layer.v2)[:, :N]   # [G, N]
    scales = ref_scales = layer.scales_f16()                          # [G, N] fp16
    if G_IDX in t:
        g_idx = np.asarray(t[G_IDX]).astype(np.int64)
    else:
        g_idx = np.minimum(np.arange(K) // layer.group_size, layer.G - 1)
    perm = np.argsort(g_idx, kind="stable")                           # stored row k holds original perm[k]
    invperm = np.argsort(perm).astype(np.int32)
    x_all = ref.T[perm].astype(np.float32)                            # [K, N] stored order
    g_sorted = g_idx[perm]
    bits_rows = plan_rows(K, [Tier(1.0, bits, group_size)])
    z_e = BIT_WIDTHS[bits].zero_point
    codes = np.full((K, n_pad), z_e, dtype=np.uint8)
    scale_codes = np.zeros((len(bits_rows), n_pad), dtype=np.uint8)
    qsm = np.zeros(len(bits_rows), dtype=np.float16)
    z_sym = 1 << (b_src - 1)
    r0 = 0
    for gi, (_, rows) in enumerate(bits_rows):
        r1 = r0 + rows
        x = x_all[r0:r1]
        hs = np.unique(g_sorted[r0:r1])
        m_cands = []
        vals, weights = x, None
        if hs.size == 1:
            h = int(hs[0])
            zc = zeros[h]
            if np.all(zc == z_sym):
                smax = float(ref_scales[h].astype(np.float32).max(initial=0))
                T = max(1, (1 << (bits - 1)) // z_sym)
                m_cands = [smax / tt for tt in range(1, T + 1)]
            if (1 << b_src) < rows:                                  # fit on the distinct values, weighted
                qv = np.arange(1 << b_src, dtype=np.float32)[:, None]
                vals = ((qv - zc[None, :].astype(np.float32)) * scales[h].astype(np.float32)[None, :]).astype(
                    np.float16).astype(np.float32)
                cg = codes_g[perm[r0:r1]]
                weights = np.stack([(cg == q).sum(axis=0) for q in range(1 << b_src)]).astype(np.float64)
        c, M, S = fit_exl2_group(vals, bits, weights, m_cands)
        q = np.clip(np.rint(x / S[None, :]) + z_e, 0, (1 << bits) - 1)
        codes[r0:r1, :N] = q.astype(np.uint8)
        scale_codes[gi, :N] = c
        qsm[gi] = M
        r0 = r1
    b = layer.bias()
    tensors = exl2_tensors(codes, scale_codes, qsm, bits_rows, invperm, None if b is None else b[:N])
    return tensors, ref, bits_rows


class GptqToExl2(Converter):
    source, target = "gptq", "exl2"

    def plan(self) -> list[Unit]:
        from ..arch import gptq_config

        o = self.options
        gc = gptq_config(self.config)
        units: list[Unit] = []
        layer_infos = []
        for key, info in self.detection.layers.items():
            if info.format is Format.GPTQ:
                layer_infos.append(info)
            elif info.format is not Format.DENSE:
                raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{info.format.value} layer in a GPTQ model", tensor=key)
        self.plain_dtype = {"fp16": "F16", "bf16": "BF16", None: None}[o.dtype]
        if o.group_size is not None and (o.group_size <= 0 or o.group_size % 32):
            raise Exl2Error(ErrorCode.USAGE, f"EXL2 group size must be a positive multiple of 32, got {o.group_size}")
        self.exl2_units = []
        for info in layer_infos:
            units.append(self._layer_unit(info, gc))
        handled = {i.key for i in layer_infos}
        units += [self.cast_unit(n, self.plain_dtype) for n in self.plain_tensor_names(handled)]
        units.sort(key=lambda u: (u.key.startswith("lm_head"), natural_key(u.key)))
        return units

    def _layer_unit(self, info, gc) -> Unit:
        from ..layout import MAX_INT16, Exl2Geometry, pad32, plan_rows, Tier, Format, LAYOUTS

        key, K, N = info.key, info.in_features, info.out_features
        b_src = info.bits
        if K is None or N is None or b_src is None:
            raise Exl2Error(ErrorCode.SLOT_SHAPE, "cannot tell the GPTQ layer's shape", tensor=key)
        bits = self.options.bits or b_src   # the option: checked by convert (options.check_bits)
        if bits not in EXL2_BITS:  # pragma: no cover - GPTQ bits are all EXL2 widths
            raise Exl2Error(ErrorCode.USAGE, f"no EXL2 width for {bits} bits")
        gs_src = gc.group_size if gc.group_size is not None else (
            -1 if info.groups == 1 else -(-K // info.groups) if info.groups else 128)
        if self.options.group_size is not None:
            gs = self.options.group_size
        elif gs_src != -1 and gs_src % 32 == 0 and gs_src <= 1024:
            gs = gs_src
        elif gs_src == -1 and K <= MAX_INT16:
            gs = K
        else:
            gs = 128
        if K % 32:
            raise Exl2Error(ErrorCode.GROUPS_ROWS, f"K = {K} is not a multiple of 32; EXL2 cannot hold it", tensor=key)
        bits_rows = plan_rows(K, [Tier(1.0, bits, gs)])
        G = len(bits_rows)
        n_pad = pad32(N)
        geom = Exl2Geometry(K=K, N_pad=n_pad, G=G, Q=sum(r * b for b, r in bits_rows) // 32)
        dt = {Q_WEIGHT: "I32", Q_SCALE: "I32", Q_SCALE_MAX: "F16", Q_GROUPS: "I16", Q_INVPERM: "I32"}
        slots = {s.name: s for s in LAYOUTS[Format.EXL2]}
        outs = [OutSpec(f"{key}.{n}", d, tuple(slots[n].shape(geom))) for n, d in dt.items()]
        if info.has_bias:
            outs.append(OutSpec(f"{key}.{EXL2_BIAS}", "F16", (n_pad,)))
        rep = LayerReport(key, "gptq", "exl2", (N, K))
        self.report.layers.append(rep)
        self.exl2_units.append((key, K, n_pad, info.has_bias, outs))
        reader, config, report = self.reader, self.config, self.report

        def produce():
            layer = build_layer(reader, info, config)
            layer_issues_or_raise(layer, report)
            rep.source_plan = layer.plan()
            tensors, ref, br = gptq_layer_to_exl2(layer, bits, gs)
            from ..formats import layer_from_tensors

            got = layer_from_tensors(key, tensors, fmt=Format.EXL2, out_features=N)
            rep.target_plan = got.plan()
            s = error_stats(got.dequantize(), ref)
            rep.exact = s["mismatches"] == 0
            rep.rel_error, rep.max_abs_error = s["rel_error"], s["max_abs_error"]
            rep.rows_requantized = 0 if rep.exact else K
            if not rep.exact:
                rep.notes.append(f"re-encoded on EXL2's scale grid: {s['mismatches']} of {N * K} weights differ "
                                 "from the GPTQ reconstruction")
            return {f"{key}.{n}": tensors[n] for n in [o.name.rsplit(".", 1)[1] for o in outs]}

        def verify(dst: SourceReader):
            from ..formats import layer_from_tensors

            t = {o.name.rsplit(".", 1)[1]: dst.read(o.name) for o in outs}
            got_layer = layer_from_tensors(key, t, fmt=Format.EXL2, out_features=N)
            issues = [i for i in got_layer.validate(deep=True) if i.severity.value == "error"]
            if issues:
                raise issues[0].to_error()
            ref = build_layer(reader, info, config).dequantize()
            s = error_stats(got_layer.dequantize(), ref)
            ok = (s["mismatches"] == 0) if rep.exact else abs(s["rel_error"] - rep.rel_error) <= 1e-6 * max(
                1.0, rep.rel_error)
            rep.verified = ok
            if not ok:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the EXL2 layer does not decode to what the conversion "
                                f"claimed (relative error {s['rel_error']:.3e}, claimed {rep.rel_error:.3e})",
                                tensor=key)

        return Unit(key, outs, produce, verify, rep, full_verify=True)

    def _decoder_bpw(self) -> float | None:
        from ..names import block_of

        bits = numel = 0
        for key, K, n_pad, has_bias, outs in self.exl2_units:
            if block_of(key) is None:
                continue
            bits += sum(o.nbytes for o in outs) * 8
            numel += K * n_pad + (n_pad if has_bias else 0)
        return bits / numel if numel else None

    def output_config(self) -> dict | None:
        cfg = copy.deepcopy(self.config) if self.config is not None else {}
        bpw = self._decoder_bpw()
        head = self.detection.layers.get("lm_head")
        qc = {"quant_method": "exl2", "version": f"exl2fmt {__version__}",
              "bits": round(bpw, 4) if bpw is not None else None,
              "head_bits": 16 if head is None or head.format is Format.DENSE else (self.options.bits or head.bits),
              "calibration": {"rows": 0, "length": 0, "dataset": "(none: converted from GPTQ by exl2fmt)"}}
        cfg["quantization_config"] = qc
        cfg["torch_dtype"] = "float16"
        if "dtype" in cfg:
            cfg["dtype"] = "float16"
        self.report.quantization_config = qc
        self.report.config_changes += [f"quantization_config = exl2 (bits {qc['bits']}: the measured decoder bpw)",
                                       "torch_dtype = float16"]
        return cfg


register("gptq", "exl2")(GptqToExl2)
