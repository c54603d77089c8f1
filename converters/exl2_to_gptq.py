"""EXL2 -> GPTQ: exact wherever the formats allow it.

Both formats dequantize a weight as ``fp16(fp16(q - z) * s)`` with an fp16 scale ``s`` per (group, output
column): EXL2 with ``s = fp16(fp16((c+1)^2) * fp16(q_scale_max / 256))`` and the implicit zero ``z_b =
2^(b-1)``, GPTQ with a stored fp16 scale and zero point.  So a GPTQ group that lies inside one EXL2 group of
``b <= bits`` bits embeds it exactly:

* scale: the EXL2 group's fp16 scale ``s[g, n]``, unchanged;
* codes: ``q_gptq = q_exl2 - z_b + z_t`` with ``z_t = 2^(bits-1)`` (symmetric GPTQ); the range
  ``[z_t - z_b, z_t + z_b - 1]`` fits in ``[0, 2^bits - 1]``, and ``q_gptq - z_t = q_exl2 - z_b`` exactly;
* rows: GPTQ groups are cut in EXL2's *stored* (act-order) row order, ``group_size`` rows each, so that they
  split the EXL2 groups; qweight rows are written in the ORIGINAL input order and
  ``g_idx[j] = q_invperm[j] // group_size`` (GPTQ act-order: non-monotonic ``g_idx``, every group
  ``group_size`` rows).

The default group size is the largest of 128, 64, 32 that divides every EXL2 group boundary (and K) of every
converted layer, so the default conversion is exact except for groups wider than the target bits.  Those (and
any GPTQ group that straddles EXL2 groups because of a forced ``--group-size``) are re-quantized from the EXL2
reconstruction with the best fp16 scale per (group, column) (``codec.gptq_fit.fit_group``), and the layer's error
against the EXL2 reconstruction is reported.

Layers outside the decoder blocks (``lm_head``) and layers whose N is not a multiple of 32 are written as
dense fp16 ``weight`` (exact: the EXL2 reconstruction, padding removed), except the quantized head of a model
whose config ties its head to its embedding: GPTQ loaders tie it to the fp16 embedding, so it is not written
(``_tied_heads``); in-block ones are then listed in
``modules_in_block_to_quantize``.  ``config.json`` gets ``quantization_config`` and ``quantize_config.json`` is
written (A6); the report says which GPTQ kernels can run the result (A9, A10).
"""

from __future__ import annotations

import copy
import json

import numpy as np

from .. import __version__
from ..layout import GPTQ_BITS, Format
from ..errors import ErrorCode, Exl2Error
from .registry import register
from ..container import SourceReader
from .base import (Converter, LayerReport, OutSpec, Unit, build_layer, error_stats, layer_issues_or_raise)
from ..names import natural_key
from ..codec.gptq_fit import fit_group
from ..formats.gptq import gptq_layer_tensors
from .slots import BIAS, G_IDX, GPTQ_BIAS, Q_GROUPS, Q_INVPERM, Q_SCALE, Q_SCALE_MAX, Q_WEIGHT, QWEIGHT, QZEROS, SCALES, WEIGHT

__all__ = ["Exl2ToGptq", "exl2_layer_to_gptq", "auto_group_size", "sized_bits_group", "gptq_stored_bits",
           "gptq_compatibility", "static_order_command", "vllm_group_size"]

_AUTO_SIZES = (128, 64, 32)


def _exl2_scales(scale_codes: np.ndarray, q_scale_max: np.ndarray) -> np.ndarray:
    """EXL2 fp16 scales [G, N_pad]: fp16(fp16((c+1)^2) * fp16(q_scale_max * 2^-8)) (ExLlamaV2's rounding)."""
    m = (np.asarray(q_scale_max, dtype=np.float16).astype(np.float32) * np.float32(1 / 256)).astype(np.float16)
    c = scale_codes.astype(np.float32) + 1
    return ((c * c) * m.astype(np.float32)[:, None]).astype(np.float16)


