"""The plan of a GGUF file for ``gguf_write``: every source tensor's GGUF name, type and shape (``Item``), in
llama.cpp's order, with the functions that produce its data (plain tensors in row chunks, quantized layers
repacked or re-quantized, stacked experts) and a fresh float32 reference for ``verify="full"``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..container import SourceReader
from ..errors import ErrorCode, Exl2Error
from .base import LayerReport, TensorReport, build_layer, error_stats, layer_issues_or_raise
from ..names import natural_key
from .gguf_blocks import (KQUANT_TYPES, OWN_QUANTIZER_TYPES, layer_integers, offset_in_dtype, repack_blocks, sized_type, source_f32,
                          to_gtype)
from .gguf_io import decode, ggml_type
from .gguf_map import DROPPED_SUFFIXES, gguf_name_map, permute_qk, qk_heads

__all__ = ["Item", "SIZED", "hparams", "auto_type", "plan_items", "sized_summary"]

#: the plan's marker for "each quantized layer gets ``sized_type`` of its own bpw" (``--gguf-type auto`` on an
#: EXL2 source, or a GPTQ source whose integers fit no block type)
SIZED = "SIZED"


@dataclass
class Item:
    gguf_name: str
    src: str                        # HF tensor name, or layer key for a linear layer
    gtype: str                      # F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_K ...
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

def hparams(cfg: dict) -> dict:
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


def auto_type(det, cfg: dict, model, reader: SourceReader) -> tuple[str, str]:
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
    return SIZED, "F16"

def plan_items(model, reader, det, cfg, arch, permute, hp, layer_t, plain_t, report) -> list[Item]:
    from ..layout import Format

    from .gguf_arch import spec_for_model_type

    spec = spec_for_model_type(cfg.get("model_type"))
    name_of = gguf_name_map(arch, hp["n_layer"])
    items: list[Item] = []
    owned: set[str] = set()
    shard: dict[str, str] = {}  # source name -> its shard file (llama.cpp's tensor order: shard, then name)
    experts: dict[tuple[str, str], dict[int, tuple[str, object]]] = {}  # (prefix, proj) -> expert -> source

    no_k: dict[int, list[str]] = {}  # row length -> layers whose rows are no whole K-quant super-blocks

    def gtype_2d(want: str, cols: int, what: str, bpw: float | None = None, info=None) -> str:
        if want == SIZED:
            t = sized_type(bpw, cols)
            if info is not None and t not in ("Q4_0", "Q8_0") and _repacks_exactly(reader, info, t):
                return "Q4_0"  # the source's own integers and scales, lossless, at no more bits than t
            if cols % 256 and t != "F16":
                no_k.setdefault(cols, []).append(what)
            return t
        if want in KQUANT_TYPES and cols % 256 and cols % 32 == 0:
            report.warnings.append(f"{what}: row length {cols} is not a multiple of 256 (a K-quant super-block); "
                                   f"written as {_K_FALLBACK[want]}, as llama.cpp's quantizer does")
            return _K_FALLBACK[want]
        if want not in ("F32", "F16", "BF16") and cols % 32:
            report.warnings.append(f"{what}: row length {cols} is not a multiple of 32; written as F16")
            return "F16"
        return want

    for key, info in det.layers.items():
        if info.format is Format.DENSE:
            continue  # its weight (and bias) are plain tensors below
        owned.update(ti.name for ti in info.slots.values())
        shard[info.key] = str(next(iter(info.slots.values())).file)
        if info.format not in (Format.EXL2, Format.GPTQ, Format.EXL3):
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{info.format.value} layers cannot be converted",
                            tensor=key)
        if info.format is Format.EXL3:
            from ..formats.exl3 import refuse_quantized_embedding

            refuse_quantized_embedding(info)
        wname = f"{key}.weight"
        em = _EXPERT.match(wname)
        if em is not None:  # one expert of a stacked tensor: reconstructed, stacked below
            experts.setdefault((em["pre"], em["w"]), {})[int(em["e"])] = ("layer", info)
            continue
        g = name_of(wname)
        if g is None:
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"no GGUF name for {wname} in the gguf package's {arch} "
                            "table", tensor=key)
        n, k = _true_nk(cfg, info)
        heads = qk_heads(wname, hp["n_head"], hp["n_kv"]) if permute else None
        items.append(_layer_item(reader, info, cfg, g, wname, (n, k), gtype_2d(layer_t, k, wname, _info_bpw(info),
                                                                               info), heads, report,
                                 searched=layer_t == SIZED))
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
    for cols, names in sorted(no_k.items()):
        report.warnings.append(f"{len(names)} layer(s) with rows of {cols} weights (not a multiple of 256, the "
                               f"K-quant super-block) get the 32-weight types IQ4_NL..Q8_0 instead of K-quants "
                               f"(e.g. {names[0]})")
    if spec.model_type == "phi3":
        items += _rope_factor_items(cfg, str(model.root), report)
    planned = (owned | {it.src for it in items} | {n for n in model.tensors if n.endswith(DROPPED_SUFFIXES)}
               | set(spec.skip))
    if set(model.tensors) - planned:  # pragma: no cover - a planning bug must never drop weights silently
        raise RuntimeError(f"tensors left out of the GGUF plan: {sorted(set(model.tensors) - planned)[:3]}")

    def order(it: Item):
        def file_of(n: str) -> str:  # a plain tensor by name, a quantized layer by its key
            return shard.get(n, shard.get(n.removesuffix(".weight"), ""))

        if it.stack is not None:  # llama.cpp emits a stacked tensor when its last expert arrives
            last = max(it.stack, key=lambda n: (file_of(n), n))
            return file_of(last), last, it.stack_rank
        src = it.src if it.src.endswith((".weight", ".bias")) else it.src + ".weight"
        return shard.get(it.src, ""), src, 0

    items.sort(key=order)  # llama.cpp's order: shards by file name, tensors of a shard by Hugging Face name
    return items


def _true_nk(cfg, info) -> tuple[int, int]:
    """(out, in) features of a quantized layer as ``nn.Linear`` has them: config.json's N (EXL2 pads N to 32);
    for EXL3, which pads both to 128, config.json's N and K where they pad to the stored sizes."""
    from ..arch import expected_features
    from ..layout import Format

    k_cfg, n_cfg = expected_features(cfg, info.key)
    if info.format is Format.EXL3:
        from ..formats.exl3 import fits_padding

        k = k_cfg if k_cfg is not None and fits_padding(k_cfg, info.in_features) else info.in_features
        n = n_cfg if n_cfg is not None and fits_padding(n_cfg, info.out_features) else info.out_features
        return n, k
    return n_cfg or info.out_features, info.in_features


