"""GGUF -> a Hugging Face FP16/BF16 model directory.

``gguf_io.open_gguf(path)`` (shared with ``gguf_write``'s verify pass) opens the file with exl2fmt's own bounded, lazy reader (``exl2fmt.gguf_scan``: counts,
string and array lengths, alignment, types, offsets and data extents checked against the file before anything
is allocated; hyper-parameters bounded by ``gguf_hparam_issues`` before any loop uses them).  Every problem
is ``Exl2Error(GGUF_INVALID)`` naming the file (and tensor).

``convert_from_gguf(src, dst, "fp16"|"bf16")`` (reached through ``exl2fmt.converters.convert`` when SRC is a
``.gguf`` file) runs the shared pipeline of ``converters.base`` (plan, stream into a hidden sibling directory,
validate and checksum, rename):

* ``general.architecture`` must be one that ``gguf_arch`` maps back to a transformers model type (the same
  architectures ``gguf_write`` writes; ``llama`` with ``llama.expert_count`` is Mixtral); anything else is refused;
* every tensor is decoded to float32 with ``gguf.quants.dequantize`` (F32, F16, BF16 and every block type the
  package can decode: Q4_0 ... Q8_0, the K-quants, the IQ types, TQ, MXFP4) and rounded once to the target;
  a type the package cannot decode is refused, naming the tensor;
* names: the reverse of ``gguf_map`` (Hugging Face templates pushed through the package's table), Q/K rows of
  the ``llama`` arch put back in Hugging Face's rotate-half order (``gguf_map.unpermute_qk``);
  ``rope_freqs.weight`` (llama3 rope scaling) is dropped with a warning;
* ``config.json`` is rebuilt from the GGUF metadata (widths, heads, head_dim, eps, rope base and linear
  scaling, context length; vocab size from ``token_embd``; ``tie_word_embeddings`` when ``output.weight`` is
  absent; special token ids), and the tokenizer from ``tokenizer.ggml.*`` where ``gguf_vocab`` can (byte-level
  BPE); what cannot be rebuilt is reported.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ErrorCode, Exl2Error
from ..container import f32_to_bf16_bits
from .base import Converter, LayerReport, OutSpec, TensorReport, Unit, natural_key
from .gguf_arch import ROPE_FACTOR_TENSORS, phi3_longrope_back, spec_for_gguf_arch
from .gguf_io import decode, open_gguf
from .gguf_map import HF_ARCHITECTURES, hf_name_map, qk_heads, unpermute_qk

__all__ = ["convert_from_gguf"]


def _field(reader, key):
    f = reader.get_field(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001
        return None


def _int(reader, key):
    v = _field(reader, key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


class _GgufSource:
    """Stands in for ``ModelFiles`` in ``run_conversion`` (which only needs ``config`` and ``close``)."""

    def __init__(self, path: str, reader, scan):
        self.path, self.reader, self.scan = path, reader, scan
        self.root = str(Path(path).parent)
        self.config: dict | None = None
        self.tensors: dict = {}

    def close(self) -> None:
        self.reader = None


def build_config(reader, path: str, warnings: list[str]) -> tuple[dict, str]:
    """(config.json, GGUF arch) from a GGUF's metadata; the ``gguf_arch`` spec's ``config_back`` adds the
    family's own keys."""
    arch = _field(reader, "general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"GGUF architecture {arch!r} is not supported by the bridge; "
                        f"supported: {', '.join(HF_ARCHITECTURES)}", file=path)
    spec = spec_for_gguf_arch(arch, _int(reader, f"{arch}.expert_count") is not None)
    cls, model_type = spec.hf_class, spec.model_type
    a = arch
    from ..gguf_scan import gguf_hparam_issues

    for key, problem in gguf_hparam_issues(reader, arch):  # bound every count before any loop or allocation
        raise Exl2Error(ErrorCode.GGUF_METADATA_INVALID, f"{key}: {problem}", file=path)
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    emb = shapes.get("token_embd.weight")
    if emb is None or len(emb) != 2:
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, "no 2-D token_embd.weight", file=path)

    def need(key):
        v = _int(reader, f"{a}.{key}")
        if v is None:
            raise Exl2Error(ErrorCode.GGUF_INVALID, f"metadata {a}.{key} is missing or not a positive integer",
                            file=path)
        return v

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv = _int(reader, f"{a}.attention.head_count_kv") or heads
    head_dim = (_int(reader, f"{a}.attention.key_length") or _int(reader, f"{a}.rope.dimension_count")
                or hidden // heads)
    eps = _field(reader, f"{a}.attention.layer_norm_rms_epsilon")
    theta = _field(reader, f"{a}.rope.freq_base")
    cfg = {
        "architectures": [cls], "model_type": model_type,
        "vocab_size": emb[1], "hidden_size": hidden, "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"), "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "max_position_embeddings": _int(reader, f"{a}.context_length") or 4096,
        "rms_norm_eps": float(eps) if isinstance(eps, (int, float)) else 1e-5,
        "rope_theta": float(theta) if isinstance(theta, (int, float)) else 10000.0,
        "tie_word_embeddings": "output.weight" not in shapes, "hidden_act": "silu",
        "_has_q_bias": "blk.0.attn_q.bias" in shapes,
    }
    st = _field(reader, f"{a}.rope.scaling.type")
    fac = _field(reader, f"{a}.rope.scaling.factor")
    if st == "linear" and isinstance(fac, (int, float)):
        cfg["rope_scaling"] = {"rope_type": "linear", "type": "linear", "factor": float(fac)}
    elif st == "yarn" and isinstance(fac, (int, float)):
        rs = {"rope_type": "yarn", "type": "yarn", "factor": float(fac)}
        orig = _int(reader, f"{a}.rope.scaling.original_context_length")
        if orig is not None:
            rs["original_max_position_embeddings"] = orig
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                          ("rope.scaling.yarn_ext_factor", "extrapolation_factor"),
                          ("rope.scaling.yarn_attn_factor", "attention_factor")):
            v = _field(reader, f"{a}.{key}")
            if isinstance(v, (int, float)):
                rs[name] = float(v)
        cfg["rope_scaling"] = rs
    elif st not in (None, "none"):
        warnings.append(f"rope scaling {st!r} is not carried into config.json")
    sw = _int(reader, f"{a}.attention.sliding_window")
    if sw is not None:
        cfg["sliding_window"] = sw
    if spec.config_back is not None:
        spec.config_back(lambda suffix: _field(reader, f"{a}.{suffix}"), cfg)
    if spec.model_type == "phi3" and any(n in shapes for n in ROPE_FACTOR_TENSORS):
        _phi3_longrope(reader, cfg, path)
    cfg.pop("_has_q_bias", None)
    cfg["pad_token_id"] = None  # set below when the GGUF names one (config classes' defaults can exceed the vocab)
    for typ in ("bos", "eos", "pad"):
        i = _field(reader, f"tokenizer.ggml.{typ}_token_id")
        if isinstance(i, int) and not isinstance(i, bool):
            cfg[f"{typ}_token_id"] = i
    return cfg, arch


