"""EXL3 model-level checks of ``validate`` (spec/exl3.md, quantization_config): the decoder and head rates
against ``quantization_config.bits`` / ``head_bits``, and ``quantization_config.json``'s ``tensor_storage``
against the real tensors.  The per-layer rules are ``formats.exl3.Exl3Linear.validate``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import ErrorCode, Exl2Error
from .report import CheckId, PassCode, Report, Status

__all__ = ["exl3_model_checks", "QUANT_CONFIG_JSON", "EXL3_BITS_TOLERANCE"]

#: exllamav3's side file: config.json's quantization_config plus ``tensor_storage`` per module
QUANT_CONFIG_JSON = "quantization_config.json"
#: ``bits`` is written as round(average trellis rate, 2)
EXL3_BITS_TOLERANCE = 0.0051
#: at most this many tensor_storage findings are listed one by one
_MAX_LISTED = 20


def exl3_model_checks(rep: Report, model, det, config, config_file: str) -> None:
    _rate_checks(rep, det, config_file, config)
    _side_rate_checks(rep, det, config_file, config)
    _unknown_size_check(rep, det, config, config_file)
    _tensor_storage_checks(rep, model, det)


def _side_rate_checks(rep: Report, det, config_file: str, config=None) -> None:
    """``vision_bits``: exllamav3 quantizes every eligible vision-tower linear at this one fixed rate, and writes the
    key only when it is not 16 (so EXL3 vision linears without it are a mismatch too); ``mtp_bits``: MTP linears
    get at least this rate (``--hq`` may promote some), and none is quantized when it is 16.  Warnings."""
    from ..layout import Format
    from ..names import is_mtp, is_vision

    nl, nextn = _layer_counts(config)
    layers = [l for l in det.layers.values() if l.format is Format.EXL3 and l.bits]
    for name, pick, ok, rule in (
            ("vision_bits", lambda k: is_vision(k), lambda b, want: b == want, "exactly"),
            ("mtp_bits", lambda k: is_mtp(k, nl, nextn), lambda b, want: b >= want, "at least")):
        picked = [l for l in layers if pick(l.key)]
        want = det.variant.get(name)
        if not picked:
            continue
        if want is None or want == 16:
            bad = picked
            why = (f"quantization_config has no {name} (the sides are then stored unquantized)" if want is None else
                   f"quantization_config.{name} = 16 (stored unquantized)")
        else:
            bad = [l for l in picked if not ok(l.bits, want)]
            why = f"quantization_config.{name} = {want:g} asks for {rule} that rate"
        if bad:
            shown = ", ".join(f"{l.key} ({l.bits:g})" for l in bad[:3]) + (f" and {len(bad) - 3} more"
                                                                            if len(bad) > 3 else "")
            rep.add(CheckId.BITS, Status.WARN, ErrorCode.BITS_MISMATCH, f"{why}, but {len(bad)} of the "
                    f"{len(picked)} EXL3 linears it covers are stored at other rates: {shown}", tensor=bad[0].key,
                    file=config_file)
        else:
            rep.ok(CheckId.BITS, PassCode.BITS_OK, f"quantization_config.{name} = {want:g} matches the {len(picked)} "
                   "linears it covers", file=config_file)


def _unknown_size_check(rep: Report, det, config, config_file: str) -> None:
    """EXL3 linears whose true in/out features config.json does not give (an unknown architecture's projector,
    low-rank attention, no config.json): their padded sizes are used, so a dequantized or converted weight may
    keep up to 127 padding rows / columns of zeros-by-construction.  One warning for the model."""
    from ..arch import features_of
    from ..layout import Format

    sizes = features_of(config if isinstance(config, dict) else None)
    unknown = [l for l in det.layers.values() if l.format is Format.EXL3 and None in sizes(l.key)]
    if unknown:
        shown = ", ".join(l.key for l in unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        rep.add(CheckId.CONFIG, Status.WARN, ErrorCode.EXL3_PADDING, f"config.json does not give the true sizes of "
                f"{len(unknown)} EXL3 linears ({shown}): their padded sizes (multiples of 128) are used, so "
                "dequantize / convert may keep padding rows or columns there", tensor=unknown[0].key,
                file=config_file)


def _layer_counts(config) -> tuple[int | None, int | None]:
    cfg = config if isinstance(config, dict) else {}
    cfg = {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) else None
                 for v in (cfg.get("num_hidden_layers"), cfg.get("num_nextn_predict_layers")))


def _rate_checks(rep: Report, det, config_file: str, config=None) -> None:
    """``bits``: the trellis rates of the decoder linears averaged with their padded sizes as weights (the head,
    suh / svh, dense layers, vision and MTP linears left out), as exllamav3's converter computes it;
    ``head_bits``: the head's rate, 16 for a dense head."""
    from ..layout import Format
    from ..names import block_of, is_head, is_mtp, is_vision

    nl, nextn = _layer_counts(config)
    layers = list(det.layers.values())
    # exllamav3 counts the text decoder only: a vision tower's and the MTP layers' rates are vision_bits / mtp_bits
    dec = [l for l in layers if l.format is Format.EXL3 and block_of(l.key) is not None and l.bits
           and l.in_features and l.out_features and not is_vision(l.key) and not is_mtp(l.key, nl, nextn)]
    target = det.variant.get("target_bits")
    if target is not None and dec:
        numel = sum(l.in_features * l.out_features for l in dec)
        measured = sum(l.bits * l.in_features * l.out_features for l in dec) / numel
        if abs(measured - target) > EXL3_BITS_TOLERANCE:
            rep.add(CheckId.BITS, Status.WARN, ErrorCode.BITS_MISMATCH, f"quantization_config.bits = {target} but "
                    f"the trellis rates of the {len(dec)} decoder linears average {measured:.4f} (padded sizes as "
                    "weights, as exllamav3 computes it)", file=config_file)
        else:
            rep.ok(CheckId.BITS, PassCode.BITS_OK, f"quantization_config.bits = {target}; the decoder linears' "
                   f"trellis rates average {measured:.4f}", file=config_file)
    head_bits = det.variant.get("head_bits")
    heads = [l for l in layers if is_head(l.key)]
    if head_bits is not None and heads:
        got = {l.bits if l.format is Format.EXL3 else 16 for l in heads}
        if got != {head_bits}:
            rep.add(CheckId.BITS, Status.WARN, ErrorCode.BITS_MISMATCH, f"quantization_config.head_bits = "
                    f"{head_bits} but the head is stored at {', '.join(f'{b:g}' for b in sorted(got, key=float))} "
                    "bits", tensor=heads[0].key, file=config_file)
        else:
            rep.ok(CheckId.BITS, PassCode.BITS_OK, f"quantization_config.head_bits = {head_bits:g} matches the "
                   "head", file=config_file)


