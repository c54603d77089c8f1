"""EXL2 / GPTQ / dense Hugging Face models (the architectures of ``gguf_arch``) -> one GGUF file that llama.cpp runs.

``convert_to_gguf(src, dst, gguf_type=...)`` (reached through ``exl2fmt.converters.convert(..., to="gguf")``):

1. Plan: every source tensor gets its GGUF name from the ``gguf`` package's table (``converters.gguf_map``)
   and a GGUF type: 1-D tensors (norms, biases) F32; 2-D weights the chosen type (``f32``, ``f16``, ``bf16``,
   ``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``; a quantized type falls back to F16 for a row length that is
   not a multiple of 32, as llama.cpp's converter does).  ``auto`` (the default) keeps a dense model's dtype
   (BF16 stays BF16, the rest F16); for a GPTQ model it picks Q4_0 when every quantized layer's integers fit
   Q4_0 (GPTQ symmetric <= 4 bits, groups a multiple of 32 rows, no act-order), Q8_0 when they fit Q8_0.  Any
   other quantized model (EXL2, other GPTQ) is written near its own size (issue 40): each quantized layer gets
   ``sized_type`` of its stored bits per weight, the cheapest of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (the types
   ``gguf.quants`` can write) whose bits per weight are >= the layer's, F16 above 8.5 or for a row length no
   block divides.  ``f16`` is the exact path (F16 holds any EXL2/GPTQ reconstruction exactly).  Unquantized
   tensors of a quantized model stay F16/BF16 under ``auto``.
2. Write, tensor by tensor (memory: about one layer): the header, metadata and tensor table are written first
   (``GGUFWriter.add_tensor_info``: every shape and type is known), then each tensor's data as soon as it is
   produced.  Q/K rows are permuted for the ``llama`` arch (``gguf_map.permute_qk``).
3. Quantized layers to Q8_0 / Q4_0 are *repacked* where the math allows: a 32-element block (one output row,
   32 consecutive input features) whose source weights share one fp16 scale ``d`` and whose integers fit the
   target (Q8_0: -128..127; Q4_0: -8..7) is stored as exactly those integers and ``d``.  Its float32 decode is
   then ``d * q``, exactly the real value the source encodes, and its fp16 rounding equals the source's fp16
   reconstruction bit for bit (EXL2 and GPTQ both compute ``fp16(q * d)`` with ``q`` exact).  Every other block
   is quantized with ``gguf.quants`` from the source's fp16 reconstruction.  A layer is reported *exact* when
   every element of its decode, rounded to fp16, equals the source reconstruction; otherwise its relative and
   max error are reported.  GPTQ symmetric 4-bit with groups of 32k rows and trivial ``g_idx`` -> Q4_0, and
   GPTQ symmetric 8-bit (or <= 7-bit) -> Q8_0, are exact.  EXL2 layers are exact only where a block lies in
   one group of one scale, which EXL2's input permutation rarely allows.  Stacked experts (``[E, N, K]``) are
   repacked the same way, expert by expert, and each quantized expert is a layer of the report.
4. Verify: the temporary file (in ``.<name>.exl2fmt-partial-<hex>/`` next to DST) is re-read through exl2fmt's
   bounded GGUF reader (``exl2fmt.gguf_scan``; ``gguf.GGUFReader`` too with ``verify="full"``); names, types and
   shapes must be the planned ones, every tensor's bytes must
   match the CRC-32 of what was produced, and the key hyper-parameters must read back.  ``verify="full"``
   also decodes every layer from the file again and compares it with a fresh decode of SRC.  Then the file is
   renamed to DST (an existing DST only with ``force``).  SRC is only read.

Metadata: the hyper-parameters from ``config.json`` (block count, context length, widths, heads, rms eps,
rope base and dimension, key/value length when ``head_dim`` is explicit, vocab size, linear rope scaling) and
the tokenizer (``converters.gguf_vocab``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..container import SourceReader, bf16_bits_to_f32, f32_to_bf16_bits
from ..container.partials import fault_point
from ..container.publish import (check_paths, lower_shield, make_partial_dir, name_unnamed_os_error, publish,
                                 remove_path, stale_note)
from ..errors import ErrorCode, Exl2Error
from .base import (ConversionReport, LayerReport, TensorReport, build_layer, error_stats, layer_issues_or_raise)
from ..names import natural_key
from .gguf_map import DROPPED_SUFFIXES, arch_of, gguf_name_map, permute_qk, qk_heads
from .gguf_io import decode, ggml_type
from .slots import G_IDX, Q_INVPERM, Q_SCALE_MAX, QWEIGHT, QZEROS, SCALES

__all__ = ["convert_to_gguf", "GGUF_TYPES", "SIZED_LADDER", "repack_blocks", "layer_integers", "sized_type",
           "type_bpw"]

#: --gguf-type values
GGUF_TYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
#: the block types the ``gguf`` package can write (a numpy ``quants.quantize``; gguf 0.19 has none for the
#: K-quants, IQ types or Q8_1, and TQ1_0/TQ2_0 are ternary), cheapest first, then F16, which holds any source:
#: Q4_0 4.5 bits per weight, Q4_1 5.0, Q5_0 5.5, Q5_1 6.0, Q8_0 8.5 (block scale(s) included), F16 16
SIZED_LADDER = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16")
#: the plan's marker for "each quantized layer gets ``sized_type`` of its own bpw" (``--gguf-type auto`` on an
#: EXL2 source, or a GPTQ source whose integers fit no block type)
_SIZED = "SIZED"
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
    """The first type of ``SIZED_LADDER`` whose bits per weight are >= ``bpw`` (the source layer's, overhead
    included) and whose block divides the row length ``cols`` (llama.cpp's rule); F16 when none does.  So the
    GGUF lands at or just above the source's size, never below it (a smaller type would lose more than the
    source's own quantization did)."""
    import gguf

    for t in SIZED_LADDER:
        bs = gguf.GGML_QUANT_SIZES[ggml_type(t)][0]
        if cols % bs == 0 and (bpw is None or type_bpw(t) >= bpw - 1e-9):
            return t
    return "F16"


def _block_dtype(qname: str) -> np.dtype:
    return np.dtype([("d", "<f2"), ("qs", "i1" if qname == "Q8_0" else "u1", (32 if qname == "Q8_0" else 16,))])


def repack_blocks(w16: np.ndarray, q: np.ndarray | None, d: np.ndarray | None, qname: str
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 / Q4_0 blocks for ``w16`` (float16 [N, K], K a multiple of 32).

    ``q`` int16 [N, K] and ``d`` float16 [N, K] (``layer_integers``; None for a dense source): a block whose 32
    scales are one value, whose integers fit the type and whose ``fp16(q * d)`` equals ``w16`` is stored as
    exactly those integers and that scale; the other blocks are quantized from ``w16`` with ``gguf.quants``.
    Returns (uint8 [N, K/32 * type_size] block bytes, bool [N, K/32] mask of the exact blocks)."""
    from gguf import quants

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
        base = quants.quantize(w16.astype(np.float32), ggml_type(qname))
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


# ------------------------------------------------------------------------------------------------ plan


@dataclass
class _Item:
    gguf_name: str
    src: str                        # HF tensor name, or layer key for a linear layer
    gtype: str                      # F32 / F16 / BF16 / Q8_0 / Q4_0
    shape: tuple[int, ...]          # numpy order
    produce: Callable[[], np.ndarray]
    redecode: Callable[[], np.ndarray] | None = None   # fresh float32 reference for verify="full"
    report: LayerReport | TensorReport | None = None
    sum: tuple | None = None
    stack: tuple[str, ...] | None = None  # source names of the experts a stacked tensor holds
    stack_rank: int = 0                   # its place among the stacked tensors of one block
    parts: tuple = ()                     # the LayerReports of the quantized experts a stacked tensor holds

    @property
    def nbytes(self) -> int:
        import gguf

        bs, ts = gguf.GGML_QUANT_SIZES[ggml_type(self.gtype)]
        n = int(np.prod(self.shape, dtype=np.int64))
        return n // bs * ts

    @property
    def byte_shape(self) -> tuple[int, ...]:
        import gguf

        bs, ts = gguf.GGML_QUANT_SIZES[ggml_type(self.gtype)]
        if self.gtype in ("F32", "F16"):
            return self.shape
        return (*self.shape[:-1], self.shape[-1] // bs * ts)


def _hparams(cfg: dict) -> dict:
    def need(*names):
        for n in names:
            v = cfg.get(n)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return v
        raise Exl2Error(ErrorCode.CONFIG_INVALID, f"config.json lacks {names[0]} (needed for GGUF metadata)")

    h = {"n_layer": int(need("num_hidden_layers")), "n_embd": int(need("hidden_size")),
         "n_ff": int(need("intermediate_size")), "n_head": int(need("num_attention_heads")),
         "n_ctx": int(cfg.get("max_position_embeddings") or 4096),
         "eps": float(cfg.get("rms_norm_eps") or 1e-5), "rope_theta": float(cfg.get("rope_theta") or 10000.0),
         "vocab": int(need("vocab_size"))}
    h["n_kv"] = int(cfg.get("num_key_value_heads") or h["n_head"])
    hd = cfg.get("head_dim")
    h["head_dim_explicit"] = isinstance(hd, int) and hd > 0 and hd * h["n_head"] != h["n_embd"]
    h["head_dim"] = int(hd) if isinstance(hd, int) and hd > 0 else h["n_embd"] // h["n_head"]
    return h


def _auto_type(det, cfg: dict, model, reader: SourceReader) -> tuple[str, str]:
    """(layer type, plain-tensor type) for --gguf-type auto."""
    from ..arch import gptq_config
    from ..layout import Format

    plain = "BF16" if str(cfg.get("torch_dtype") or cfg.get("dtype") or "").lower() in ("bfloat16", "bf16") else "F16"
    if det.format is Format.DENSE:
        return plain, plain
    if det.format is Format.GPTQ:
        gc = gptq_config(cfg)
        gs_ok = gc.group_size is not None and (gc.group_size == -1 or gc.group_size % 32 == 0)
        if gc.sym and gs_ok and not gc.desc_act and gc.bits is not None:
            if gc.bits <= 4:
                return "Q4_0", "F16"
            if gc.bits <= 8:
                return "Q8_0", "F16"
    # EXL2, or GPTQ integers that fit no block exactly: each layer near its own size (issue 40; --gguf-type
    # f16 is the exact path)
    return _SIZED, "F16"


def convert_to_gguf(src, dst, *, gguf_type: str = "auto", force: bool = False, progress=None,
                    verify: str = "auto", _fail_after: int | None = None) -> ConversionReport:
    """Convert the model directory (or .safetensors file) ``src`` into the GGUF file ``dst``; see the module
    docstring.  Returns a ``ConversionReport`` (target ``gguf``); raises ``Exl2Error``."""
    import gguf

    from ..container import open_model
    from ..detect import detect_model
    from ..layout import Format

    t_start = time.perf_counter()
    gt = str(gguf_type or "auto").lower()
    if gt not in GGUF_TYPES:
        raise Exl2Error(ErrorCode.USAGE, f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    src_p, dst_p = Path(os.fspath(src)), Path(os.fspath(dst))
    model = open_model(src)
    reader = SourceReader(model)
    try:
        check_paths(src_p, dst_p, force, kind="gguf")
        if dst_p.is_dir():
            raise Exl2Error(ErrorCode.USAGE, "the GGUF destination is a directory; name a .gguf file",
                            file=str(dst_p))
        cfg = model.config
        arch, permute = arch_of(cfg, file=str(src_p))
        det = detect_model(model.tensors, cfg, root=model.root)
        fatal = [i for i in det.issues if i.code is ErrorCode.FORMAT_AMBIGUOUS]
        if fatal:
            raise fatal[0].to_error()
        if det.format not in (Format.EXL2, Format.GPTQ, Format.DENSE):
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{det.format.value} models cannot be converted to GGUF",
                            file=str(src_p))
        report = ConversionReport(source=str(src), destination=str(dst), source_format=det.format.value,
                                  target="gguf", options={"gguf_type": gt, "force": force, "verify": verify})
        for i in det.issues:
            report.warnings.append(f"detect: [{i.code.value}] {i.message}")
        if det.format is Format.DENSE:   # cast as tensors: count them as inspect does (issue 12)
            report.linear_layers = len(det.layers)
        from .gguf_arch import router_semantics_warning

        w_router = router_semantics_warning(cfg)
        if w_router:
            report.warnings.append(w_router)
        hp = _hparams(cfg)
        if gt == "auto":
            layer_t, plain_t = _auto_type(det, cfg, model, reader)
        else:
            layer_t = plain_t = gt.upper()
        report.options["layer_type"], report.options["plain_type"] = layer_t, plain_t
        items = _plan(model, reader, det, cfg, arch, permute, hp, layer_t, plain_t, report)
        if layer_t == _SIZED:
            layer_t = _sized_summary(items, report)
        report.seconds["plan"] = time.perf_counter() - t_start
        _write_and_publish(items, model, src_p, dst_p, arch, hp, layer_t, report, force, progress, verify,
                           _fail_after)
    finally:
        reader.close()
    report.seconds["total"] = time.perf_counter() - t_start
    return report


def _plan(model, reader, det, cfg, arch, permute, hp, layer_t, plain_t, report) -> list[_Item]:
    from ..layout import Format

    from .gguf_arch import spec_for_model_type

    spec = spec_for_model_type(cfg.get("model_type"))
    name_of = gguf_name_map(arch, hp["n_layer"])
    items: list[_Item] = []
    owned: set[str] = set()
    shard: dict[str, str] = {}  # source name -> its shard file (llama.cpp's tensor order: shard, then name)
    experts: dict[tuple[str, str], dict[int, tuple[str, object]]] = {}  # (prefix, proj) -> expert -> source

    def gtype_2d(want: str, cols: int, what: str, bpw: float | None = None) -> str:
        if want == _SIZED:
            return sized_type(bpw, cols)
        if want not in ("F32", "F16", "BF16") and cols % 32:
            report.warnings.append(f"{what}: row length {cols} is not a multiple of 32; written as F16")
            return "F16"
        return want

    for key, info in det.layers.items():
        if info.format is Format.DENSE:
            continue  # its weight (and bias) are plain tensors below
        owned.update(ti.name for ti in info.slots.values())
        shard[info.key] = str(next(iter(info.slots.values())).file)
        if info.format not in (Format.EXL2, Format.GPTQ):
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{info.format.value} layers cannot be converted",
                            tensor=key)
        wname = f"{key}.weight"
        em = _EXPERT.match(wname)
        if em is not None:  # one expert of a stacked tensor: reconstructed, stacked below
            experts.setdefault((em["pre"], em["w"]), {})[int(em["e"])] = ("layer", info)
            continue
        g = name_of(wname)
        if g is None:
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"no GGUF name for {wname} in the gguf package's {arch} "
                            "table", tensor=key)
        from ..arch import expected_features

        n = expected_features(cfg, key)[1] or info.out_features
        k = info.in_features
        heads = qk_heads(wname, hp["n_head"], hp["n_kv"]) if permute else None
        items.append(_layer_item(reader, info, cfg, g, wname, (n, k), gtype_2d(layer_t, k, wname, _info_bpw(info)),
                                 heads, report))
        if info.has_bias:
            bname = f"{key}.bias"
            items.append(_layer_bias_item(reader, info, cfg, name_of(bname) or g[:-7] + ".bias", bname, n, heads,
                                          report))
    for name in sorted(model.tensors, key=natural_key):
        if name in owned:
            continue
        if name.endswith(DROPPED_SUFFIXES):
            report.warnings.append(f"{name}: dropped (derived at load time)")
            continue
        if name in spec.skip:
            report.warnings.append(f"{name}: not written ({spec.gguf_arch} ties it to the embedding, as llama.cpp)")
            continue
        ti = model.info(name)
        shard[name] = str(ti.file)
        em = _EXPERT.match(name)
        if em is not None:
            experts.setdefault((em["pre"], em["w"]), {})[int(em["e"])] = ("plain", name)
            continue
        g = name_of(name)
        if g is None:
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"no GGUF name for {name} in the gguf package's {arch} "
                            "table", tensor=name)
        if ti.dtype not in ("F16", "BF16", "F32"):
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"a {ti.dtype} tensor cannot be written to GGUF",
                            tensor=name)
        shape = tuple(int(x) for x in ti.shape)
        if len(shape) == 1 or name.endswith("norm.weight") or not name.endswith(".weight") or _always_f32(g):
            gtype = "F32"
        elif len(shape) == 2:
            gtype = gtype_2d(plain_t, shape[1], name)
        else:
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"a {len(shape)}-D tensor is not part of the Llama family "
                            "mapping", tensor=name)
        heads = qk_heads(name, hp["n_head"], hp["n_kv"]) if permute else None
        offset = spec.norm_offset if name.endswith("norm.weight") else 0.0
        items.append(_plain_item(reader, name, ti.dtype, g, shape, gtype, heads, report, offset))
    for (pre, wid), parts in sorted(experts.items()):
        items.append(_stacked_item(model, reader, cfg, det, pre, wid, parts, name_of, plain_t, layer_t, gtype_2d,
                                   spec, hp, report))
        for kind, x in parts.values():
            if kind == "plain":
                owned.add(x)
    if spec.model_type == "phi3":
        items += _rope_factor_items(cfg, str(model.root), report)
    planned = (owned | {it.src for it in items} | {n for n in model.tensors if n.endswith(DROPPED_SUFFIXES)}
               | set(spec.skip))
    if set(model.tensors) - planned:  # pragma: no cover - a planning bug must never drop weights silently
        raise RuntimeError(f"tensors left out of the GGUF plan: {sorted(set(model.tensors) - planned)[:3]}")

    def order(it: _Item):
        def file_of(n: str) -> str:  # a plain tensor by name, a quantized layer by its key
            return shard.get(n, shard.get(n.removesuffix(".weight"), ""))

        if it.stack is not None:  # llama.cpp emits a stacked tensor when its last expert arrives
            last = max(it.stack, key=lambda n: (file_of(n), n))
            return file_of(last), last, it.stack_rank
        src = it.src if it.src.endswith((".weight", ".bias")) else it.src + ".weight"
        return shard.get(it.src, ""), src, 0

    items.sort(key=order)  # llama.cpp's order: shards by file name, tensors of a shard by Hugging Face name
    return items


def _numel(info) -> int:
    return max(1, int(info.in_features or 0) * int(info.out_features or 0))


def _info_bpw(info) -> float:
    """A quantized layer's stored bits per weight from its header (every slot, as ``inspect``'s bpw)."""
    return info.stored_bytes * 8 / _numel(info)


def _sized_summary(items: list[_Item], report) -> str:
    """After a sized plan: the types the quantized layers got (``options["layer_types"]``: type -> layers) and
    the file type, the type that holds the most of their weights."""
    per: dict[str, list[int]] = {}
    for it in items:
        n_layers = len(it.parts) if it.parts else (1 if isinstance(it.report, LayerReport) else 0)
        if n_layers:
            c = per.setdefault(it.gtype, [0, 0])
            c[0] += n_layers
            c[1] += int(np.prod(it.shape, dtype=np.int64))
    report.options["layer_types"] = {t: c[0] for t, c in sorted(per.items(), key=lambda kv: -kv[1][1])}
    main = max(per, key=lambda t: per[t][1]) if per else "F16"
    report.options["layer_type"] = "sized" if len(per) > 1 else main
    return main


def _rope_factor_items(cfg: dict, root: str, report) -> list[_Item]:
    """Phi-3 long-rope: ``rope_factors_long/short.weight`` (F32, 1-D) from config.json, first in the file as
    llama.cpp writes its generated tensors before the model's (``gguf_arch.phi3_rope_factors``)."""
    from .gguf_arch import ROPE_FACTOR_TENSORS, phi3_rope_factors

    lr = phi3_rope_factors(cfg, root)
    if lr is None:
        return []
    out = []
    for name, arr in zip(ROPE_FACTOR_TENSORS, lr[1:]):
        rep = TensorReport(name, "F32", "F32")
        rep.max_abs_error, rep.nonfinite = 0.0, 0
        report.tensors.append(rep)
        out.append(_Item(name, name, "F32", arr.shape, lambda a=arr: iter([a]), redecode=lambda a=arr: a,
                         report=rep))
    return out


#: ``<prefix>.experts.<e>.<proj>.weight``: one expert's matrix (Mixtral w1/w2/w3, Qwen-MoE gate/up/down_proj)
_EXPERT = re.compile(r"^(?P<pre>.+)\.experts\.(?P<e>\d+)\.(?P<w>\w+)\.weight$")
#: llama.cpp stacks each block's experts in this order (conversion/llama.py w1, w2, w3; conversion/qwen.py
#: down, gate, up)
_STACK_RANK = {"w1": 0, "w2": 1, "w3": 2, "down_proj": 0, "gate_proj": 1, "up_proj": 2}


def _always_f32(gguf_name: str | None) -> bool:
    """Tensor kinds llama.cpp's converter keeps F32 whatever the output type (routers, position embeddings)."""
    if gguf_name is None:
        return False
    base = gguf_name.rsplit(".", 1)[0]
    kind = base.split(".")[-1] if base.startswith("blk.") else base
    return kind in ("ffn_gate_inp", "ffn_gate_inp_shexp", "position_embd", "token_types")


def _stacked_item(model, reader, cfg, det, pre, wid, parts, name_of, plain_t, layer_t, gtype_2d, spec, hp,
                  report) -> _Item:
    """One GGUF tensor ``[E, N, K]`` holding every expert ``<pre>.experts.<e>.<wid>.weight`` (e = 0..E-1)."""
    E = max(parts) + 1
    if sorted(parts) != list(range(E)):
        raise Exl2Error(ErrorCode.CONFIG_MISMATCH, f"experts {sorted(set(range(E)) - set(parts))} of {pre} "
                        f"{wid} are missing", tensor=f"{pre}.experts")
    merged = f"{pre}.experts.{wid}.weight"
    g = name_of(merged)
    if g is None:
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"no GGUF name for the stacked experts {merged} in the gguf "
                        "package's table", tensor=merged)
    srcs, decoders, shapes, quantized = [], [], set(), False
    for e in range(E):
        kind, x = parts[e]
        if kind == "plain":
            ti = model.info(x)
            shapes.add(tuple(int(v) for v in ti.shape))
            srcs.append(x)
            decoders.append(lambda x=x, dt=ti.dtype: _source_f32(reader.read(x), dt))
        else:
            from ..arch import expected_features

            quantized = True
            n = expected_features(cfg, x.key)[1] or x.out_features
            shapes.add((n, x.in_features))
            srcs.append(f"{x.key}.weight")

            def dec(info=x, n=n):
                layer = build_layer(reader, info, cfg)
                layer_issues_or_raise(layer, report)
                return layer.dequantize()[:n].astype(np.float32)

            decoders.append(dec)
    if len(shapes) != 1:
        raise Exl2Error(ErrorCode.CONFIG_MISMATCH, f"the experts of {merged} have different shapes {sorted(shapes)}",
                        tensor=merged)
    N, K = shapes.pop()
    q_infos = [x for kind, x in parts.values() if kind == "layer"]
    bpw = (sum(x.stored_bytes for x in q_infos) * 8 / sum(_numel(x) for x in q_infos)) if q_infos else None
    gtype = gtype_2d(layer_t if quantized else plain_t, K, merged, bpw)
    rep = TensorReport(merged, "experts", gtype)
    report.tensors.append(rep)
    # a quantized expert is a linear layer of its own in the report (exact or not, as _layer_item scores one)
    expert_reps = {e: LayerReport(x.key, x.format.value, "gguf", (N, K)) for e, (kind, x) in parts.items()
                   if kind == "layer"}
    report.layers.extend(expert_reps[e] for e in sorted(expert_reps))

    def ref():
        return np.stack([d() for d in decoders])

    def expert_blocks(e: int) -> np.ndarray:
        """Expert ``e`` as ``gtype`` data [N, ...]: a quantized expert's integers repacked where they fit the block
        type (Q8_0 / Q4_0, as ``_layer_item`` does), so GPTQ 4-bit experts become exact Q4_0 blocks instead of a
        second quantization of their fp16 reconstruction."""
        kind, x = parts[e]
        if kind == "plain":
            return _to_gtype(decoders[e](), gtype)
        layer = build_layer(reader, x, cfg)
        layer_issues_or_raise(layer, report)
        w16 = layer.dequantize()[:N]
        lrep = expert_reps[e]
        lrep.source_plan, lrep.target_plan = layer.plan(), gtype
        out = _layer_blocks(layer, w16, N, gtype, lrep)
        _score(lrep, decode(out, gtype).reshape(N, K), w16)
        return out

    def produce():
        out = np.stack([expert_blocks(e) for e in range(E)])
        x = ref()
        back = decode(out.reshape(E * N, -1), gtype).reshape(x.shape)
        with np.errstate(invalid="ignore"):
            rep.max_abs_error = float(np.nanmax(np.abs(back - x))) if x.size else 0.0
        rep.exact = rep.max_abs_error == 0.0
        return out

    return _Item(g, merged, gtype, (E, N, K), produce, ref, rep, stack=tuple(srcs),
                 stack_rank=_STACK_RANK.get(wid, 0), parts=tuple(expert_reps[e] for e in sorted(expert_reps)))