def _phi3_longrope(reader, cfg: dict, path: str) -> None:
    """Phi-3's ``rope_factors_long/short.weight`` (1-D F32, rope dims / 2 each) into config.json's rope_scaling."""
    by_name = {t.name: t for t in reader.tensors}
    n_want = (_int(reader, "phi3.rope.dimension_count") or cfg["hidden_size"] // cfg["num_attention_heads"]) // 2
    vals = []
    for n in ROPE_FACTOR_TENSORS:
        t = by_name.get(n)
        if t is None or t.tensor_type.name != "F32" or [int(x) for x in t.shape] != [n_want]:
            raise Exl2Error(ErrorCode.GGUF_INVALID, f"Phi-3 long-rope needs {' and '.join(ROPE_FACTOR_TENSORS)} as "
                            f"F32 vectors of rope dims / 2 = {n_want} values", tensor=n, file=path)
        vals.append(np.array(t.data, dtype=np.float32).reshape(-1))
    if not all(np.isfinite(v).all() for v in vals):
        raise Exl2Error(ErrorCode.GGUF_INVALID, "Phi-3 long-rope factors must be finite", file=path)
    phi3_longrope_back(vals[0], vals[1], cfg)


class GgufToDense(Converter):
    """GGUF tensors -> Hugging Face tensors in F16 / BF16."""

    source = "gguf"

    def __init__(self, reader, detection, options, report):
        super().__init__(reader, detection, options, report)
        self.src: _GgufSource = reader.model
        self.target = options.target
        self.st = {"fp16": "F16", "bf16": "BF16"}[self.target]
        self._tok: dict[str, str] | None = None

    def plan(self) -> list[Unit]:
        r = self.src.reader
        cfg = self.config
        arch = self.src.arch
        spec = self.src.spec
        rev = hf_name_map(arch, cfg["num_hidden_layers"], spec.block_extra)
        units = []
        for t in r.tensors:
            hf = rev.get(t.name)
            if hf is None:
                if t.name in ROPE_FACTOR_TENSORS and spec.model_type == "phi3":
                    continue  # config.json's rope_scaling long_factor / short_factor (build_config)
                if t.name == "rope_freqs.weight":
                    self.report.warnings.append("rope_freqs.weight (llama3 rope scaling factors) dropped: "
                                                "config.json does not carry llama3 rope scaling")
                    continue
                raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"no Hugging Face name for GGUF tensor {t.name} "
                                f"({arch})", tensor=t.name, file=self.src.path)
            heads = qk_heads(hf, cfg["num_attention_heads"], cfg["num_key_value_heads"]) if spec.permute_qk else None
            offset = spec.norm_offset if hf.endswith("norm.weight") else 0.0
            units.append(self._unit(t, hf, heads, offset))
        units.sort(key=lambda u: (u.key.startswith("lm_head"), natural_key(u.key)))
        return units

    def _unit(self, t, hf: str, heads: int | None, offset: float = 0.0) -> Unit:
        gtype = t.tensor_type.name
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        st = self.st
        linear = len(shape) == 2 and hf.endswith("_proj.weight") or hf == "lm_head.weight"
        if linear:
            rep: LayerReport | TensorReport = LayerReport(hf[: -len(".weight")], "gguf", self.target, shape,
                                                          source_plan=gtype, target_plan=st.lower())
            self.report.layers.append(rep)
        else:
            rep = TensorReport(hf, gtype, st)
            self.report.tensors.append(rep)
        src = self.src

        def values() -> np.ndarray:
            try:
                x = decode(np.array(t.data), gtype).reshape(shape)
            except NotImplementedError:
                raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"the gguf package cannot decode type {gtype}",
                                tensor=t.name, file=src.path) from None
            if offset:  # Gemma's GGUF norms hold 1 + w (gguf_arch.ArchSpec.norm_offset)
                x = x - np.float32(offset)
            return unpermute_qk(x, heads, hf) if heads else x

        def cast(x):
            if st == "F16":
                with np.errstate(over="ignore", invalid="ignore"):
                    return x.astype(np.float16)
            return f32_to_bf16_bits(x)

        def produce():
            x = values()
            out = cast(x)
            back = decode(out, st).reshape(shape)
            fin = np.isfinite(x)
            with np.errstate(invalid="ignore"):
                diff = np.abs(np.where(fin & np.isfinite(back), back - x, 0))
            err = float(diff.max()) if diff.size else 0.0
            bad = int(np.count_nonzero(fin & ~np.isfinite(back)))
            if bad:
                self.report.warnings.append(f"{hf}: {bad} values overflow {st}")
            rep.exact = err == 0.0 and bad == 0
            rep.max_abs_error = err
            if isinstance(rep, LayerReport) and not rep.exact:
                den = float(np.sqrt(np.sum(x.astype(np.float64) ** 2)))
                rep.rel_error = float(np.sqrt(np.sum((back - x).astype(np.float64) ** 2))) / den if den else 0.0
            if names is None:
                return {hf: out}
            return {n: np.ascontiguousarray(out[e]) for e, n in enumerate(names)}

        def verify(dst):
            want = cast(values())
            for e, n in enumerate(names or [hf]):
                got = dst.read(n)
                w_e = want if names is None else want[e]
                ok = np.array_equal(np.ascontiguousarray(got).view(np.uint16),
                                    np.ascontiguousarray(w_e).view(np.uint16))
                rep.verified = ok
                if not ok:
                    raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the written tensor is not the GGUF tensor "
                                    "decoded again", tensor=n)

        # a stacked expert tensor [E, N, K] becomes the E Hugging Face tensors ...experts.<e>.<proj>.weight
        names = None
        if len(shape) == 3 and ".experts." in hf:
            pre, proj = hf[: -len(".weight")].rsplit(".experts.", 1)
            names = [f"{pre}.experts.{e}.{proj}.weight" for e in range(shape[0])]
            return Unit(hf, [OutSpec(n, st, shape[1:]) for n in names], produce, verify, rep)
        return Unit(hf, [OutSpec(hf, st, shape)], produce, verify, rep)

    def output_config(self) -> dict | None:
        cfg = dict(self.config)
        cfg["torch_dtype"] = {"F16": "float16", "BF16": "bfloat16"}[self.st]
        self.report.config_changes.append("config.json rebuilt from the GGUF metadata")
        return cfg

    def side_files(self) -> dict[str, str]:
        if self._tok is None:
            from .gguf_vocab import rebuild_tokenizer

            self._tok = rebuild_tokenizer(self.src.reader, self.report.warnings)
        return self._tok


