"""The numerics of GGUF blocks for ``gguf_write``: the integers and scales a quantized layer multiplies
(``layer_integers``), the exact repack of Q8_0 / Q4_0 blocks (``repack_blocks``), the sized type ladders
(``sized_type``, ``type_bpw``) and the conversion of float32 data to a GGUF type (``to_gtype``, with
``searched=True`` the scale-searching quantizers of ``codec.ggml_quant``)."""

from __future__ import annotations

import numpy as np

from ..container import bf16_bits_to_f32, f32_to_bf16_bits
from .gguf_io import ggml_type
from .slots import G_IDX, Q_INVPERM, Q_SCALE_MAX, QWEIGHT, QZEROS, SCALES

__all__ = ["SIZED_LADDER", "SIZED_K_LADDER", "KQUANT_TYPES", "OWN_QUANTIZER_TYPES", "layer_integers", "type_bpw", "sized_type",
           "repack_blocks", "to_gtype", "offset_in_dtype", "source_f32"]

#: the 32-weight block types, cheapest first, then F16, which holds any source: IQ4_NL 4.5 bits per weight (Q4_0's
#: size, a non-uniform grid: lower error), Q4_1 5.0, Q5_0 5.5, Q5_1 6.0, Q8_0 8.5 (block scale(s) included), F16
#: 16.  A row whose length is a multiple of 32 but not of 256 gets these (llama.cpp's rule: K-quant super-blocks
#: hold 256 weights of one row; llama.cpp's own fallback for them is IQ4_NL too)
SIZED_LADDER = ("IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16")
#: the K-quants (``codec.ggml_quant``; the ``gguf`` package decodes them but has no quantizer), cheapest first:
#: Q2_K 2.625, Q3_K 3.4375, Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625, then Q8_0 8.5 and F16, for rows of 256k weights
SIZED_K_LADDER = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16")
KQUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: the types only exl2fmt's quantizer writes (the gguf package decodes them but has no quantizer)
OWN_QUANTIZER_TYPES = KQUANT_TYPES + ("IQ4_NL",)
_QRANGE = {"Q8_0": (-128, 127), "Q4_0": (-8, 7)}

# ------------------------------------------------------------------------------------------------ numerics