def _to_gtype(w32: np.ndarray, gtype: str) -> np.ndarray:
    """float32 [.., cols] -> GGUF data of ``gtype`` (F32/F16: typed arrays; BF16: uint16 bits; blocks: uint8)."""
    from gguf import quants

    if gtype == "F32":
        return np.ascontiguousarray(w32, dtype=np.float32)
    if gtype == "F16":
        with np.errstate(over="ignore", invalid="ignore"):
            return np.ascontiguousarray(w32.astype(np.float16))
    if gtype == "BF16":
        return f32_to_bf16_bits(w32)
    return np.ascontiguousarray(quants.quantize(np.ascontiguousarray(w32, dtype=np.float32), ggml_type(gtype)))


def _offset_in_dtype(x: np.ndarray, offset: float, dtype: str) -> np.ndarray:
    """``x + offset`` (float32 sum) rounded to the source dtype (F16/BF16/F32), as float32: llama.cpp adds Gemma's +1 to
    the tensor in its stored dtype (conversion/gemma.py ``data_torch + 1``) before the cast to F32."""
    y = x.astype(np.float32) + np.float32(offset)  # torch's half/bfloat16 add: float32 sum, one rounding
    if dtype == "F16":
        return y.astype(np.float16).astype(np.float32)
    if dtype == "BF16":
        return bf16_bits_to_f32(f32_to_bf16_bits(y.astype(np.float32)))
    return y.astype(np.float32)