def convert_from_gguf(src, dst, target: str, *, force: bool = False, shard_size: int = 5_000_000_000,
                      progress=None, verify: str = "auto", _fail_after: int | None = None):
    """GGUF file ``src`` -> Hugging Face directory ``dst`` (``target`` fp16 / bf16); see the module docstring."""
    from ..container.publish import check_paths
    from .base import ConversionReport, Options, run_conversion

    p = str(src)
    if target not in ("fp16", "bf16"):
        raise Exl2Error(ErrorCode.USAGE, f"a GGUF source converts to fp16 or bf16, not {target}: convert to fp16 "
                        f"first (exl2fmt convert {p} MODEL-fp16 --to fp16), then quantize that directory "
                        f"(exl2fmt convert MODEL-fp16 {dst} --to {target}; the quantizer needs the tokenizer or "
                        "--calibration)")
    check_paths(Path(p), Path(os.fspath(dst)), force)
    reader, scan = open_gguf(p)
    if scan["byte_order"] != "little":
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, "big-endian GGUF files are not converted", file=p)
    report = ConversionReport(source=p, destination=str(dst), source_format="gguf", target=target,
                              options={"shard_size": shard_size, "force": force, "verify": verify})
    source = _GgufSource(p, reader, scan)
    source.config, source.arch = build_config(reader, p, report.warnings)
    source.spec = spec_for_gguf_arch(source.arch, _int(reader, f"{source.arch}.expert_count") is not None)
    opts = Options(target=target, shard_size=shard_size, dtype=None, bits=None, group_size=None, sym=None)
    return run_conversion(GgufToDense, p, dst, opts, force=force, progress=progress, model=source, detection=None,
                          report=report, verify=verify, _fail_after=_fail_after)