def layer_integers(layer, out_features: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The integers and scales a quantized layer multiplies: ``(q int16 [N, K], d float16 [N, K])`` with
    ``W[n, j] = fp16(q[n, j] * d[n, j])`` in ``nn.Linear`` orientation (original input order, N = the true
    output width).  EXL2: ``q = code - 2^(b-1)``, ``d = fp16(fp16((c+1)^2) * fp16(q_scale_max * 2^-8))`` per
    group and column; GPTQ: ``q = code - zero``, ``d = scale`` of the row's group.  None for dense layers."""
    from ..layout import Format

    if layer.format is Format.GPTQ:
        from ..codec.gptq import unpack_qweight, unpack_qzeros, zeros_from_fields

        t = layer.tensors
        bits = layer.bits
        codes = unpack_qweight(np.asarray(t[QWEIGHT]), bits).astype(np.int16)            # [K, N]
        zeros = zeros_from_fields(unpack_qzeros(np.asarray(t[QZEROS]), bits), layer.v2)   # [G, N]
        zeros = zeros[:, : codes.shape[1]]
        K = codes.shape[0]
        g = (np.asarray(t[G_IDX]).astype(np.int64) if G_IDX in t
             else np.arange(K, dtype=np.int64) // max(layer.group_size, 1))
        scales = np.asarray(t[SCALES])
        if layer.dtypes.get(SCALES) == "BF16":
            scales = bf16_bits_to_f32(scales)
        scales = np.asarray(scales, dtype=np.float16)
        q = codes - zeros[g].astype(np.int16)
        d = scales[g]
        return np.ascontiguousarray(q.T[:out_features]), np.ascontiguousarray(d.T[:out_features])
    if layer.format is Format.EXL2:
        t = layer.tensors
        codes = layer.codes().astype(np.int16)                                            # [K, N_pad] stored order
        c = layer.scale_codes().astype(np.int32)                                          # [G, N_pad]
        gt = layer.groups
        m = np.asarray(t[Q_SCALE_MAX], dtype=np.float16).reshape(-1) * np.float16(1.0 / 256.0)
        s = ((c + 1) ** 2).astype(np.float16) * m[:, None]                               # fp16 arithmetic
        K = codes.shape[0]
        d = np.empty(codes.shape, dtype=np.float16)
        for gi in range(gt.G):
            r0, r = int(gt.row_start[gi]), int(gt.rows[gi])
            codes[r0:r0 + r] -= np.int16(1 << (int(gt.bits[gi]) - 1))
            d[r0:r0 + r] = s[gi]
        inv = np.asarray(t[Q_INVPERM])
        if layer.dtypes.get(Q_INVPERM) == "I16":
            inv = inv.view(np.uint16)
        q_perm = np.argsort(inv.astype(np.int64), kind="stable")                         # original row of stored k
        q = np.empty_like(codes)
        dd = np.empty_like(d)
        q[q_perm] = codes
        dd[q_perm] = d
        del K
        return np.ascontiguousarray(q.T[:out_features]), np.ascontiguousarray(dd.T[:out_features])
    return None


def type_bpw(gtype: str) -> float:
    """Bits per weight of a GGUF type, its block scales included (Q4_0: 18 bytes per 32 weights = 4.5)."""
    import gguf

    bs, ts = gguf.GGML_QUANT_SIZES[ggml_type(gtype)]
    return ts * 8 / bs


def sized_type(bpw: float | None, cols: int) -> str:
    """The first type of the ladder the row length ``cols`` allows whose bits per weight are >= ``bpw`` (the
    source layer's, overhead included): ``SIZED_K_LADDER`` when ``cols`` is a multiple of 256, else
    ``SIZED_LADDER`` when it is a multiple of 32 (llama.cpp's block rule), else F16.  So the GGUF lands at or
    just above the source's size, never below it (a smaller type would lose more than the source's own
    quantization did)."""
    ladder = SIZED_K_LADDER if cols % 256 == 0 else SIZED_LADDER if cols % 32 == 0 else ("F16",)
    for t in ladder:
        if bpw is None or type_bpw(t) >= bpw - 1e-9:
            return t
    return "F16"


def _block_dtype(qname: str) -> np.dtype:
    return np.dtype([("d", "<f2"), ("qs", "i1" if qname == "Q8_0" else "u1", (32 if qname == "Q8_0" else 16,))])


def repack_blocks(w16: np.ndarray, q: np.ndarray | None, d: np.ndarray | None, qname: str,
                  searched: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 / Q4_0 blocks for ``w16`` (float16 [N, K], K a multiple of 32).

    ``q`` int16 [N, K] and ``d`` float16 [N, K] (``layer_integers``; None for a dense source): a block whose 32
    scales are one value, whose integers fit the type and whose ``fp16(q * d)`` equals ``w16`` is stored as
    exactly those integers and that scale; the other blocks are quantized from ``w16`` with ``gguf.quants``
    (``searched``: with ``codec.ggml_quant``'s scale search).  Returns (uint8 [N, K/32 * type_size] block bytes,
    bool [N, K/32] mask of the exact blocks)."""

    N, K = w16.shape
    nb = K // 32
    exact = np.zeros((N, nb), dtype=bool)
    if q is not None:
        lo, hi = _QRANGE[qname]
        qb = q.reshape(N, nb, 32)
        db = d.reshape(N, nb, 32)
        with np.errstate(over="ignore", invalid="ignore"):
            rec = (qb.astype(np.float32) * db[..., :1].astype(np.float32)).astype(np.float16)
        exact = ((db == db[..., :1]).all(-1) & np.isfinite(db[..., 0]) & (qb >= lo).all(-1) & (qb <= hi).all(-1)
                 & (rec.view(np.uint16) == w16.reshape(N, nb, 32).view(np.uint16)).all(-1))
    bdt = _block_dtype(qname)
    if exact.all():
        out = np.empty((N, nb), dtype=bdt)
    else:
        base = to_gtype(w16.astype(np.float32), qname, searched)
        out = np.ascontiguousarray(base).view(bdt).reshape(N, nb).copy()
    if exact.any():
        qb = q.reshape(N, nb, 32)
        out["d"][exact] = d.reshape(N, nb, 32)[..., 0][exact]
        if qname == "Q8_0":
            out["qs"][exact] = qb[exact].astype(np.int8)
        else:
            nib = (qb[exact] + 8).astype(np.uint8)
            out["qs"][exact] = nib[:, :16] | (nib[:, 16:] << 4)
    return out.view(np.uint8).reshape(N, nb * bdt.itemsize), exact


def to_gtype(w32: np.ndarray, gtype: str, searched: bool = False) -> np.ndarray:
    """float32 [.., cols] -> GGUF data of ``gtype`` (F32/F16: typed arrays; BF16: uint16 bits; blocks: uint8).
    Blocks come from ``gguf.quants`` (plain rounding, llama.cpp's converter's bytes) unless ``searched`` or the
    type is a K-quant or IQ4_NL: then from ``codec.ggml_quant`` (a least-squares scale search per block)."""
    from gguf import quants

    if gtype == "F32":
        return np.ascontiguousarray(w32, dtype=np.float32)
    if gtype == "F16":
        with np.errstate(over="ignore", invalid="ignore"):
            return np.ascontiguousarray(w32.astype(np.float16))
    if gtype == "BF16":
        return f32_to_bf16_bits(w32)
    if searched or gtype in OWN_QUANTIZER_TYPES:
        from ..codec.ggml_quant import quantize

        x = np.ascontiguousarray(w32, dtype=np.float32)
        return quantize(x.reshape(-1, x.shape[-1]), gtype).reshape(*x.shape[:-1], -1)
    return np.ascontiguousarray(quants.quantize(np.ascontiguousarray(w32, dtype=np.float32), ggml_type(gtype)))


def offset_in_dtype(x: np.ndarray, offset: float, dtype: str) -> np.ndarray:
    """``x + offset`` (float32 sum) rounded to the source dtype (F16/BF16/F32), as float32: llama.cpp adds Gemma's +1 to
    the tensor in its stored dtype (conversion/gemma.py ``data_torch + 1``) before the cast to F32."""
    y = x.astype(np.float32) + np.float32(offset)  # torch's half/bfloat16 add: float32 sum, one rounding
    if dtype == "F16":
        return y.astype(np.float16).astype(np.float32)
    if dtype == "BF16":
        return bf16_bits_to_f32(f32_to_bf16_bits(y.astype(np.float32)))
    return y.astype(np.float32)


def source_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_bits_to_f32(a) if dtype == "BF16" else np.asarray(a, dtype=np.float32)