def _source_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_bits_to_f32(a) if dtype == "BF16" else np.asarray(a, dtype=np.float32)


#: rows of a plain tensor are converted and written this many float32 bytes at a time (peak memory: one chunk
#: a few times over, not the tensor)
_CHUNK_BYTES = 8 << 20


def _plain_item(reader, name, dtype, g, shape, gtype, heads, report, offset: float = 0.0) -> _Item:
    rep = TensorReport(name, dtype, gtype)
    report.tensors.append(rep)
    rows = shape[0] if len(shape) >= 1 else 1
    row_elems = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else (shape[0] if shape else 1)
    if len(shape) <= 1:
        rows, row_elems = 1, int(np.prod(shape, dtype=np.int64))

    def convert(x: np.ndarray) -> np.ndarray:
        if offset:
            x = _offset_in_dtype(x, offset, dtype)
        return x

    def ref() -> np.ndarray:
        x = convert(_source_f32(reader.read(name), dtype))
        return permute_qk(x, heads, name) if heads else x

    def account(x: np.ndarray, out: np.ndarray) -> None:
        back = decode(out, gtype).reshape(x.shape)
        fin = np.isfinite(x)
        bad = int(np.count_nonzero(fin & ~np.isfinite(back)))
        with np.errstate(invalid="ignore"):
            diff = np.abs(np.where(fin & np.isfinite(back), back - x, 0))
        rep.max_abs_error = max(rep.max_abs_error or 0.0, float(diff.max()) if diff.size else 0.0)
        rep.nonfinite = (rep.nonfinite or 0) + bad

    def produce():
        rep.max_abs_error, rep.nonfinite = 0.0, 0
        if heads or len(shape) != 2:  # Q/K rows move across the tensor; 1-D tensors are small
            x = ref()
            out = _to_gtype(x, gtype)
            account(x, out)
            yield out
        else:
            step = max(1, _CHUNK_BYTES // max(1, row_elems * 4))
            if gtype not in ("F32", "F16", "BF16"):
                step = max(1, step)  # block types quantize whole rows; any row count is a whole number of blocks
            same = dtype == gtype and dtype in ("F16", "BF16", "F32") and not offset
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                raw = reader.read_rows(name, r0, r1)
                if same:  # F16 -> F16 (BF16 -> BF16, F32 -> F32): the stored bits are the GGUF data, exactly
                    yield raw
                    continue
                x = convert(_source_f32(raw, dtype))
                out = _to_gtype(x, gtype)
                account(x, out)
                yield out
        rep.exact = rep.nonfinite == 0 and rep.max_abs_error == 0.0
        if rep.nonfinite:
            report.warnings.append(f"{name}: {rep.nonfinite} values are not finite as {gtype}")

    return _Item(g, name, gtype, shape, produce, ref, rep)


def _layer_item(reader, info, cfg, g, wname, shape, gtype, heads, report) -> _Item:
    N, K = shape
    key = info.key
    rep = LayerReport(key, info.format.value, "gguf", (N, K))
    report.layers.append(rep)

    def reconstruct():
        layer = build_layer(reader, info, cfg)
        w = layer.dequantize_finite()
        if w.shape != (N, K):
            raise Exl2Error(ErrorCode.SLOT_SHAPE, f"dequantized to {list(w.shape)}, planned {[N, K]}", tensor=key)
        return layer, w

    def produce():
        layer, w16 = reconstruct()
        layer_issues_or_raise(layer, report)
        rep.source_plan = layer.plan()
        rep.target_plan = gtype
        out = _layer_blocks(layer, w16, N, gtype, rep)
        back = decode(out, gtype).reshape(N, K)
        _score(rep, back, w16)
        if heads:
            out = permute_qk(out, heads, wname)
        return out

    def ref():
        _, w16 = reconstruct()
        w = w16.astype(np.float32)
        return permute_qk(w, heads, wname) if heads else w

    return _Item(g, key, gtype, (N, K), produce, ref, rep)


def _layer_blocks(layer, w16: np.ndarray, N: int, gtype: str, rep: LayerReport) -> np.ndarray:
    """The GGUF data of one quantized layer: for Q8_0/Q4_0 the source's own integers and scales repacked where
    they fit a block exactly (``repack_blocks``; the rest quantized by gguf.quants, counted in ``rep``), otherwise
    its fp16 reconstruction ``w16`` (float16 [N, K]) converted to ``gtype``."""
    if gtype not in ("Q8_0", "Q4_0"):
        return _to_gtype(w16.astype(np.float32), gtype)
    qd = layer_integers(layer, N)
    q, d = (None, None) if qd is None else qd
    out, exact_mask = repack_blocks(w16, q, d, gtype)
    n_exact, n_blocks = int(exact_mask.sum()), exact_mask.size
    rep.notes.append(f"{n_exact}/{n_blocks} blocks repacked exactly (source integers and scale), "
                     f"{n_blocks - n_exact} quantized by gguf.quants")
    rep.rows_requantized = int((~exact_mask).any(axis=1).sum())
    return out


def _score(rep: LayerReport, back: np.ndarray, w16: np.ndarray) -> None:
    """exact: the decode rounded to fp16 is the source reconstruction bit for bit."""
    with np.errstate(over="ignore", invalid="ignore"):
        b16 = back.astype(np.float16)
    rep.exact = bool(np.array_equal(b16.view(np.uint16), np.ascontiguousarray(w16).view(np.uint16)))
    if rep.exact:
        rep.rel_error = rep.max_abs_error = 0.0
    else:
        s = error_stats(back, w16)
        rep.rel_error, rep.max_abs_error = s["rel_error"], s["max_abs_error"]


def _layer_bias_item(reader, info, cfg, g, bname, N, heads, report) -> _Item:
    rep = TensorReport(bname, "F16", "F32")
    report.tensors.append(rep)

    def ref():
        b = build_layer(reader, info, cfg).bias()[:N].astype(np.float32)
        return permute_qk(b, heads, bname) if heads else b

    return _Item(g, bname, "F32", (N,), lambda: np.ascontiguousarray(ref()), ref, rep)


# ------------------------------------------------------------------------------------------------ write


_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
               "Q5_1": "MOSTLY_Q5_1", "Q5_0": "MOSTLY_Q5_0", "Q4_1": "MOSTLY_Q4_1", "Q4_0": "MOSTLY_Q4_0"}


