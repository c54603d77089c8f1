"""The structural checks of ``validate_model`` (headers only, plus each EXL2 layer's tiny ``q_groups``):
container, index, names, config, format, layers, bits.  See the table in ``exl2fmt.validate``."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import Category, ErrorCode, Exl2Error, Issue, Severity
from .awq import awq_issues
from .config_checks import config_issues
from .report import CheckId, PassCode, Report, Status

__all__ = ["structural_checks", "container_check_for", "BITS_TOLERANCE", "NEEDS_IMPORT"]

#: |quantization_config.bits - measured decoder bpw| above this is a BITS_MISMATCH warning (anchors §4.6).
BITS_TOLERANCE = 0.05


def container_check_for(code: ErrorCode) -> CheckId:
    """The check a container-level error belongs to (index and config errors have their own)."""
    v = code.value
    if v.startswith("INDEX_") or v == "DUPLICATE_TENSOR":
        return CheckId.INDEX
    if v.startswith("CONFIG_"):
        return CheckId.CONFIG
    return CheckId.CONTAINER


def structural_checks(rep: Report, model, path: Path, deep: bool) -> tuple:
    """Every check of the structural table of ``exl2fmt.validate`` on the open ``model``, added to ``rep``.

    Returns ``(det, loaded)``: the ``detect_model`` result and {layer key: layer object} of the EXL2 / GPTQ /
    dense layers that passed (what the data passes run on)."""
    tensors = model.tensors
    first_file = str(model.files[0]) if model.files else str(path)
    rep.ok(CheckId.CONTAINER, PassCode.CONTAINER_OK,
           f"{len(model.files)} file(s), {len(tensors)} tensors: every header passes the hardened parser "
           "(size cap, UTF-8 JSON, no duplicate keys, contiguous in-range offsets, shape x dtype = bytes, "
           "complete data, no trailing bytes)", count=len(model.files))
    _index_checks(rep, model, first_file)
    _name_checks(rep, tensors)
    config, config_file = _config_checks(rep, model, path)
    det = _format_checks(rep, model, config, first_file, deep)
    _config_shape_checks(rep, config, det, tensors, config_file)
    loaded = _layer_checks(rep, model, det, config, first_file, deep)
    _bits_check(rep, det, config_file)
    from ..layout import Format

    if det.format is Format.EXL3:
        from .exl3 import exl3_model_checks

        exl3_model_checks(rep, model, det, config, config_file)
    return det, loaded


def _index_checks(rep: Report, model, first_file: str) -> None:
    """The index against the shards, both ways (a shard outside the model is a container matter)."""
    tensors = model.tensors
    idx_issues = [i for i in model.index_issues() if i.code is not ErrorCode.SHARD_OUTSIDE_MODEL]
    for i in model.index_issues():
        if i.code is ErrorCode.SHARD_OUTSIDE_MODEL:  # where the bytes come from: a container matter
            rep.add_issue(CheckId.CONTAINER, i)
    for i in idx_issues:
        rep.add_issue(CheckId.INDEX, i)
    if model.index_path is not None:
        if not idx_issues:
            rep.ok(CheckId.INDEX, PassCode.INDEX_OK, f"index matches the shards both ways ({len(tensors)} tensors, "
                   f"{len(model.files)} shard(s), total_size right)", file=model.index_path)
    elif len(model.files) > 1:
        rep.add(CheckId.INDEX, Status.WARN, ErrorCode.INDEX_ABSENT, f"{len(model.files)} shards and no "
                "model.safetensors.index.json (third-party loaders need one; --fix-index writes it)",
                file=model.root)
    elif not idx_issues:
        rep.ok(CheckId.INDEX, PassCode.INDEX_OK, "single file: no index needed", file=first_file)


def _name_checks(rep: Report, tensors) -> None:
    from ..names import has_control_chars

    bad_names = [n for n in tensors if has_control_chars(n)]
    for n in bad_names:
        rep.add(CheckId.NAMES, Status.FAIL, ErrorCode.NAME_CONTROL_CHARS,
                "tensor name contains control characters (shown escaped)", tensor=n, file=tensors[n].file)
    if not bad_names:
        rep.ok(CheckId.NAMES, PassCode.NAMES_OK, f"{len(tensors)} tensor names free of control characters",
               count=len(tensors))


def _config_checks(rep: Report, model, path: Path) -> tuple:
    """config.json readable and its values sane; returns ``(config or None, config file name)``."""
    config = None
    config_file = str(model.config_path)
    try:
        config = model.config
    except Exl2Error as e:
        if e.code.category is Category.UNREADABLE:  # a FIFO, device or directory: exit 3 like any input
            raise
        rep.add(CheckId.CONFIG, Status.FAIL, e.code, e.message, tensor=e.tensor, file=e.file)
    else:
        if config is None and path.is_dir():
            rep.add(CheckId.CONFIG, Status.WARN, ErrorCode.CONFIG_MISSING,
                    "no config.json: architecture and sizes cannot be cross-checked", file=config_file)
    from ..config_values import config_value_issues
    from ..detect import quantization_config

    _qc, _qc_src = quantization_config(config, model.root)
    qc_file = config_file if _qc_src in (None, "config.json") else str(Path(model.root) / _qc_src)
    for i in config_value_issues(config, _qc, qc_file):
        rep.add_issue(CheckId.CONFIG, i)
    _loader_check(rep, _qc, _qc_src, qc_file)
    return config, config_file


#: quant_method -> the import that registers a transformers quantizer for it (transformers has none of its own:
#: ``from_pretrained`` logs an unknown quantization type, loads the model unquantized and leaves every quantized
#: linear randomly initialised)
NEEDS_IMPORT = {"exl2": "import exl2fmt.hf", "exl3": "import exl2fmt.hf"}


def _loader_check(rep: Report, qc, qc_src, qc_file: str) -> None:
    """``loader``: a WARN (never escalated by --strict) when the quant_method needs an import to load in
    transformers, naming it."""
    from ..detect import config_quant_method

    method = config_quant_method(qc, qc_src)
    if method in NEEDS_IMPORT:
        rep.add(CheckId.LOADER, Status.WARN, ErrorCode.HF_NEEDS_IMPORT,
                f"quant_method {method!r}: transformers has no quantizer for it and would load the quantized "
                f"linears as random weights; `{NEEDS_IMPORT[method]}` before AutoModelForCausalLM.from_pretrained "
                "(or exl2fmt.load_model, exl2fmt generate) loads it packed", file=qc_file)


def _format_checks(rep: Report, model, config, first_file: str, deep: bool):
    """One format per linear layer (``detect_model``); returns its result."""
    from ..detect import Verdict, detect_model
    from ..layout import Exl2Slot, Exl3Slot, Format, GptqSlot

    det = detect_model(model.tensors, config, root=model.root, file=first_file)
    rep.format = det.format.value
    for i in det.issues:
        rep.add_issue(CheckId.FORMAT, i)
    if det.format is Verdict.UNKNOWN:
        rep.add(CheckId.FORMAT, Status.WARN, ErrorCode.FORMAT_UNKNOWN,
                f"no linear layer of a known format ({Exl2Slot.Q_WEIGHT}, {GptqSlot.QWEIGHT}, {Exl3Slot.TRELLIS} or "
                "a 2-D weight) found",
                file=first_file)
    elif not det.issues:
        rep.ok(CheckId.FORMAT, PassCode.FORMAT_OK, f"{det.label}: {len(det.layers)} linear layers, one format each",
               count=len(det.layers))
    if deep and any(l.format is Format.AWQ for l in det.layers.values()):
        rep.add(CheckId.FORMAT, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED,
                "AWQ layers are checked for shapes only: exl2fmt does not decode AWQ data", file=first_file)
    return det


def _config_shape_checks(rep: Report, config, det, tensors, config_file: str) -> None:
    if isinstance(config, dict):
        issues, n = config_issues(config, det, tensors, config_file)
        for i in issues:
            rep.add_issue(CheckId.CONFIG, i)
        if not issues and n:
            rep.ok(CheckId.CONFIG, PassCode.CONFIG_OK, f"config.json sizes (hidden, intermediate, vocab, heads, "
                   f"layers) match the tensor shapes ({n} comparisons)", count=n, file=config_file)


def _layer_checks(rep: Report, model, det, config, first_file: str, deep: bool) -> dict:
    """Every linear layer in model order (slots, dtypes, shapes; the data rules with ``deep``); returns
    {layer key: layer object} of the layers that passed."""
    from ..arch import gptq_config
    from ..layout import Exl2Slot, Format, GptqSlot
    from ..names import layer_order_key

    gc = gptq_config(config)
    passed: dict[str, int] = {}
    loaded = {}
    for key in sorted(det.layers, key=layer_order_key):
        info = det.layers[key]
        fmt = info.format
        issues, layer = _one_layer_issues(model, info, config, gc, first_file, deep)
        if layer is not None and not any(i.severity is Severity.ERROR for i in issues):
            loaded[key] = layer
        for i in issues:
            rep.add_issue(CheckId.LAYERS, i)
        if not any(i.severity is Severity.ERROR for i in issues):
            passed[fmt.value] = passed.get(fmt.value, 0) + 1
    if passed:
        what = ", ".join(f"{n} {f}" for f, n in sorted(passed.items()))
        rules = "slots, dtypes, shapes"
        if "exl2" in passed:
            rules += f", {Exl2Slot.Q_GROUPS} bits/order/qrow/rows/limits, K"
            if deep:
                rules += f", {Exl2Slot.Q_INVPERM} permutation, {Exl2Slot.Q_SCALE_MAX} finite and >= 0"
        if "gptq" in passed:
            rules += ", GPTQ bits and groups" + (f", {GptqSlot.G_IDX} range, v1 zeros" if deep else "")
        if "exl3" in passed:
            rules += ", EXL3 rate, markers, padding" + (", suh/svh finite" if deep else "")
        rep.ok(CheckId.LAYERS, PassCode.LAYERS_OK, f"{what} layer(s) valid ({rules})", count=sum(passed.values()))
    if (not deep and det.format is Format.GPTQ and det.variant.get("sym") is False
            and det.variant.get("version") == 1):
        rep.add(CheckId.LAYERS, Status.WARN, ErrorCode.GPTQ_ZEROS_AMBIGUOUS, "asymmetric GPTQ in the v1 zero "
                "convention: a zero field of 2**bits-1 is read differently by different tools (--deep counts them)",
                file=first_file)
    return loaded


def _one_layer_issues(model, info, config, gc, first_file: str, deep: bool) -> tuple:
    """``(issues, layer object or None)`` of one detected layer."""
    from ..formats import build_layer
    from ..layout import Format, GptqSlot

    key, fmt = info.key, info.format
    layer = None
    if info.marker not in info.slots:
        issues = [Issue(ErrorCode.SLOT_MISSING, f"required {fmt.value} tensor '{info.marker}' is missing (the "
                        f"layer's other tensors are present)", tensor=f"{key}.{info.marker}",
                        file=next(iter(info.slots.values())).file)]
    elif fmt is Format.AWQ:
        issues = awq_issues(info, first_file)
    else:
        try:
            layer = build_layer(info.key, info.format, info.slots, lambda t: model.get(t.name), config,
                                file=str(model.root))
            issues = layer.validate(deep=deep)
        except Exl2Error as e:
            issues, layer = [e.as_issue()], None
        if layer is not None and fmt is Format.GPTQ and not any(
                i.severity is Severity.ERROR for i in issues) and gc.group_size is not None:
            want_g = 1 if gc.group_size == -1 else math.ceil(layer.K / gc.group_size)
            if layer.G != want_g:
                issues.append(Issue(ErrorCode.SLOT_SHAPE, f"{layer.G} groups in {GptqSlot.QZEROS}/{GptqSlot.SCALES} but config "
                                    f"group_size {gc.group_size} with K = {layer.K} gives {want_g}",
                                    tensor=f"{key}.{GptqSlot.SCALES}", file=layer.file))
    return issues, layer


def _bits_check(rep: Report, det, config_file: str) -> None:
    """EXL2: quantization_config.bits against the decoder linears' measured bpw."""
    from ..layout import Format

    if det.format is Format.EXL2:
        target = det.variant.get("target_bits")
        from ..names import block_of
        from ..layout import counts_in_decoder_bpw

        # the decoder linears as inspect's bpw.decoder counts them (16-bit MoE routers left out: layout.STAYS_16BIT)
        dec = [l for l in det.layers.values() if block_of(l.key) is not None and counts_in_decoder_bpw(l.key, l.format)
               and l.in_features and l.out_features]
        numel = sum(l.in_features * l.out_features + (l.out_features if l.has_bias else 0) for l in dec)
        if target is not None and numel:
            measured = sum(l.stored_bytes * 8 for l in dec) / numel
            if abs(measured - target) > BITS_TOLERANCE:
                rep.add(CheckId.BITS, Status.WARN, ErrorCode.BITS_MISMATCH, f"quantization_config.bits = {target} but "
                        f"the decoder linears measure {measured:.4f} bpw (overhead included; tolerance "
                        f"{BITS_TOLERANCE})", file=config_file)
            else:
                rep.ok(CheckId.BITS, PassCode.BITS_OK, f"quantization_config.bits = {target}; decoder linears "
                       f"measure {measured:.4f} bpw", file=config_file)