def _boundaries(rows: list[int]) -> list[int]:
    out, acc = [], 0
    for r in rows:
        out.append(acc)
        acc += r
    return out + [acc]


def auto_group_size(layers_rows: list[list[int]]) -> int:
    """Largest of 128/64/32 dividing every group boundary and K of every layer (32 always does)."""
    for gs in _AUTO_SIZES:
        if all(b % gs == 0 for rows in layers_rows for b in _boundaries(rows)):
            return gs
    return 32


def gptq_stored_bits(K: int, N: int, bits: int, group_size: int) -> int:
    """Stored bits of one GPTQ layer: qweight, qzeros, fp16 scales and the int32 g_idx (no bias)."""
    G = 1 if group_size == -1 else -(-K // group_size)
    return K * N * bits + G * N * (bits + 16) + K * 32


def sized_bits_group(shapes: list[tuple[int, int]], source_bits: int) -> tuple[int, int]:
    """Of 2/3/4/8 bits x groups of 128/64/32 rows, the cheapest (bits, group size) whose stored bits over
    ``shapes`` ([(N, K)], the layers written as GPTQ) are >= the EXL2 layers' own ``source_bits``; the largest
    (8-bit, 32 rows) when none reaches it.  The default EXL2 -> GPTQ (issue 40) takes its bits, so that the
    output never quantizes coarser than the source on average, and the group size of ``auto_group_size``."""
    cands = sorted((sum(gptq_stored_bits(k, n, b, gs) for n, k in shapes), b, gs)
                   for b in GPTQ_BITS for gs in _AUTO_SIZES)
    for total, b, gs in cands:
        if total >= source_bits:
            return b, gs
    return cands[-1][1], cands[-1][2]


def exl2_layer_to_gptq(layer, N: int, bits: int, group_size: int, sym: bool = True):
    """Convert one ``Exl2Linear`` to GPTQ arrays.

    Returns (codes uint8 [K, N] original row order, scales float16 [G, N], zeros int32 [G, N], g_idx int32 [K],
    stats) where stats = {rows_requantized, sq_err, ref_sq, max_abs} measured against the EXL2 reconstruction.
    """
    from ..codec.exl2 import dequantize_stored

    gt = layer.groups
    K = gt.K
    gs = K if group_size == -1 else group_size
    t = layer.tensors
    codes_s = layer.codes()[:, :N]                                   # [K, N] stored order
    s_exl2 = _exl2_scales(layer.scale_codes(), np.asarray(t[Q_SCALE_MAX]))[:, :N]
    z_t = 1 << (bits - 1)
    G = -(-K // gs)
    codes = np.empty((K, N), dtype=np.uint8)
    scales = np.empty((G, N), dtype=np.float16)
    zeros = np.full((G, N), z_t, dtype=np.int32)
    row_group = np.repeat(np.arange(gt.G), gt.rows)                  # EXL2 group of each stored row
    w_stored = None
    stats = {"rows_requantized": 0, "sq_err": 0.0, "max_abs": 0.0}
    for h in range(G):
        r0, r1 = h * gs, min((h + 1) * gs, K)
        g0, g1 = int(row_group[r0]), int(row_group[r1 - 1])
        b = int(gt.bits[g0])
        if g0 == g1 and b <= bits:
            codes[r0:r1] = (codes_s[r0:r1].astype(np.int32) - (1 << (b - 1)) + z_t).astype(np.uint8)
            scales[h] = s_exl2[g0]
            continue
        if w_stored is None:
            w_stored = dequantize_stored(np.asarray(t[Q_WEIGHT]), np.asarray(t[Q_SCALE]),
                                         np.asarray(t[Q_SCALE_MAX]), gt)[:, :N].astype(np.float32)
        x = w_stored[r0:r1]
        extra = []
        if g0 == g1:  # the coarser lattice of the same group: s * 2^(b - bits) keeps every other level
            with np.errstate(over="ignore"):
                extra.append(s_exl2[g0].astype(np.float32) * np.float32(2 ** (b - bits)))
        c, s, z = fit_group(x, bits, sym, extra)
        codes[r0:r1], scales[h], zeros[h] = c, s, z
        rec = ((c.astype(np.float32) - z[None, :]) * s.astype(np.float32)[None, :]).astype(np.float16).astype(np.float32)
        d = rec - x
        stats["rows_requantized"] += r1 - r0
        stats["sq_err"] += float(np.sum(d.astype(np.float64) ** 2))
        stats["max_abs"] = max(stats["max_abs"], float(np.max(np.abs(d))) if d.size else 0.0)
    inv = layer.permutation(Q_INVPERM)                               # stored row of original row j
    return codes[inv], scales, zeros, (inv // gs).astype(np.int32), stats


class Exl2ToGptq(Converter):
    source, target = "exl2", "gptq"

    def plan(self) -> list[Unit]:
        from ..names import block_of

        o = self.options
        sized = o.bits is None and o.group_size is None
        bits = 4 if o.bits is None else o.bits   # checked by convert (options.check_bits)
        self.bits = bits
        self.sym = True if o.sym is None else bool(o.sym)
        if o.dtype is not None and o.dtype not in ("fp16", "bf16"):  # pragma: no cover - convert() checks
            raise Exl2Error(ErrorCode.USAGE, f"dtype {o.dtype!r}")
        self.plain_dtype = {"fp16": "F16", "bf16": "BF16", None: None}[o.dtype]
        units: list[Unit] = []
        gptq_infos, dense_infos = [], []
        for key, info in self.detection.layers.items():
            if info.format is Format.EXL2:
                n = self._true_n(info)
                if block_of(key) is not None and n % 32 == 0 and info.in_features % 32 == 0:
                    gptq_infos.append((info, n))
                else:
                    dense_infos.append((info, n))
            elif info.format is not Format.DENSE:
                raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{info.format.value} layer in an EXL2 model",
                                tensor=key)
        rows = []
        if o.group_size is None:
            from ..groups import decode_q_groups

            for info, _ in gptq_infos:
                qg = self.reader.read(info.slots[Q_GROUPS].name)
                rows.append(decode_q_groups(qg, info.slots[Q_WEIGHT].shape[0], tensor=info.key).rows.tolist())
        if sized and gptq_infos:  # neither flag: near the source's size (issue 40)
            src_bits = sum(info.stored_bytes * 8 for info, _ in gptq_infos)
            shapes = [(n, info.in_features) for info, n in gptq_infos]
            # the bits: the cheapest that reach the source's size; the group: the widest that splits every EXL2
            # group, so that every group of at most those bits is carried over exactly (SmolLM2 EXL2 4.0: g128
            # re-rounds 189 of 210 layers, KL to the source 0.50 / 0.84; g32 0.27 / 0.41 for 5 % more bytes:
            # bench/RESULTS.md)
            bits, _ = sized_bits_group(shapes, src_bits)
            self.bits, self.group_size = bits, auto_group_size(rows)
            numel = sum(n * k for n, k in shapes)
            got = sum(gptq_stored_bits(k, n, bits, self.group_size) for n, k in shapes)
            self.report.options["sized"] = {"source_bpw": round(src_bits / numel, 4),
                                            "gptq_bpw": round(got / numel, 4), "bits": bits,
                                            "group_size": self.group_size}
            self.report.warnings.append(
                f"bits chosen near the source's size: the EXL2 layers hold {src_bits / numel:.3f} bpw, GPTQ "
                f"{bits}-bit with {self.group_size}-row groups (the widest that split every EXL2 group: its groups "
                f"of <= {bits} bits carried over exactly) {got / numel:.3f} bpw (--bits 4 gives the previous "
                "default: 4-bit with the same group rule)")
        elif o.group_size is None:
            self.group_size = auto_group_size(rows) if rows else 128
        else:
            gs = int(o.group_size)
            if gs != -1 and gs <= 0:
                raise Exl2Error(ErrorCode.USAGE, f"group size must be positive or -1, got {gs}")
            self.group_size = gs
        self.act_order = False
        self.dense_in_block: list[str] = []
        dropped = self._tied_heads(dense_infos)
        dense_infos = [(info, n) for info, n in dense_infos if info.key not in dropped]
        for info, n in gptq_infos:
            units.append(self._gptq_unit(info, n))
        for info, n in dense_infos:
            units.append(self._dense_unit(info, n))
            if block_of(info.key) is not None:
                self.dense_in_block.append(info.key)
                self.report.warnings.append(f"{info.key}: N = {n} is not a multiple of 32: written as a dense "
                                            "fp16 layer")
        handled = {info.key for info, _ in gptq_infos + dense_infos} | dropped
        units += [self.cast_unit(nm, self.plain_dtype) for nm in self.plain_tensor_names(handled)]
        units.sort(key=lambda u: (u.key.startswith("lm_head"), natural_key(u.key)))
        return units

    def _tied_heads(self, dense_infos) -> set[str]:
        """The quantized head (no bias) of a source whose config ties its head to its embedding: not written.
        Written dense beside ``tie_word_embeddings: true`` (56.6 MB of SmolLM2-135M's 169 MB GPTQ file) it
        made a file whose loaders disagree: transformers 5.25 keeps a stored ``lm_head.weight`` that differs from
        the embedding (and warns), vLLM's weight loader skips it as an alias of the tied embedding.  The output
        keeps the tie and the fp16 embedding serves as the head in every loader, as in GPTQ files of tied models
        and exl2fmt's own EXL2 files of them (issue 40).  ``--to fp16`` keeps the EXL2 head instead (and
        unties)."""
        from ..arch import ties_head
        from ..names import is_head

        if not ties_head(self.config):
            return set()
        out = {info.key for info, _ in dense_infos if is_head(info.key) and info.format is Format.EXL2
               and not info.has_bias}
        for key in sorted(out):
            self.report.warnings.append(
                f"{key}: the source ties its head to its embedding (tie_word_embeddings) and also stores a "
                "quantized head; it is not written: the fp16 embedding serves as the head, as GPTQ files of tied "
                "models do (a second dense head beside the tie is read by transformers and skipped by vLLM; "
                "`--to fp16` keeps the quantized head)")
        return out

    def _true_n(self, info) -> int:
        from ..arch import expected_features
        from ..layout import pad32

        n = expected_features(self.config, info.key)[1]
        return n if n is not None and pad32(n) == info.out_features else info.out_features

    # ---------------------------------------------------------------------------------------------------
    def _gptq_unit(self, info, N: int) -> Unit:
        key, K, bits, gs = info.key, info.in_features, self.bits, self.group_size
        G = 1 if gs == -1 else -(-K // gs)
        outs = [OutSpec(f"{key}.{QWEIGHT}", "I32", (K * bits // 32, N)),
                OutSpec(f"{key}.{QZEROS}", "I32", (G, N * bits // 32)),
                OutSpec(f"{key}.{SCALES}", "F16", (G, N)),
                OutSpec(f"{key}.{G_IDX}", "I32", (K,))]
        if info.has_bias:
            outs.append(OutSpec(f"{key}.{GPTQ_BIAS}", "F16", (N,)))
        rep = LayerReport(key, "exl2", "gptq", (N, K))
        self.report.layers.append(rep)
        reader, config, report, sym = self.reader, self.config, self.report, self.sym

        def produce():
            layer = build_layer(reader, info, config)
            layer_issues_or_raise(layer, report)
            rep.source_plan = layer.plan()
            codes, scales, zeros, g_idx, st = exl2_layer_to_gptq(layer, N, bits, gs, sym)
            trivial = np.array_equal(g_idx, np.arange(K) // (K if gs == -1 else gs))
            self.act_order = self.act_order or not trivial
            rep.target_plan = f"1:{bits}b_{'all' if gs == -1 else gs}g" + ("" if trivial else " act-order")
            rep.rows_requantized = st["rows_requantized"]
            if st["rows_requantized"]:
                ref = layer.dequantize()
                ref_sq = float(np.sum(ref.astype(np.float64) ** 2))
                rep.exact = st["sq_err"] == 0.0
                rep.rel_error = (st["sq_err"] / ref_sq) ** 0.5 if ref_sq > 0 else (0.0 if st["sq_err"] == 0 else
                                                                                   float("inf"))
                rep.max_abs_error = st["max_abs"]
                wide = sorted({int(b) for b in layer.groups.bits if b > bits})
                rep.notes.append(f"{st['rows_requantized']} of {K} input rows re-quantized to {bits} bits"
                                 + (f" (EXL2 groups of {', '.join(map(str, wide))} bits)" if wide else
                                    " (GPTQ groups straddle EXL2 groups)"))
            b = layer.bias()
            t = gptq_layer_tensors(codes, scales, zeros, g_idx, bits, v2=False, bias=None if b is None else b[:N])
            return {f"{key}.{slot}": arr for slot, arr in t.items()}

        def verify(dst: SourceReader):
            from ..formats import layer_from_tensors
            from ..layout import Format

            t = {s: dst.read(f"{key}.{s}") for s in (QWEIGHT, QZEROS, SCALES, G_IDX)}
            got_layer = layer_from_tensors(key, t, fmt=Format.GPTQ, bits=bits, v2=False,
                                           group_size=None if gs == -1 else gs)
            issues = [i for i in got_layer.validate(deep=True) if i.severity.value == "error"]
            if issues:
                raise issues[0].to_error()
            got = got_layer.dequantize()
            src_layer = build_layer(reader, info, config)
            ref = src_layer.dequantize()
            s = error_stats(got, ref)
            if rep.exact:
                ok = np.array_equal(got.view(np.uint16), ref.view(np.uint16))
            else:
                ok = abs(s["rel_error"] - rep.rel_error) <= 1e-6 * max(1.0, rep.rel_error)
            if ok and info.has_bias:
                ok = np.array_equal(dst.read(f"{key}.{GPTQ_BIAS}").view(np.uint16),
                                    src_layer.bias()[:N].view(np.uint16))
            rep.verified = ok
            if not ok:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the GPTQ layer does not decode to what the conversion "
                                f"claimed (relative error {s['rel_error']:.3e}, claimed {rep.rel_error:.3e})",
                                tensor=key)

        return Unit(key, outs, produce, verify, rep, full_verify=True)

    def _dense_unit(self, info, N: int) -> Unit:
        key, K = info.key, info.in_features
        outs = [OutSpec(f"{key}.{WEIGHT}", "F16", (N, K))]
        if info.has_bias:
            outs.append(OutSpec(f"{key}.{BIAS}", "F16", (N,)))
        rep = LayerReport(key, "exl2", "dense", (N, K), target_plan="f16")
        self.report.layers.append(rep)
        reader, config, report = self.reader, self.config, self.report

        def produce():
            layer = build_layer(reader, info, config)
            layer_issues_or_raise(layer, report)
            rep.source_plan = layer.plan()
            w = layer.dequantize()[:N]
            out = {f"{key}.{WEIGHT}": np.ascontiguousarray(w)}
            if info.has_bias:
                out[f"{key}.{BIAS}"] = layer.bias()[:N]
            rep.notes.append("kept unquantized: the exact fp16 EXL2 reconstruction")
            return out

        def verify(dst: SourceReader):
            ref = build_layer(reader, info, config).dequantize()[:N]
            ok = np.array_equal(dst.read(f"{key}.{WEIGHT}").view(np.uint16), ref.view(np.uint16))
            rep.verified = ok
            if not ok:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the dense head differs from the EXL2 reconstruction",
                                tensor=key)

        return Unit(key, outs, produce, verify, rep, full_verify=True)

    # ---------------------------------------------------------------------------------------------------
    def quant_config(self) -> dict:
        from ..arch import gptq_quantization_config

        qc = gptq_quantization_config(self.bits, self.group_size, self.sym,
                                      bool(self.act_order and self.group_size != -1), __version__,
                                      source_format="exl2")
        if self.dense_in_block:
            mods = sorted({k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1]
                           for key, info in self.detection.layers.items() if info.format is Format.EXL2
                           for k in [key] if k not in self.dense_in_block and ".layers." in k})
            qc["modules_in_block_to_quantize"] = [mods]
        return qc

    def finish(self) -> None:
        self.report.quantization_config = self.quant_config()
        act = bool(self.act_order and self.group_size != -1)
        shapes = [l.shape for l in self.report.layers if l.target_format == "gptq"]
        self.report.compatibility = gptq_compatibility(self.bits, self.group_size, self.sym, self.act_order, shapes)
        if act:
            cmd = static_order_command(self.report.source, self.report.destination,
                                       vllm_group_size(k for _, k in shapes))
            self.report.compatibility["vllm"]["fix"] = cmd
            self.report.warnings.append(
                "needs activation order: desc_act true (g_idx follows EXL2's input permutation, so groups are not "
                "consecutive input rows); vLLM rejects desc_act on every platform, as do other runtimes and kernels "
                "that want static groups. For a GPTQ that vLLM loads (4-bit, desc_act false), re-quantize the "
                "decoded weights in static order (calibrated GPTQ; the weight error against the EXL2 decode is "
                f"reported per layer): {cmd}")

    def output_config(self) -> dict | None:
        cfg = copy.deepcopy(self.config) if self.config is not None else {}
        cfg["quantization_config"] = self.quant_config()
        cfg["torch_dtype"] = "float16"
        if "dtype" in cfg:
            cfg["dtype"] = "float16"
        self.report.config_changes += ["quantization_config = gptq " + json.dumps(
            {k: cfg["quantization_config"][k] for k in ("bits", "group_size", "desc_act", "sym", "checkpoint_format")}),
            "torch_dtype = float16"]
        return cfg

    def side_files(self) -> dict[str, str]:
        from ..arch import autogptq_quantize_config

        full = self.quant_config()
        qc = autogptq_quantize_config(full)
        if "modules_in_block_to_quantize" in full:
            qc["modules_in_block_to_quantize"] = full["modules_in_block_to_quantize"]
        return {"quantize_config.json": json.dumps(qc, indent=2) + "\n"}


def vllm_group_size(in_features) -> int:
    """The largest of 128/64/32 rows that divides every layer's K (``in_features``, ints): vLLM sizes a layer's
    scales as K // group size, so a group that does not divide K cannot load (SmolLM2's K = 576 takes 64)."""
    ks = list(in_features)
    return next((g for g in _AUTO_SIZES if all(k % g == 0 for k in ks)), 32)


def static_order_command(src: str, dst: str, group_size: int = 128) -> str:
    """The command line that re-quantizes the EXL2 model ``src`` into a GPTQ that vLLM loads: 4-bit, groups of
    ``group_size`` rows, static order (desc_act false), next to ``dst`` as ``DST-static``; quoted for a POSIX
    shell."""
    import shlex

    out = str(dst).rstrip("/\\") + "-static"
    return (f"exl2fmt convert {shlex.quote(str(src))} {shlex.quote(out)} --to gptq --bits 4 --group-size "
            f"{int(group_size)} --order static")


#: vLLM (0.32) loads GPTQ only as 4- or 8-bit symmetric (``AutoGPTQConfig.TYPE_MAP``) and refuses desc_act with
#: groups on every platform (``normalize_and_validate_gptq_desc_act``, since vllm#54809); its CPU kernel
#: (``CPUWNA16LinearKernel``) takes 4-bit symmetric only, an even group size (or -1), and input/output sizes that are
#: multiples of 32, and exists only in the AVX-512 builds of its extension (not ``_C_AVX2``).
VLLM_CPU_NOTE = "x86 CPUs need AVX-512 (vLLM's AVX2 build has no GPTQ kernel)"


def gptq_compatibility(bits: int, group_size: int, sym: bool, act_order: bool, shapes) -> dict:
    """Which GPTQ consumers can run a checkpoint with these settings (gptq-gguf-formats A9, A10).  ``shapes``:
    (N, K) of every layer written as GPTQ."""
    def verdict(reasons, **more):
        return {"compatible": not reasons, "reasons": reasons, **more}

    desc_act = act_order and group_size != -1
    bad_nk = [f"{n}x{k}" for n, k in shapes if n % 64 or k % 128]
    marlin = []
    if bits not in (4, 8):
        marlin.append(f"{bits}-bit (Marlin needs 4 or 8)")
    if not sym:
        marlin.append("asymmetric (Marlin needs sym)")
    if group_size not in (-1, 32, 64, 128):
        marlin.append(f"group size {group_size} (Marlin needs -1, 32, 64 or 128)")
    if bad_nk:
        marlin.append(f"layers with N % 64 or K % 128 != 0: {', '.join(sorted(set(bad_nk))[:5])}")
    if any(group_size != -1 and k % group_size for _, k in shapes):
        marlin.append("K not a multiple of the group size")
    old_marlin = list(marlin)
    if bits != 4:
        old_marlin.append("original Marlin is 4-bit only")
    if group_size not in (-1, 128):
        old_marlin.append("original Marlin needs group size -1 or 128")
    if desc_act:
        old_marlin.append("act-order (g_idx) is not supported by the original Marlin")
    if any(n % 256 for n, _ in shapes):
        old_marlin.append("original Marlin needs N % 256 == 0")
    vllm = []
    if desc_act:
        vllm.append("activation order (desc_act true): vLLM refuses it on every platform; re-quantize with "
                    "--order static")
    if bits not in (4, 8) or not sym:
        vllm.append(f"{bits}-bit {'symmetric' if sym else 'asymmetric'}: vLLM's GPTQ loader takes 4- or 8-bit "
                    "symmetric only")
    bad_k = sorted({k for _, k in shapes if group_size != -1 and k % group_size})
    if bad_k:
        vllm.append(f"K = {', '.join(map(str, bad_k[:5]))} not a multiple of the group size {group_size} (vLLM "
                    f"sizes the scales as K // group size): use --group-size {vllm_group_size(k for _, k in shapes)}")
    cpu = list(vllm)
    if bits == 8 and sym:
        cpu.append("8-bit: vLLM's CPU kernel is 4-bit only")
    if group_size != -1 and group_size % 2:
        cpu.append(f"group size {group_size}: vLLM's CPU kernel needs an even group size or -1")
    bad32 = sorted({f"{n}x{k}" for n, k in shapes if n % 32 or k % 32})
    if bad32:
        cpu.append(f"layers with N or K not a multiple of 32: {', '.join(bad32[:5])}")
    exllama = [] if bits == 4 else [f"{bits}-bit (exllama/exllamav2 GPTQ kernels are 4-bit only)"]
    llamacpp = [] if bits in (2, 4, 8) else ["3-bit GPTQ is not converted by llama.cpp"]
    if desc_act:
        summary = "needs activation order (desc_act): vLLM will not load it (re-quantize with --order static)"
    else:
        summary = ("NOT Marlin-compatible: " + "; ".join(marlin)) if marlin else "Marlin-compatible (vLLM gptq_marlin)"
        summary += "; vLLM's CPU kernel: " + ("no" if cpu else "yes (x86 with AVX-512)")
    return {
        "vllm": verdict(vllm),
        "vllm_cpu": verdict(cpu, note=VLLM_CPU_NOTE),
        "vllm_gptq_marlin": verdict(marlin + vllm[:1] if desc_act else marlin),
        "marlin_original_autogptq": verdict(sorted(set(old_marlin), key=old_marlin.index)),
        "exllama_v1_v2": verdict(exllama),
        "autogptq_torch_triton_gptqmodel": verdict([]),
        "llama_cpp_convert": verdict(llamacpp),
        "summary": summary,
    }


register("exl2", "gptq")(Exl2ToGptq)