def _repacks_exactly(reader, info, t: str) -> bool:
    """True when every 32-weight block of the EXL2 layer ``info`` can be stored as Q4_0 holding the source's own
    integers and fp16 scale (``repack_blocks``: the 32 input rows of each block lie in one group, stored order
    read through ``q_invperm``, of at most 4 bits), and Q4_0 costs no more bits per weight than ``t``."""
    from ..groups import decode_q_groups
    from ..layout import Format
    from .gguf_blocks import type_bpw
    from .slots import Q_GROUPS, Q_INVPERM, Q_WEIGHT

    if info.format is not Format.EXL2 or type_bpw("Q4_0") > type_bpw(t) or info.in_features % 32:
        return False
    try:
        sl = info.slots
        gt = decode_q_groups(reader.read(sl[Q_GROUPS].name), int(sl[Q_WEIGHT].shape[0]))
        inv = np.asarray(reader.read(sl[Q_INVPERM].name)).astype(np.int64)
    except (KeyError, Exl2Error):
        return False
    if inv.size != info.in_features or gt.K != inv.size or int(gt.bits.max()) > 4:
        return False
    group_of_stored = np.repeat(np.arange(gt.G), gt.rows)              # stored row -> its group
    if np.any(inv < 0) or np.any(inv >= inv.size):
        return False
    g = group_of_stored[inv].reshape(-1, 32)                            # original row -> group, by block
    return bool((g == g[:, :1]).all())


def _numel(info) -> int:
    return max(1, int(info.in_features or 0) * int(info.out_features or 0))


def _info_bpw(info) -> float:
    """A quantized layer's stored bits per weight from its header (every slot, as ``inspect``'s bpw)."""
    return info.stored_bytes * 8 / _numel(info)


def sized_summary(items: list[Item], report) -> str:
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


def _rope_factor_items(cfg: dict, root: str, report) -> list[Item]:
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
        out.append(Item(name, name, "F32", arr.shape, lambda a=arr: iter([a]), redecode=lambda a=arr: a,
                         report=rep))
    return out


