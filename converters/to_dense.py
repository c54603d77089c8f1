"""EXL2 / GPTQ / EXL3 (and dense) -> FP16 / BF16: a plain Hugging Face model directory.

Per linear layer ``<key>``:

* ``<key>.weight`` in ``nn.Linear`` orientation ``[out_features, in_features]``.  FP16 target: exactly the
  core's reconstruction (``Exl2Linear.dequantize`` / ``GptqLinear.dequantize``, i.e. ExLlamaV2's fp16 rounding
  for EXL2 and ``fp16(fp16(q - z) * scale)`` for GPTQ).  BF16 target: that fp16 value rounded once to bfloat16
  (round to nearest even), written as BF16.
* EXL2's N padding is removed: ``out_features`` comes from ``config.json`` (``vocab_size`` for ``lm_head``,
  head counts x head_dim for q/k/v, ...); the bias (padded to N_pad in EXL2) is cut to N and kept in the
  target dtype.  EXL3 pads both K and N to 128: both come from ``config.json`` the same way
  (``Exl3Linear.dequantize``, the canonical decode of spec/exl3.md).
* Dense layers of the source are treated like the other plain tensors.
* Projections that transformers builds fused for the architecture (``arch.FUSED_PROJECTIONS``: Phi-3's
  ``qkv_proj`` and ``gate_up_proj``) but that the source stores split (EXL2's convention) are fused back: the
  parts' reconstructions concatenated along the output rows, in the fused module's row order, as one
  ``<prefix>.qkv_proj.weight``.  Each part keeps its own report row.

A dense source (``dense -> fp16/bf16``) is just cast, with the same rules.

Plain tensors (embeddings, norms, dense layers): floating-point tensors are cast to the target dtype (an
F16 tensor is copied bit for bit to an FP16 target; BF16/F32 -> F16 rounds, and values beyond the fp16 range
are reported), integer tensors are copied unchanged.

``config.json``: ``quantization_config`` removed, ``torch_dtype`` (and ``dtype`` when present) set to the
target.  For an EXL2 source with ``tie_word_embeddings: true`` the head is ExLlamaV2's own quantized copy, not
the embedding: it is written as ``lm_head.weight`` and the tie is switched off, so the FP16 model computes what
the EXL2 model computes.
"""

from __future__ import annotations

import copy

import numpy as np

from ..layout import Format
from ..errors import ErrorCode, Exl2Error
from .registry import register
from .slots import BIAS, WEIGHT
from ..container import SourceReader, f16_to_bf16_bits
from .base import (Converter, LayerReport, OutSpec, Unit, build_layer, error_stats, layer_issues_or_raise)
from ..names import natural_key

__all__ = ["QuantToDense"]

_ST = {"fp16": "F16", "bf16": "BF16"}
_TORCH = {"fp16": "float16", "bf16": "bfloat16"}


