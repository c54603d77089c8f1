"""Which quantization format a model (and each of its linear layers) is stored in.

Detection reads only tensor names, shapes and dtypes (``TensorInfo`` from the safetensors headers) plus
``config.json`` ``quantization_config``; it never reads tensor data.  Every slot name comes from the layout
table (``exl2fmt.layout.LAYOUTS`` for the formats exl2fmt decodes, ``RECOGNISED_LAYOUTS`` for AWQ).

Per layer (a tensor-name prefix such as ``model.layers.0.mlp.down_proj``):

* ``exl2``   ``<key>.q_weight`` present (ExLlamaV2 precedence: q_weight, then qweight, then weight)
* ``gptq``   ``<key>.qweight`` whose column count equals the column count of ``<key>.scales`` (packed along K)
* ``awq``    ``<key>.qweight`` with K rows and N*b/32 columns, N = ``scales`` columns, and no ``g_idx``
* ``exl3``   ``<key>.trellis`` present
* ``dense``  a 2-D ``<key>.weight`` that is not an embedding or a norm

For the model: the quantized format its quantized layers share (dense layers such as a GPTQ model's
``lm_head`` do not count), ``dense`` when every layer is dense, ``mixed`` when quantized layers of several
formats occur, ``unknown`` when no linear layer is found.  ``.gguf`` files are recognised by
``exl2fmt.inspect`` before any safetensors parsing.  When ``quantization_config.quant_method`` names a
different format than the tensors, the detection carries a ``FORMAT_MISMATCH`` issue.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .container import jsonload
from .errors import ErrorCode, Exl2Error, Issue
from .layout import (DETECTION_ORDER, EXL3_RATE_OF_LAST_DIM, SLOT_NAMES, AwqSlot, Exl2Slot, Exl3Slot, Format, GptqSlot, marker_slot,
                     slot_names)

__all__ = ["Verdict", "LayerInfo", "Detection", "detect_layers", "detect_model",
           "config_quant_method", "FORMAT_TITLES", "quantization_config", "layer_candidates", "NOT_LINEAR",
           "QUANTIZED_FORMATS"]


class Verdict(str, enum.Enum):
    """What a model is when no single layer format names it.  Values are stable strings used in JSON output."""

    GGUF = "gguf"
    """A ``.gguf`` file (recognised by ``exl2fmt.inspect`` before any safetensors parsing)."""
    MIXED = "mixed"
    """Quantized layers of several formats."""
    UNKNOWN = "unknown"
    """No linear layer found."""

    __hash__ = str.__hash__


FORMAT_TITLES = {
    Format.EXL2: "EXL2 (ExLlamaV2)",
    Format.GPTQ: "GPTQ",
    Format.AWQ: "AWQ",
    Format.EXL3: "EXL3 (ExLlamaV3)",
    Format.DENSE: "dense (unquantized)",
    Verdict.GGUF: "GGUF",
    Verdict.MIXED: "mixed quantized formats",
    Verdict.UNKNOWN: "unknown",
}

#: The quantized layer formats, in the order a mixed model lists them.
QUANTIZED_FORMATS = (Format.EXL2, Format.GPTQ, Format.AWQ, Format.EXL3)

#: quant_method strings (lower case) -> the format they name.
_METHODS = {"exl2": Format.EXL2, "gptq": Format.GPTQ, "gptq_marlin": Format.GPTQ,
            "awq": Format.AWQ, "exl3": Format.EXL3}

#: Leaf names of 2-D ``.weight`` tensors that are embeddings or norms, not linear layers.
NOT_LINEAR = ("embed_tokens", "wte", "wpe", "embed_positions", "word_embeddings", "position_embeddings",
              "token_type_embeddings", "norm", "ln_", "layernorm")

_MAX_SIDE_CONFIG = 1 << 20  # quantize_config.json larger than this is ignored


@dataclass(frozen=True)
class LayerInfo:
    """One linear layer as the headers describe it.

    ``in_features`` K and ``out_features`` N as stored (EXL2: N_pad; the true N comes from config.json),
    ``bits`` the code width (GPTQ/AWQ), trellis bits (EXL3) or dtype bits (dense), ``groups`` G when the
    shapes say it, ``ambiguous`` the other formats whose identifying tensor is also present.
    """

    key: str
    format: Format
    slots: Mapping[str, Any]  # slot name -> TensorInfo
    in_features: int | None = None
    out_features: int | None = None
    bits: int | None = None
    groups: int | None = None
    dtype: str | None = None
    ambiguous: tuple[str, ...] = ()

    @property
    def has_bias(self) -> bool:
        return SLOT_NAMES[self.format].BIAS in self.slots

    @property
    def stored_bytes(self) -> int:
        return sum(int(t.nbytes) for t in self.slots.values())

    @property
    def marker(self) -> str:
        """The slot that identifies this layer's format (q_weight, qweight, trellis, weight)."""
        return marker_slot(self.format)