def _tensor_storage_checks(rep: Report, model, det) -> None:
    """``quantization_config.json`` ``tensor_storage[module]``: every listed tensor exists with the listed
    shape and byte size, and an EXL3 module's ``bits_per_weight`` / multipliers match its trellis and marker."""
    from ..container import jsonload
    from ..layout import EXL3_MARKER_VALUES, Exl3Slot, Format

    root = getattr(model, "root", None)
    if root is None or not (Path(root) / QUANT_CONFIG_JSON).is_file():
        return
    path = Path(root) / QUANT_CONFIG_JSON
    # a tensor map of every module: MoE-sized (thousands of experts x their tensors)
    kind = replace(jsonload.SIDE_CONFIG.named(QUANT_CONFIG_JSON), max_bytes=64 << 20, max_items=4_000_000)
    try:
        doc = jsonload.load_json(path, kind)
    except Exl2Error as e:
        rep.add(CheckId.CONFIG, Status.FAIL, e.code, e.message, file=str(path))
        return
    storage = doc.get("tensor_storage") if isinstance(doc, dict) else None
    if not isinstance(storage, dict):
        rep.add(CheckId.CONFIG, Status.WARN, ErrorCode.CONFIG_INVALID, f"{QUANT_CONFIG_JSON} has no tensor_storage "
                "object", file=str(path))
        return
    tensors = model.tensors
    found: list[tuple[str, str]] = []
    n = 0
    for module, entry in storage.items():
        if not isinstance(entry, dict):
            found.append((module, "entry is not an object"))
            continue
        stored = entry.get("stored_tensors", {})
        if not isinstance(stored, dict):
            found.append((module, "stored_tensors is not an object"))
            continue
        for name, desc in stored.items():
            n += 1
            t = tensors.get(name)
            if t is None:
                found.append((name, "listed in tensor_storage but not in the model"))
                continue
            if isinstance(desc, dict):
                if isinstance(desc.get("shape"), list) and desc["shape"] != list(t.shape):
                    found.append((name, f"tensor_storage shape {desc['shape']} but the tensor is {list(t.shape)}"))
                elif "n_bytes" in desc and desc["n_bytes"] != t.nbytes:
                    found.append((name, f"tensor_storage n_bytes {desc['n_bytes']} but the tensor has {t.nbytes}"))
        if entry.get("quant_format") == Format.EXL3.value:
            n += 1
            info = det.layers.get(module)
            if info is None or info.format is not Format.EXL3:
                found.append((module, "tensor_storage says exl3 but the model has no EXL3 layer of that name"))
                continue
            if entry.get("bits_per_weight") != info.bits:
                found.append((module, f"tensor_storage bits_per_weight {entry.get('bits_per_weight')} but the trellis "
                              f"rate is {info.bits}"))
            for slot in (Exl3Slot.MCG, Exl3Slot.MUL1):
                mult = entry.get(f"{slot}_multiplier")
                want = (EXL3_MARKER_VALUES[slot] & 0xFFFFFFFF) if slot in info.slots else None
                if mult != want:
                    found.append((module, f"tensor_storage {slot}_multiplier {mult} but the layer "
                                  f"{'has' if want else 'has no'} the {slot} marker"))
    for where, msg in found[:_MAX_LISTED]:
        rep.add(CheckId.CONFIG, Status.FAIL, ErrorCode.CONFIG_MISMATCH, f"{QUANT_CONFIG_JSON}: {msg}", tensor=where,
                file=str(path))
    if len(found) > _MAX_LISTED:
        rep.add(CheckId.CONFIG, Status.FAIL, ErrorCode.CONFIG_MISMATCH, f"{QUANT_CONFIG_JSON}: "
                f"{len(found) - _MAX_LISTED} more tensor_storage mismatches", file=str(path))
    if not found and n:
        rep.ok(CheckId.CONFIG, PassCode.CONFIG_OK, f"{QUANT_CONFIG_JSON} tensor_storage matches the tensors "
               f"({n} comparisons)", count=n, file=str(path))