class QuantToDense(Converter):
    """Dequantize every quantized linear layer; cast the rest."""

    def _dtype(self) -> str:
        want = _ST[self.target]
        d = self.options.dtype
        if d is not None and _ST.get(d.lower(), d.upper()) != want:
            raise Exl2Error(ErrorCode.USAGE, f"--dtype {d} contradicts --to {self.target}")
        return want

    def plan(self) -> list[Unit]:
        st = self._dtype()
        self._reconstruct: dict = {}         # layer key -> its reconstruct(reader) (see _layer_unit)
        quant = {Format.EXL2, Format.GPTQ, Format.EXL3}
        units: list[Unit] = []
        layer_units = []
        for key, info in self.detection.layers.items():
            if info.format in quant:
                if info.format is Format.EXL3:
                    from ..formats.exl3 import refuse_quantized_embedding

                    refuse_quantized_embedding(info)
                layer_units.append(self._layer_unit(info, st))
            elif info.format is not Format.DENSE:
                raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{info.format.value} layers cannot be dequantized",
                                tensor=key)
        handled = {u.key for u in layer_units}       # the layers' own names, fused or not
        layer_units = self._fuse(layer_units, st)
        plain = [self.cast_unit(n, st) for n in self.plain_tensor_names(handled)]
        units = layer_units + plain
        units.sort(key=lambda u: (u.key.startswith("lm_head"), natural_key(u.key)))
        return units

    # ---------------------------------------------------------------------------------------------------
    def _out_features(self, info) -> int:
        from ..arch import expected_features
        from ..layout import pad32

        if info.format is Format.EXL2:
            n_pad = info.out_features
            n = expected_features(self.config, info.key)[1]
            if n is not None and pad32(n) == n_pad:
                return n
            if n is not None:
                self.report.warnings.append(f"{info.key}: config.json implies {n} output features, which does "
                                            f"not pad to the stored {n_pad}: the padded width is kept")
            elif n_pad is not None and info.key.rsplit(".", 1)[-1] in ("lm_head",):
                self.report.warnings.append(f"{info.key}: no vocab_size in config.json: the padded width "
                                            f"{n_pad} is kept")
            return n_pad
        if info.format is Format.EXL3:
            return self._exl3_feature(info, 1)
        return info.out_features

    def _exl3_feature(self, info, axis: int) -> int | None:
        """EXL3's true in (axis 0) / out (axis 1) features: config.json's when they pad to the stored K_p / N_p
        (else the padded size, with a warning; validate reports EXL3_PADDING)."""
        from ..arch import expected_features
        from ..formats.exl3 import fits_padding

        padded = (info.in_features, info.out_features)[axis]
        n = expected_features(self.config, info.key)[axis]
        if n is not None and padded is not None and fits_padding(n, padded):
            return n
        if padded is not None:
            self.report.warnings.append(f"{info.key}: config.json does not give {('in', 'out')[axis]}_features "
                                        f"that pad to the stored {padded}: the padded size is kept")
        return padded

    def _layer_unit(self, info, st: str) -> Unit:
        key = info.key
        N = self._out_features(info)
        K = self._exl3_feature(info, 0) if info.format is Format.EXL3 else info.in_features
        if N is None or K is None:
            raise Exl2Error(ErrorCode.SLOT_SHAPE, "cannot tell the layer's shape from its tensors", tensor=key)
        outs = [OutSpec(f"{key}.{WEIGHT}", st, (N, K))]
        if info.has_bias:
            outs.append(OutSpec(f"{key}.{BIAS}", st, (N,)))
        rep = LayerReport(key, info.format.value, self.target, (N, K))
        self.report.layers.append(rep)
        reader, config, report = self.reader, self.config, self.report

        def reconstruct(r: SourceReader):
            layer = build_layer(r, info, config)
            w = layer.dequantize_finite()
            if w.shape != (N, K):
                raise Exl2Error(ErrorCode.SLOT_SHAPE, f"dequantized to {list(w.shape)}, planned {[N, K]}", tensor=key)
            b = layer.bias()
            return layer, w, (None if b is None else b[:N])

        def produce():
            layer, w, b = reconstruct(reader)
            layer_issues_or_raise(layer, report)
            rep.source_plan = layer.plan()
            rep.target_plan = st.lower()
            if st == "BF16":
                out = {f"{key}.{WEIGHT}": f16_to_bf16_bits(w)}
                if b is not None:
                    out[f"{key}.{BIAS}"] = f16_to_bf16_bits(b)
                # bf16 of the fp16 reconstruction: exact by definition, record the rounding it costs
                s = error_stats(_bf16_view(out[f"{key}.{WEIGHT}"]), w)
                rep.notes.append(f"bf16 rounding of the fp16 reconstruction: relative error {s['rel_error']:.2e}")
            else:
                out = {f"{key}.{WEIGHT}": w}
                if b is not None:
                    out[f"{key}.{BIAS}"] = b
            return out

        def verify(dst: SourceReader):
            _, w, b = reconstruct(reader)
            got = dst.read(f"{key}.{WEIGHT}")
            want = f16_to_bf16_bits(w) if st == "BF16" else w
            ok = np.array_equal(got.view(np.uint16), want.view(np.uint16))
            if ok and b is not None:
                gb = dst.read(f"{key}.{BIAS}")
                wb = f16_to_bf16_bits(b) if st == "BF16" else b
                ok = np.array_equal(gb.view(np.uint16), wb.view(np.uint16))
            rep.verified = ok
            if not ok:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the written weight is not the source's reconstruction "
                                "bit for bit", tensor=f"{key}.{WEIGHT}")

        self._reconstruct[key] = reconstruct     # for _fused_unit: the part's (layer, weight, bias)
        return Unit(key, outs, produce, verify, rep)

    def _fuse(self, units: list[Unit], st: str) -> list[Unit]:
        """Replace the split parts of every projection that transformers expects fused (``fused_projections``)
        by one unit writing the fused weight; a fused group is formed only when every part is present."""
        from ..arch import fused_projections

        fused = fused_projections(self.config)
        if not fused:
            return units
        by_key = {u.key: u for u in units}
        groups = {}                               # first part's key -> (fused key, part units)
        for u in units:
            prefix, _, leaf = u.key.rpartition(".")
            for f, parts in fused.items():
                members = [by_key.get(f"{prefix}.{p}") for p in parts]
                if parts[0] == leaf and all(m is not None for m in members):
                    groups[u.key] = (f"{prefix}.{f}", members)
        taken = {m.key for _, members in groups.values() for m in members}
        return [self._fused_unit(*groups[u.key], st) if u.key in groups else u
                for u in units if u.key in groups or u.key not in taken]

    def _fused_unit(self, key: str, parts: list[Unit], st: str) -> Unit:
        K = {p.outputs[0].shape[1] for p in parts}
        biased = {len(p.outputs) == 2 for p in parts}
        if len(K) != 1 or len(biased) != 1:
            raise Exl2Error(ErrorCode.SLOT_SHAPE, f"the parts of {key} ({', '.join(p.key for p in parts)}) differ "
                            "in input features or in having a bias, so they cannot be fused", tensor=key)
        N = sum(p.outputs[0].shape[0] for p in parts)
        outs = [OutSpec(f"{key}.{WEIGHT}", st, (N, K.pop()))]
        if biased.pop():
            outs.append(OutSpec(f"{key}.{BIAS}", st, (N,)))
        reader, report = self.reader, self.report

        def stacked(r: SourceReader, check: bool):
            ws, bs = [], []
            for p in parts:
                layer, w, b = self._reconstruct[p.key](r)
                if check:
                    layer_issues_or_raise(layer, report)
                    p.report.source_plan = layer.plan()
                    p.report.target_plan = f"{st.lower()} (fused into {key})"
                ws.append(w)
                bs.append(b)
            return np.concatenate(ws, axis=0), (None if bs[0] is None else np.concatenate(bs))

        def encode(a):
            return f16_to_bf16_bits(a) if st == "BF16" else a

        def produce():
            w, b = stacked(reader, True)
            res = {f"{key}.{WEIGHT}": encode(w)}
            if b is not None:
                res[f"{key}.{BIAS}"] = encode(b)
            return res

        def verify(dst: SourceReader):
            w, b = stacked(reader, False)
            ok = np.array_equal(dst.read(f"{key}.{WEIGHT}").view(np.uint16), encode(w).view(np.uint16))
            if ok and b is not None:
                ok = np.array_equal(dst.read(f"{key}.{BIAS}").view(np.uint16), encode(b).view(np.uint16))
            for p in parts:
                p.report.verified = ok
            if not ok:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the written fused weight is not the parts' "
                                "reconstructions bit for bit", tensor=f"{key}.{WEIGHT}")

        return Unit(key, outs, produce, verify, parts[0].report)

    def output_config(self) -> dict | None:
        if self.config is None:
            return None
        cfg = copy.deepcopy(self.config)
        changes = self.report.config_changes
        if "quantization_config" in cfg:
            del cfg["quantization_config"]
            changes.append("removed quantization_config")
        cfg["torch_dtype"] = _TORCH[self.target]
        changes.append(f"torch_dtype = {_TORCH[self.target]}")
        if "dtype" in cfg:
            cfg["dtype"] = _TORCH[self.target]
        head = self.detection.layers.get("lm_head")
        if (head is not None and head.format is Format.EXL2 and cfg.get("tie_word_embeddings") is True):
            cfg["tie_word_embeddings"] = False
            changes.append("tie_word_embeddings = false (the EXL2 head is its own quantized copy, written as "
                           "lm_head.weight)")
        return cfg


def _bf16_view(bits: np.ndarray) -> np.ndarray:
    from ..container import bf16_bits_to_f32

    return bf16_bits_to_f32(bits)


for _src in ("exl2", "gptq", "exl3", "dense"):
    for _tgt in ("fp16", "bf16"):
        register(_src, _tgt)(type(f"{_src.capitalize()}To{_tgt.upper()}", (QuantToDense,),
                                  {"source": _src, "target": _tgt, "__doc__": f"{_src} -> {_tgt}"}))