@dataclass
class Detection:
    """The result of ``detect_model``.  ``variant`` holds format-specific facts (JSON-able)."""

    format: Format | Verdict
    label: str
    variant: dict
    layers: dict[str, LayerInfo]
    config_method: str | None
    issues: list[Issue] = field(default_factory=list)

    @property
    def title(self) -> str:
        return FORMAT_TITLES[self.format]


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------


def _int(v) -> int | None:
    """A plain integer of sane size (|v| < 2**31), else None: config numbers past that are reported by
    ``config_values`` and never computed with."""
    return v if isinstance(v, int) and not isinstance(v, bool) and -(1 << 31) < v < 1 << 31 else None


def _bits(v) -> float | int | None:
    """A target bit width: finite and in (0, 64], else None."""
    from .config_values import finite_number

    x = finite_number(v)
    return x if x is not None and 0 < x <= 64 else None


def quantization_config(config: dict | None, root: str | os.PathLike | None = None) -> tuple[dict | None, str | None]:
    """(quantization_config, where it came from): ``config.json`` ``quantization_config``, else a small
    ``quantize_config.json`` (AutoGPTQ / GPTQModel) in ``root``, else (None, None)."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(qc, dict):
        return qc, "config.json"
    if root is None:
        return None, None
    for name in ("quantize_config.json", "quant_config.json"):
        p = Path(root) / name
        try:
            if not p.is_file() or p.stat().st_size > _MAX_SIDE_CONFIG:
                continue
            doc = jsonload.load_json(p, jsonload.SIDE_CONFIG)  # the guarded loader (caps, parser errors mapped)
        except (OSError, Exl2Error):
            continue
        if isinstance(doc, dict):
            return doc, name
    return None, None


def config_quant_method(qc: dict | None, source: str | None = None) -> str | None:
    """The quant_method a quantization config names (lower case), or None."""
    if not isinstance(qc, dict):
        return None
    m = qc.get("quant_method", qc.get("method"))
    if isinstance(m, str) and m:
        return m.strip().lower()
    if source in ("quantize_config.json", "quant_config.json") and "bits" in qc:
        return "gptq"  # AutoGPTQ's file predates quant_method
    return None


def _gptq_or_awq(key: str, slots: Mapping[str, Any]) -> Format:
    qw, sc = slots.get(GptqSlot.QWEIGHT), slots.get(GptqSlot.SCALES)
    if qw is None or sc is None or len(qw.shape) != 2 or len(sc.shape) != 2:
        return Format.GPTQ
    if qw.shape[1] == sc.shape[1]:
        return Format.GPTQ
    n = sc.shape[1]
    if GptqSlot.G_IDX not in slots and n and (qw.shape[1] * 32) % n == 0 and qw.shape[1] < n:
        return Format.AWQ
    return Format.GPTQ


def _layer_info(key: str, fmt: Format, infos: Mapping[str, Any], ambiguous: tuple[str, ...]) -> LayerInfo:
    K = N = bits = G = None
    dtype = None

    def shape(name):
        t = infos.get(name)
        return tuple(t.shape) if t is not None else None

    if fmt is Format.EXL2:
        inv, qw, qsm = shape(Exl2Slot.Q_INVPERM), shape(Exl2Slot.Q_WEIGHT), shape(Exl2Slot.Q_SCALE_MAX)
        K = inv[0] if inv and len(inv) == 1 else None
        N = qw[1] if qw and len(qw) == 2 else None
        G = qsm[0] if qsm and len(qsm) == 1 else None
    elif fmt is Format.GPTQ:
        qw, qz = shape(GptqSlot.QWEIGHT), shape(GptqSlot.QZEROS)
        if qw and len(qw) == 2:
            N = qw[1]
            if qz and len(qz) == 2 and N and (qz[1] * 32) % N == 0:
                bits = qz[1] * 32 // N
            if bits:
                K = qw[0] * 32 // bits
            G = qz[0] if qz and len(qz) == 2 else None
    elif fmt is Format.AWQ:
        qw, sc = shape(AwqSlot.QWEIGHT), shape(AwqSlot.SCALES)
        if qw and sc and len(qw) == 2 and len(sc) == 2:
            K, N, G = qw[0], sc[1], sc[0]
            bits = qw[1] * 32 // N if N else None
    elif fmt is Format.EXL3:
        tr = shape(Exl3Slot.TRELLIS)
        if tr and len(tr) == 3:  # the sizes padded to 128; config.json gives the true ones
            K, N = tr[0] * 16, tr[1] * 16
            bits = EXL3_RATE_OF_LAST_DIM.get(tr[2])
    elif fmt is Format.DENSE:
        w = infos.get(marker_slot(Format.DENSE))
        if w is not None and len(w.shape) == 2:
            N, K = w.shape
            dtype = w.dtype
            bits = w.bits
    return LayerInfo(key, fmt, dict(infos), K, N, bits, G, dtype, ambiguous)


def layer_candidates(shapes: Mapping[str, tuple[int, ...] | None], *, recognised: bool = True
                     ) -> dict[str, list[Format]]:
    """The one layer finder: tensor name -> shape (None: unknown, the 2-D check is skipped) grouped into
    ``key -> [formats whose identifying tensor <key>.<marker> exists]`` (unsorted, in name order).

    A key is a layer when ``<key>.q_weight`` (EXL2), ``<key>.qweight`` (GPTQ), ``<key>.trellis`` (EXL3, with
    ``recognised``) or a 2-D ``<key>.weight`` that is not an embedding or norm (``NOT_LINEAR``) exists."""
    markers = {marker_slot(f): f for f in DETECTION_ORDER}
    if recognised:
        markers[marker_slot(Format.EXL3)] = Format.EXL3
    found: dict[str, list[Format]] = {}
    for name, shape in shapes.items():
        key, _, leaf = name.rpartition(".")
        f = markers.get(leaf)
        if f is None or not key:
            continue
        if f is Format.DENSE:
            if shape is not None and len(shape) != 2:
                continue
            last = key.rsplit(".", 1)[-1]
            if any(tok in last for tok in NOT_LINEAR):
                continue
        found.setdefault(key, []).append(f)
    return found


#: Tensors only a layer of one format has, besides its identifying one: a key holding one of them but no
#: identifying tensor is reported as a layer of that format with its marker slot missing.
_ORPHAN_SLOTS: dict[str, Format] = {
    **{s: Format.EXL2 for s in slot_names(Format.EXL2, derived=False) if s != Exl2Slot.BIAS},
    GptqSlot.QZEROS: Format.GPTQ, GptqSlot.G_IDX: Format.GPTQ,
    Exl3Slot.SUH: Format.EXL3, Exl3Slot.SVH: Format.EXL3,
}
_LAYER_ORDER = (Format.EXL2, Format.GPTQ, Format.EXL3, Format.DENSE)


def detect_layers(tensors: Mapping[str, Any]) -> dict[str, LayerInfo]:
    """Group ``name -> TensorInfo`` into linear layers (sorted by key).  Header-only."""
    found = layer_candidates({name: tuple(info.shape) for name, info in tensors.items()})
    for name in tensors:
        key, _, leaf = name.rpartition(".")
        if key and key not in found and leaf in _ORPHAN_SLOTS:
            found[key] = [_ORPHAN_SLOTS[leaf]]
    out: dict[str, LayerInfo] = {}
    stored: dict[Format, tuple] = {}  # format -> ((slot, ".slot"), ...): the slot names once, not per layer
    for key in sorted(found):
        fmts = sorted(set(found[key]), key=_LAYER_ORDER.index)
        fmt = fmts[0]
        names = stored.get(fmt)
        if names is None:
            names = stored[fmt] = tuple((s, "." + s.value) for s in slot_names(fmt, derived=False))
        infos = {}
        for s, suffix in names:
            t = tensors.get(key + suffix)
            if t is not None:
                infos[s] = t
        if fmt is Format.GPTQ:
            fmt = _gptq_or_awq(key, infos)
            if fmt is Format.AWQ:
                awq_names = set(slot_names(Format.AWQ))
                infos = {s: t for s, t in infos.items() if s in awq_names}
        out[key] = _layer_info(key, fmt, infos, tuple(f.value for f in fmts[1:]))
    return out


def _dense_dtype(layers) -> str:
    dts = sorted({l.dtype for l in layers if l.dtype})
    return dts[0] if len(dts) == 1 else ("mixed" if dts else "?")


def _most_common(values):
    counts: dict = {}
    for v in values:
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else None


def detect_model(tensors: Mapping[str, Any], config: dict | None, *, root: str | os.PathLike | None = None,
                 file: str | None = None) -> Detection:
    """Detect the format of a model from ``name -> TensorInfo`` (all shards) and its config.

    ``root`` is the model directory (to find ``quantize_config.json``); ``file`` is named in issues.
    """
    layers = detect_layers(tensors)
    issues: list[Issue] = []
    for info in layers.values():
        if info.ambiguous:
            issues.append(Issue(ErrorCode.FORMAT_AMBIGUOUS,
                                f"holds tensors of {info.format.value} and of {', '.join(info.ambiguous)}; "
                                f"loaders will read it as {info.format.value}", tensor=info.key, file=file))
    qc, qc_source = quantization_config(config, root)
    method = config_quant_method(qc, qc_source)
    by_fmt: dict[Format, list[LayerInfo]] = {}
    for info in layers.values():
        by_fmt.setdefault(info.format, []).append(info)
    quantized = [f for f in QUANTIZED_FORMATS if f in by_fmt]
    if len(quantized) == 1:
        fmt = quantized[0]
    elif len(quantized) > 1:
        fmt = Verdict.MIXED
        issues.append(Issue(ErrorCode.FORMAT_AMBIGUOUS, "quantized layers of several formats: " + ", ".join(
            f"{len(by_fmt[f])} {f.value}" for f in quantized), file=file))
    elif Format.DENSE in by_fmt:
        fmt = Format.DENSE
    else:
        fmt = Verdict.UNKNOWN
    # EXL3 tensor names vary between releases: a config that says exl3 names a model whose tensors say nothing
    from_config = fmt is Verdict.UNKNOWN and method == Format.EXL3.value
    if from_config:
        fmt = Format.EXL3

    variant: dict[str, Any] = {}
    label = FORMAT_TITLES[fmt]
    q = qc if isinstance(qc, dict) else {}
    if fmt is Format.EXL2:
        variant = {"target_bits": _bits(q.get("bits")),
                   "head_bits": _int(q.get("head_bits"))}
        label = "EXL2"
        if variant["target_bits"] is not None:
            label += f" {variant['target_bits']} bpw target"
        if variant["head_bits"] is not None:
            label += f", head {variant['head_bits']} bits"
    elif fmt is Format.GPTQ:
        ls = by_fmt[Format.GPTQ]
        bits = _int(q.get("bits")) or _most_common(l.bits for l in ls)
        gs = _int(q.get("group_size"))
        if gs is None:
            gs = _most_common(-1 if l.groups == 1 else (math.ceil(l.in_features / l.groups) if l.in_features and
                                                          l.groups else None) for l in ls)
        ckpt = q.get("checkpoint_format", q.get("format"))
        ckpt = ckpt if isinstance(ckpt, str) else "gptq"
        sym = q.get("sym") if isinstance(q.get("sym"), bool) else None
        desc_act = q.get("desc_act") if isinstance(q.get("desc_act"), bool) else None
        has_gidx = any(GptqSlot.G_IDX in l.slots for l in ls)
        act = (desc_act and has_gidx) if desc_act is not None else (False if not has_gidx else None)
        variant = {"checkpoint_format": ckpt, "version": 2 if ckpt == "gptq_v2" else 1, "bits": bits,
                   "group_size": gs, "sym": sym, "act_order": act, GptqSlot.G_IDX.value: has_gidx}
        label = (f"GPTQ v{variant['version']} {bits}-bit g{gs} "
                 f"{'sym' if sym else 'asym' if sym is False else 'sym?'} "
                 f"{'act-order' if act else 'no act-order' if act is False else 'act-order?'}")
    elif fmt is Format.AWQ:
        ls = by_fmt[Format.AWQ]
        bits = _int(q.get("bits", q.get("w_bit"))) or _most_common(l.bits for l in ls)
        gs = _int(q.get("group_size", q.get("q_group_size"))) or _most_common(
            l.in_features // l.groups if l.in_features and l.groups else None for l in ls)
        ver = q.get("version", q.get("format"))
        zp = q.get("zero_point") if isinstance(q.get("zero_point"), bool) else None
        variant = {"bits": bits, "group_size": gs, "version": ver if isinstance(ver, str) else None, "zero_point": zp}
        label = f"AWQ {bits}-bit g{gs}" + (f" {ver}" if isinstance(ver, str) else "")
    elif fmt is Format.EXL3:
        ls = by_fmt.get(Format.EXL3, [])
        variant = {"target_bits": _bits(q.get("bits")), "head_bits": _bits(q.get("head_bits")),
                   "vision_bits": _bits(q.get("vision_bits")), "mtp_bits": _bits(q.get("mtp_bits")),
                   "trellis_bits": sorted({l.bits for l in ls if l.bits})}
        label = "EXL3" + (f" {variant['target_bits']} bpw target" if variant["target_bits"] is not None else "")
        if from_config:
            label += " (named by quant_method, no trellis tensors found)"
    elif fmt is Format.DENSE:
        dt = _dense_dtype(by_fmt[Format.DENSE])
        variant = {"dtype": dt}
        label = f"dense {dt}"

    if method is not None:
        named = _METHODS.get(method)
        if fmt in (Verdict.UNKNOWN, Verdict.MIXED):
            pass
        elif named is None or named is not fmt:
            what = named.value if named is not None else f"'{method}'"
            issues.append(Issue(ErrorCode.FORMAT_MISMATCH,
                                f"{qc_source} quantization config says quant_method {what} but the tensors are "
                                f"{fmt.value} ({len(by_fmt.get(fmt, []))} layers)",
                                file=str(Path(root) / qc_source) if root is not None and qc_source else file))
    return Detection(fmt, label, variant, layers, method, issues)