#: the source's files that the GGUF's metadata is derived from (gguf.Metadata.load, SpecialVocab, gguf_vocab)
_METADATA_INPUTS = ("README.md", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "tokenizer.model", "added_tokens.json", "special_tokens_map.json", "merges.txt", "vocab.json",
                    "chat_template.json", "chat_template.jinja")


@contextlib.contextmanager
def _staged_inputs(src_dir: Path, report):
    """A private copy of ``_METADATA_INPUTS`` (and ``additional_chat_templates/*.jinja``) that passed the
    side-file gate, named like the source directory (gguf.Metadata derives the model name from it).  A card that
    exl2fmt wrote for a quantized source is replaced by the original card it kept (its tags and format are not
    this GGUF's)."""
    from ..container.sidefiles import stage_side_files
    from ..modelcard import is_generated_card, original_card

    names = list(_METADATA_INPUTS)
    extra = src_dir / "additional_chat_templates"
    if extra.is_dir() and not extra.is_symlink():
        with contextlib.suppress(OSError):
            names += sorted(f"additional_chat_templates/{e.name}" for e in os.scandir(extra)
                            if e.name.endswith(".jinja"))
    with stage_side_files(src_dir, names, report.warnings) as d:
        card = d / "README.md"
        if card.is_file():
            text = card.read_text(encoding="utf-8", errors="replace")
            if is_generated_card(text):
                orig = original_card(text)
                if orig:
                    card.write_text(orig, encoding="utf-8")
                else:
                    card.unlink()
        yield d