#: llama.cpp's replacement of a K-quant for a row that is no whole number of 256-weight super-blocks
_K_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

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
                  report) -> Item:
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
            decoders.append(lambda x=x, dt=ti.dtype: source_f32(reader.read(x), dt))
        else:
            quantized = True
            n, k = _true_nk(cfg, x)
            shapes.add((n, k))
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
            return to_gtype(decoders[e](), gtype)
        layer = build_layer(reader, x, cfg)
        layer_issues_or_raise(layer, report)
        w16 = layer.dequantize()[:N]
        lrep = expert_reps[e]
        lrep.source_plan, lrep.target_plan = layer.plan(), gtype
        out = _layer_blocks(layer, w16, N, gtype, lrep, layer_t == SIZED)
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

    return Item(g, merged, gtype, (E, N, K), produce, ref, rep, stack=tuple(srcs),
                 stack_rank=_STACK_RANK.get(wid, 0), parts=tuple(expert_reps[e] for e in sorted(expert_reps)))

#: rows of a plain tensor are converted and written this many float32 bytes at a time (peak memory: one chunk
#: a few times over, not the tensor)
_CHUNK_BYTES = 8 << 20


def _plain_item(reader, name, dtype, g, shape, gtype, heads, report, offset: float = 0.0) -> Item:
    rep = TensorReport(name, dtype, gtype)
    report.tensors.append(rep)
    rows = shape[0] if len(shape) >= 1 else 1
    row_elems = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else (shape[0] if shape else 1)
    if len(shape) <= 1:
        rows, row_elems = 1, int(np.prod(shape, dtype=np.int64))

    def convert(x: np.ndarray) -> np.ndarray:
        if offset:
            x = offset_in_dtype(x, offset, dtype)
        return x

    def ref() -> np.ndarray:
        x = convert(source_f32(reader.read(name), dtype))
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
            out = to_gtype(x, gtype)
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
                x = convert(source_f32(raw, dtype))
                out = to_gtype(x, gtype)
                account(x, out)
                yield out
        rep.exact = rep.nonfinite == 0 and rep.max_abs_error == 0.0
        if rep.nonfinite:
            report.warnings.append(f"{name}: {rep.nonfinite} values are not finite as {gtype}")

    return Item(g, name, gtype, shape, produce, ref, rep)


def _layer_item(reader, info, cfg, g, wname, shape, gtype, heads, report, searched: bool = False) -> Item:
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
        out = _layer_blocks(layer, w16, N, gtype, rep, searched)
        back = decode(out, gtype).reshape(N, K)
        _score(rep, back, w16)
        if heads:
            out = permute_qk(out, heads, wname)
        return out

    def ref():
        _, w16 = reconstruct()
        w = w16.astype(np.float32)
        return permute_qk(w, heads, wname) if heads else w

    return Item(g, key, gtype, (N, K), produce, ref, rep)


def _layer_blocks(layer, w16: np.ndarray, N: int, gtype: str, rep: LayerReport, searched: bool = False
                  ) -> np.ndarray:
    """The GGUF data of one quantized layer: for Q8_0/Q4_0 the source's own integers and scales repacked where
    they fit a block exactly (``repack_blocks``; the rest quantized by gguf.quants, or with ``searched`` by
    ``codec.ggml_quant``'s scale search, counted in ``rep``), otherwise its fp16 reconstruction ``w16`` (float16
    [N, K]) converted to ``gtype`` (K-quants always by the scale search)."""
    how = "the scale search" if searched or gtype in OWN_QUANTIZER_TYPES else "gguf.quants"
    if gtype not in ("Q8_0", "Q4_0"):
        if gtype not in ("F32", "F16", "BF16"):
            rep.notes.append(f"quantized to {gtype} from the fp16 reconstruction by {how}")
        return to_gtype(w16.astype(np.float32), gtype, searched)
    qd = layer_integers(layer, N)
    q, d = (None, None) if qd is None else qd
    out, exact_mask = repack_blocks(w16, q, d, gtype, searched)
    n_exact, n_blocks = int(exact_mask.sum()), exact_mask.size
    rep.notes.append(f"{n_exact}/{n_blocks} blocks repacked exactly (source integers and scale), "
                     f"{n_blocks - n_exact} quantized by {how}")
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


def _layer_bias_item(reader, info, cfg, g, bname, N, heads, report) -> Item:
    rep = TensorReport(bname, "F16", "F32")
    report.tensors.append(rep)

    def ref():
        b = build_layer(reader, info, cfg).bias()[:N].astype(np.float32)
        return permute_qk(b, heads, bname) if heads else b

    return Item(g, bname, "F32", (N,), lambda: np.ascontiguousarray(ref()), ref, rep)
