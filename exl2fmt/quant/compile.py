"""Compile: the output model written from the work directory's layer files and the source's other tensors
(``write_output``: shards of at most ``shard_size``, tensor by tensor), the model's own side files, ``config.json``
with ``quantization_config`` and the manifest ``exl2fmt-manifest.json`` (``write_metadata``); then the
self-verification of the staged output (``check_output``): every layer holds exactly the tensors quantized, and
the decoder linears' stored bpw (``stored_decoder_bpw``) is within the target."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .. import __version__
from ..arch import autogptq_quantize_config, exl2_quantization_config, gptq_quantization_config
from ..container import OutSpec, ShardWriter, SourceReader, bf16_bits_to_f32, open_model, plan_shards
from ..container.dtypes import count_bit_pattern
from ..errors import ErrorCode, Exl2Error
from ..layout import Exl2Slot, Format, slot_names, stays_16bit
from ..modelcard import copy_model_files
from .gptq import GPTQ_PERCDAMP
from .job import Work
from .options import QuantOptions
from .report import QuantReport

__all__ = ["plain_tensor", "write_output", "compile_output", "write_metadata", "check_output", "stored_decoder_bpw"]


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _plain_specs(src, skip: set[str]) -> list:
    """OutSpecs of every tensor of ``src`` not in ``skip``: floating point becomes F16, integer buffers (position
    ids, ...) keep their dtype."""
    out = []
    for name in src.names():
        if name in skip:
            continue
        info = src.files.info(name)
        out.append(OutSpec(name, "F16" if info.dtype in _FLOAT_DTYPES else info.dtype, tuple(info.shape)))
    return out


def plain_tensor(src, name: str, report: QuantReport, chunk_bytes: int = 16 << 20) -> np.ndarray:
    """One tensor of ``src`` as written: floating point as fp16 (values beyond its range clamped to +-65504,
    reported when the tensor is otherwise finite), integer buffers unchanged.

    Read as stored and converted in chunks of about ``chunk_bytes`` of float32: a 32000 x 2048 embedding
    costs its stored copy and its fp16 result, not three float32 copies of itself (0.65 GB at the 1B's
    compile).  Each value is rounded to fp16 once, as a whole-tensor conversion does: the same bytes."""
    dtype = src.files.info(name).dtype
    if dtype not in _FLOAT_DTYPES:
        return src.read_stored(name)
    a = src.read_stored(name)
    if dtype == "F16":                  # fp16 already: only +-inf is beyond the range (and no warning was ever
        if count_bit_pattern(a.view(np.uint16), 0x7FFF, 0x7C00):     # given for a non-finite tensor; NumPy's
            np.clip(a, -65504, 65504, out=a)                          # float16 clip is slow: only when needed
        return a
    out = np.empty(a.shape, dtype=np.float16)
    flat_in, flat_out = a.reshape(-1), out.reshape(-1)
    step = max(1, chunk_bytes // 4)
    finite, big = True, False
    for s in range(0, flat_in.size, step):
        c = flat_in[s:s + step]
        c = bf16_bits_to_f32(c) if dtype == "BF16" else c.copy()        # F32 / F64: a private chunk to clip
        finite = finite and bool(np.isfinite(c).all())
        big = big or bool(np.abs(c).max(initial=0) > 65504)
        np.clip(c, -65504, 65504, out=c)
        flat_out[s:s + step] = c
    if finite and big:
        report.warnings.append(f"{name}: values beyond the fp16 range were clamped")
    return out


def write_output(tmp: Path, src, layers: list[tuple[str, Path]], skip: set[str], o: QuantOptions,
                 report: QuantReport) -> None:
    """Write the output model into ``tmp`` tensor by tensor (never the whole model in memory): every tensor of
    ``src`` not in ``skip`` converted by ``plain_tensor``, and the slots of each quantized layer (key, packed
    layer file) as ``{key}.{slot}``.  Shards of at most ``o.shard_size`` bytes, sorted by name, named
    ``output`` (EXL2) or ``model`` (GPTQ), with ``{prefix}.safetensors.index.json`` when there are several."""
    specs = _plain_specs(src, skip)
    where: dict[str, tuple[Path, str]] = {}         # output name -> (layer file, slot)
    for key, path in layers:
        m = open_model(path)
        try:
            for slot in m.names():
                t = m.info(slot)
                specs.append(OutSpec(f"{key}.{slot}", t.dtype, tuple(t.shape)))
                where[f"{key}.{slot}"] = (path, slot)
        finally:
            m.close()
    specs.sort(key=lambda sp: sp.name)
    prefix = "output" if o.target == "exl2" else "model"
    writer = ShardWriter(tmp, plan_shards(specs, o.shard_size), {"format": "pt"}, prefix=prefix,
                         index_name=f"{prefix}.safetensors.index.json")
    cur: dict = {}                                  # the one layer file open for reading (a layer's slots are adjacent)
    try:
        for sp in specs:
            if sp.name in where:
                path, slot = where[sp.name]
                if cur.get("path") != path:
                    if cur:
                        cur["reader"].close()
                    cur.update(path=path, reader=SourceReader(open_model(path)))
                arr = cur["reader"].read(slot)
            else:
                arr = plain_tensor(src, sp.name, report)
            writer.feed(sp.name, arr)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if cur:
            cur["reader"].close()


def compile_output(spec, src, src_dir: Path, tmp: Path, work: Work, o: QuantOptions, report: QuantReport,
                   config: dict, layer_keys: list[str]) -> None:
    """The output model from the work directory's layer files and the source's other tensors, plus side files
    and metadata."""
    keys = layer_keys + (["lm_head"] if o.quantized_head else [])
    replaced = keys + [k for i in range(spec.num_layers) for k in spec.source_keys(i)]   # fused sources too
    skip = {f"{k}.{s}" for k in replaced for s in ("weight", "bias")}
    if spec.tied:        # the embedding is the head: a redundant stored copy of it is not written (its bias is)
        skip.add("lm_head.weight")
    write_output(tmp, src, [(k, work.layer_path(k)) for k in keys], skip, o, report)
    # the model's own files only (tokenizer, generation config, license...): not a training log; the source's
    # README.md becomes a marked section of the output's own card (written after verification)
    report.files_copied, report.files_left_out = copy_model_files(src_dir, tmp, report.warnings)
    write_metadata(tmp, config, o, report)


def write_metadata(tmp: Path, config: dict, o: QuantOptions, report: QuantReport, weight_only: bool = False) -> None:
    """config.json with quantization_config (and quantize_config.json for GPTQ), and exl2fmt-manifest.json."""
    cfg = dict(config)
    cfg.pop("quantization_config", None)
    if o.target == "exl2":
        qc = exl2_quantization_config(o.bits, None if weight_only else o.head_bits, None if weight_only else {
            "rows": o.rows, "length": o.length,
            "dataset": os.path.basename(o.calibration) if o.calibration else "(default)"}, __version__,
            manifest="exl2fmt-manifest.json", **({"weight_only": True} if weight_only else {}))
    else:
        qc = gptq_quantization_config(o.bits, o.group_size, o.sym, o.order == "act" and not weight_only, __version__,
                                      act_group_aware=o.order == "group" and not weight_only,
                                      damp_percent=GPTQ_PERCDAMP, exl2fmt_order=None if weight_only else o.order)
        (tmp / "quantize_config.json").write_text(json.dumps(autogptq_quantize_config(qc), indent=2) + "\n",
                                                  encoding="utf-8")
    cfg["quantization_config"] = qc
    cfg["torch_dtype"] = "float16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=4) + "\n", encoding="utf-8")
    manifest = {"producer": f"exl2fmt {__version__}", "target": o.target, "options": o.fingerprint(),
                "decoder_bpw": report.decoder_bpw, "head_bpw": report.head_bpw,
                "calibration_perplexity": None if weight_only else {"fp16": report.calibration_ppl_fp16,
                                                                     "quantized": report.calibration_ppl},
                "layers": {l.key: {"plan": l.plan, "bpw": l.bpw, "error": l.error} for l in report.layers},
                "blocks": report.blocks}
    if weight_only:
        manifest["weight_only"] = True
    (tmp / "exl2fmt-manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def check_output(tmp: Path, work: Work, layer_keys: list[str], o: QuantOptions, report: QuantReport) -> None:
    """Every layer of the staged output ``tmp`` must hold exactly the tensors quantized (the work directory's
    layer files), and an EXL2 output's decoder linears must measure within the target bpw (``report.decoder_bpw``
    is set to what they measure)."""
    out = SourceReader(open_model(tmp))             # pread, not the map: one tensor resident at a time
    try:
        for k in layer_keys + (["lm_head"] if o.quantized_head else []):
            m = SourceReader(open_model(work.layer_path(k)))
            try:
                for slot in m.model.names():
                    if not np.array_equal(out.read(f"{k}.{slot}"), m.read(slot)):
                        raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "written tensor differs from the quantized "
                                        "layer", file=str(tmp), tensor=f"{k}.{slot}")
            finally:
                m.close()
    finally:
        out.close()
    if o.target == "exl2":
        measured = stored_decoder_bpw(tmp, layer_keys)
        report.decoder_bpw = measured
        if measured > o.bits + 1e-9:
            raise Exl2Error(ErrorCode.BUDGET_INFEASIBLE, f"the decoder linears measure {measured:.4f} bpw, above "
                            f"the target {o.bits}", file=str(tmp))


def stored_decoder_bpw(path: Path, keys: list[str]) -> float | None:
    """The decoder linears' bpw of the EXL2 model at ``path`` as ``exl2fmt inspect`` reports it (``bpw.decoder``),
    from its headers by the layout table: the stored bytes of the EXL2 layers ``keys`` (every stored slot) x 8
    over their K x N_pad (+ N_pad with a bias), rounded to 6 places; None without weights.  Modules that stay
    16-bit (``layout.STAYS_16BIT``: MoE routers) are left out, as in the quantizer's budget and ExLlamaV2's."""
    slots = slot_names(Format.EXL2, derived=False)
    model = open_model(path)
    try:
        bits = numel = 0
        for key in keys:
            if stays_16bit(key):
                continue
            infos = {s: model.info(f"{key}.{s}") for s in slots if f"{key}.{s}" in model}
            K, N_pad = infos[Exl2Slot.Q_INVPERM].shape[0], infos[Exl2Slot.Q_WEIGHT].shape[1]
            bits += 8 * sum(int(t.nbytes) for t in infos.values())
            numel += K * N_pad + (N_pad if Exl2Slot.BIAS in infos else 0)
    finally:
        model.close()
    return round(bits / numel, 6) if numel else None