def _metadata(w, arch, hp, cfg, layer_t, model, items, report, card_dir: Path | None = None) -> None:
    """Hyper-parameters (``gguf_arch.write_common_hparams`` + the architecture's own table entry) and the
    ``general.*`` block as llama.cpp's converter derives it (``gguf.Metadata.load`` on the model directory:
    model card, directory name heuristics for name/basename/finetune/size label; ``gguf.size_label`` from the
    parameter count when the card gives none)."""
    import gguf

    from .gguf_arch import spec_for_model_type, write_common_hparams

    spec = spec_for_model_type(cfg.get("model_type"))
    from .gguf_arch import phi3_rope_factors

    if spec.model_type == "phi3" and (lr := phi3_rope_factors(cfg, str(model.root))) is not None:
        # llama.cpp adds it while generating the factor tensors, before any other metadata (conversion/phi.py)
        w.add_rope_scaling_attn_factors(lr[0])
    root = Path(str(model.root))
    total, shared, expert, n_exp = w.get_total_parameter_count()
    log = logging.getLogger("gguf")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        meta = gguf.Metadata.load(None, card_dir, None, total)
    except Exception as e:  # noqa: BLE001 - a malformed model card must not stop the conversion
        report.warnings.append(f"model card metadata not read ({type(e).__name__}: {e})")
        meta = gguf.Metadata()
    finally:
        log.setLevel(level)
    if meta.name is None:
        meta.name = root.name if root.is_dir() else root.stem
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_exp)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    if spec.model_type == "llama" and cfg.get("head_dim") is None and \
            cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        # llama.cpp's converter sees transformers' LlamaConfig, which fills head_dim = hidden / heads, so it
        # writes key_length / value_length even when config.json has no head_dim (bench/gguf_stream.py)
        cfg = {**cfg, "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}
    log.setLevel(logging.ERROR)  # a family entry overriding a generic key is intended (gguf logs a warning)
    try:
        if spec.common:
            write_common_hparams(cfg, w, hp["n_layer"], report.warnings, head_dim_keys=spec.head_dim_keys)
        if spec.hparams is not None:
            spec.hparams(cfg, w)
    finally:
        log.setLevel(level)
    w.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[layer_t]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string("general.source.format", report.source_format)
    from .. import __version__

    w.add_string("general.quantized_by", f"exl2fmt {__version__}")
    if report.source_format != "dense":
        # A dense source gets exactly the general.* block llama.cpp's converter derives from its card (above), so
        # the file stays byte-identical with llama.cpp's (spec/vectors/gguf/).  A quantized EXL2/GPTQ source has
        # no such counterpart: its card's facts are added where the card did not already give them.
        _card_metadata(w, cfg, model, layer_t, report, meta)


def _card_metadata(w, cfg, model, layer_t, report, meta) -> None:
    """The model card of a GGUF output, as general.* metadata (``exl2fmt.modelcard.gguf_card_metadata``), for the
    keys ``meta`` (gguf.Metadata from the source's card) left unset."""
    from ..modelcard import gguf_card_metadata

    given = {"general.base_model": bool(getattr(meta, "base_models", None)),
             "general.license": bool(getattr(meta, "license", None)),
             "general.tags": bool(getattr(meta, "tags", None)),
             "general.description": bool(getattr(meta, "description", None))}
    for key, kind, value in gguf_card_metadata(model.root, cfg, report.source_format, layer_t):
        if any(key.startswith(k) and v for k, v in given.items()):
            continue
        if kind == "u32":
            w.add_uint32(key, value)
        elif kind == "strs":
            w.add_array(key, value)
        else:
            w.add_string(key, value)


def _type_name(type_id: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(int(type_id)).name
    except ValueError:
        return f"type {type_id}"


class _Digest:
    """CRC-32 and length of a byte stream fed in pieces (zlib: several GB/s, no JIT to load).  It guards the
    copy from memory to disk of bytes this process produced (a torn or misplaced write), not against an adversary."""

    __slots__ = ("crc", "n")

    def __init__(self):
        self.crc, self.n = 0, 0

    def update(self, data) -> "_Digest":
        import zlib

        self.crc = zlib.crc32(data, self.crc)
        self.n += memoryview(data).nbytes
        return self

    def digest(self) -> tuple[int, int]:
        return self.crc, self.n


def _digest_of_file_range(path: str, offset: int, length: int, window: int = 16 << 20) -> bytes:
    """``_Digest`` of ``length`` bytes of ``path`` at ``offset``, read ``window`` bytes at a time (pread)."""
    d = _Digest()
    buf = bytearray(min(window, max(length, 1)))
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos, end = offset, offset + length
        while pos < end:
            n = os.preadv(fd, [mv[: min(len(buf), end - pos)]], pos)
            if n <= 0:
                raise Exl2Error(ErrorCode.TRUNCATED, "the written file is shorter than its tensor table", file=path)
            d.update(mv[:n])
            pos += n
    finally:
        os.close(fd)
    return d.digest()


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def scalar_kvs(path, keys: set[str]) -> dict:
    """The values of the scalar (and string) metadata ``keys`` of a little-endian GGUF file that has passed the
    bounded pre-scan (so every length read here is known to lie inside the file)."""
    import mmap
    import struct

    out: dict = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        n_kv = struct.unpack_from("<Q", mm, 16)[0]
        pos = 24

        def string(p):
            n = struct.unpack_from("<Q", mm, p)[0]
            return bytes(mm[p + 8:p + 8 + n]).decode("utf-8", "replace"), p + 8 + n

        def skip(t, p):
            if t in _GGUF_SCALARS:
                return p + struct.calcsize("<" + _GGUF_SCALARS[t])
            if t == 8:
                return string(p)[1]
            et, cnt = struct.unpack_from("<IQ", mm, p)
            p += 12
            if et in _GGUF_SCALARS:
                return p + cnt * struct.calcsize("<" + _GGUF_SCALARS[et])
            for _ in range(cnt):
                p = skip(et, p)
            return p

        for _ in range(n_kv):
            key, pos = string(pos)
            t = struct.unpack_from("<I", mm, pos)[0]
            pos += 4
            if key in keys and t in _GGUF_SCALARS:
                out[key] = struct.unpack_from("<" + _GGUF_SCALARS[t], mm, pos)[0]
            elif key in keys and t == 8:
                out[key] = string(pos)[0]
            pos = skip(t, pos)
    return out


def _write_and_publish(items, model, src_p, dst_p, arch, hp, layer_t, report, force, progress, verify,
                       _fail_after) -> None:
    import gguf

    t0 = time.perf_counter()
    removed: list[str] = []
    tmp_dir = make_partial_dir(dst_p, removed)  # marked, so a killed run's leftover is removed by the next
    report.warnings.extend(stale_note(removed))
    tmp = tmp_dir / dst_p.name
    w = None
    try:
        fault_point("partial")
        w = gguf.GGUFWriter(None, arch)
        for it in items:  # the tensor table first: the parameter count (size label) is read from it
            bshape = it.byte_shape
            dt = {"F32": np.float32, "F16": np.float16}.get(it.gtype, np.uint8)
            w.add_tensor_info(it.gguf_name, bshape, np.dtype(dt), it.nbytes,
                              raw_dtype=None if it.gtype in ("F32", "F16") else ggml_type(it.gtype))
        from .gguf_vocab import add_tokenizer

        from .gguf_arch import spec_for_model_type

        spec = spec_for_model_type(model.config.get("model_type"))
        tok_dir = src_p if src_p.is_dir() else src_p.parent
        # the card, configs and tokenizer files that go into the metadata are read from gated, bounded copies
        # (container.sidefiles: no link out of the source, no FIFO, no multi-GB README read whole)
        with _staged_inputs(tok_dir, report) as safe_dir:
            _metadata(w, arch, hp, model.config, layer_t, model, items, report,
                      card_dir=safe_dir if Path(str(model.root)).is_dir() else None)
            n_vocab = next((it.shape[0] for it in items if it.gguf_name == "token_embd.weight"), hp["vocab"])
            tok = add_tokenizer(w, safe_dir, n_vocab, report.warnings, spec.extra.get("vocab"))
            report.options["tokenizer"] = tok
            if spec.tokenizer is not None and tok.get("model") != "none":
                spec.tokenizer(w, safe_dir)
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(it.nbytes for it in items)
        done = 0
        for ui, it in enumerate(items):
            if _fail_after is not None and ui >= _fail_after:
                raise RuntimeError("injected failure (test hook)")
            produced = it.produce()
            chunks = [produced] if isinstance(produced, np.ndarray) else produced
            fout = w.fout[0]
            w.write_padding(fout, fout.tell())  # the data of each tensor starts aligned, as write_tensor_data
            cs, n = _Digest(), 0
            for arr in chunks:
                b = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                cs.update(b)
                fout.write(b)
                n += b.nbytes
                del arr, b
            if n != it.nbytes:  # pragma: no cover - converter bug
                raise RuntimeError(f"{it.gguf_name}: produced {n} bytes, planned {it.nbytes}")
            w.write_padding(fout, it.nbytes)
            it.sum = cs.digest()
            done += it.nbytes
            if progress is not None:
                progress(done, 2 * total, it.src)
        for f in w.fout or []:
            f.flush()
            os.fsync(f.fileno())
        w.close()
        w = None
        report.bytes_written = os.path.getsize(tmp)
        report.files_written = [dst_p.name]
        report.shards = [dst_p.name]
        report.seconds["write"] = time.perf_counter() - t0
        fault_point("written")
        t0 = time.perf_counter()
        _verify(tmp, items, hp, arch, report, progress, total, verify)
        report.seconds["verify"] = time.perf_counter() - t0
        fault_point("verified")
        publish(tmp, dst_p, force)
        tmp = None
        fault_point("published")
    except BaseException as e:
        raise name_unnamed_os_error(e, tmp) from None
    finally:
        if w is not None:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - cleanup only
                pass
        if tmp is not None:
            remove_path(tmp)
        remove_path(tmp_dir)
        report.warnings.extend(lower_shield())


def _verify(path: Path, items, hp, arch, report, progress, total, mode) -> None:
    """Re-read the written file: the bounded pre-scan's tensor table (names, ggml types, shapes, offsets), the
    key hyper-parameters (``scalar_kvs``), every tensor's bytes against the digest of what was produced; with
    ``mode == "full"`` also ``gguf.GGUFReader`` and a decode of every tensor.  (``GGUFReader`` builds a Python
    object per vocabulary string, seconds for a 32k vocabulary, so the default pass does without it.)"""
    from .gguf_io import open_gguf, prescan_gguf

    reader = None
    if mode == "full":
        reader, scan = open_gguf(path)
    else:
        scan = prescan_gguf(path)
    try:
        have = {t[0]: t for t in scan["tensors"]}
        planned = {it.gguf_name for it in items}
        if set(have) != planned:
            raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the written GGUF's tensors differ from the plan "
                            f"(missing {sorted(planned - set(have))[:3]}, unexpected {sorted(set(have) - planned)[:3]})",
                            file=str(path))
        want = {f"{arch}.block_count": hp["n_layer"], f"{arch}.embedding_length": hp["n_embd"],
                f"{arch}.attention.head_count": hp["n_head"]}
        kv = scalar_kvs(path, set(want))
        for k, v in want.items():
            if kv.get(k) != v:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"metadata {k} reads back as {kv.get(k)}, written {v}",
                                file=str(path))
        rtensors = {t.name: t for t in reader.tensors} if reader is not None else {}
        done = total
        for it in items:
            name, ne, gtype_id, off, _numel, nbytes = have[it.gguf_name]
            shape = tuple(int(x) for x in reversed(ne))
            tname = _type_name(gtype_id)
            if tname != it.gtype or shape != it.shape or nbytes != it.nbytes:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"reads back as {tname} {list(shape)}, "
                                f"planned {it.gtype} {list(it.shape)}", tensor=it.gguf_name, file=str(path))
            if _digest_of_file_range(str(path), scan["data_start"] + off, nbytes) != it.sum:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the bytes on disk differ from the bytes produced "
                                "(digest)", tensor=it.gguf_name, file=str(path))
            if mode == "full" and it.redecode is not None:
                t = rtensors[it.gguf_name]
                got = decode(np.array(t.data), it.gtype).reshape(it.shape)
                want_w = it.redecode()
                if isinstance(it.report, LayerReport) and it.report.exact:
                    ok = np.array_equal(got.astype(np.float16).view(np.uint16),
                                        want_w.astype(np.float16).view(np.uint16))
                elif isinstance(it.report, LayerReport):
                    s = error_stats(got, want_w)
                    ok = math.isclose(s["rel_error"], it.report.rel_error, rel_tol=1e-6, abs_tol=1e-12)
                else:
                    d = np.abs(got - want_w)
                    ok = bool((d[np.isfinite(d)].max() if d.size else 0.0) <= it.report.max_abs_error)
                if not ok:
                    raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "decoding the written tensor again does not give "
                                    "what was reported", tensor=it.gguf_name, file=str(path))
            if it.report is not None:
                it.report.verified = True
            for part in it.parts:
                part.verified = True
            done += it.nbytes
            if progress is not None:
                progress(done, 2 * total, f"verify {it.gguf_name}")
    finally:
        reader = None
    report.validation = {"result": "PASS", "counts": {"tensors": len(items)}, "problems": []}
    report.verified = True
    report.verify_mode = ("re-read through the bounded GGUF pre-scan; key metadata read back; every tensor's bytes "
                          "checked (CRC-32 and length)" + ("; gguf.GGUFReader and every tensor decoded again and compared "
                                                  "with the source" if mode == "full" else ""))
