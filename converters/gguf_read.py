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

import math
import os
from pathlib import Path

import numpy as np

from ..errors import ErrorCode, Exl2Error
from ..container import f32_to_bf16_bits
from ..container.dtypes import f32_to_f16
from .base import DEFAULT_SHARD_SIZE, Converter, LayerReport, OutSpec, TensorReport, Unit
from ..names import natural_key
from .gguf_arch import ROPE_FACTOR_TENSORS, phi3_longrope_back, spec_for_gguf_arch
from .gguf_io import decode, open_gguf
from .gguf_map import HF_ARCHITECTURES, hf_name_map, qk_heads, unpermute_qk

__all__ = ["convert_from_gguf"]

#: elements decoded at a time (4 MB of float32): a tensor is streamed from the file in row chunks of about this
#: size, so the peak is the output tensor plus a few chunk-sized temporaries whatever the tensor's size
_CHUNK_ELEMS = 1 << 20


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
        if self.reader is not None:
            self.reader.close()
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
    _check_experts(reader, a, shapes, path)
    from .gguf_vocab import tokenizer_issues

    for key, problem in tokenizer_issues(reader):  # before any work: the tokenizer must be one that loads
        raise Exl2Error(ErrorCode.GGUF_METADATA_INVALID, f"{key}: {problem}", file=path)
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
    for typ, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < emb[1]:
            cfg[f"{typ}_token_id"] = i
        elif i is not None:
            warnings.append(f"tokenizer.ggml.{key}_token_id = {i!r} is not a token id below the {emb[1]} rows of "
                            f"token_embd; config.json has no {typ}_token_id")
    return cfg, arch


#: GGUF tensor names (suffixes of ``blk.N.``) that hold one row block per expert: stacked experts [E, N, K] and
#: routers [E, hidden] (numpy order)
_EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_ROUTERS = ("ffn_gate_inp.weight",)


def _check_experts(reader, a: str, shapes: dict, path: str) -> None:
    """Before any work: every stacked expert tensor's expert dimension and every router's rows must equal
    ``{arch}.expert_count`` (which must be present then), and ``expert_used_count`` must lie in 1..expert_count.
    A tensor that says otherwise would be split into that many outputs, and a lying count would go into
    config.json as a model transformers cannot load."""
    key = f"{a}.expert_count"
    n = _field(reader, key)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
    for name, dims in shapes.items():
        tail = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if tail in _EXPERT_STACKS:
            e, what = (dims[2] if len(dims) == 3 else None), "expert dimension"
        elif tail in _ROUTERS:
            e, what = (dims[1] if len(dims) == 2 else None), "router rows"
        else:
            continue
        if e is None:
            raise Exl2Error(ErrorCode.GGUF_INVALID, f"{name} has {len(dims)} dims; a stacked expert tensor has 3 "
                            "and a router 2", tensor=name, file=path)
        if n is None:
            raise Exl2Error(ErrorCode.GGUF_METADATA_INVALID, f"{key}: missing or not a positive integer, but "
                            f"{name} holds {e} experts", tensor=name, file=path)
        if e != n:
            raise Exl2Error(ErrorCode.GGUF_METADATA_INVALID, f"{key}: {n} experts declared but {name} has {e} "
                            f"({what}); they must agree", tensor=name, file=path)
    used_key = f"{a}.expert_used_count"
    used = _field(reader, used_key)
    if n is not None and used is not None and (not isinstance(used, int) or isinstance(used, bool)
                                               or not 1 <= used <= n):
        raise Exl2Error(ErrorCode.GGUF_METADATA_INVALID, f"{used_key}: expected an integer in 1..{n} (the expert "
                        f"count), found {repr(used)[:40]}", file=path)


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
        """One output unit, decoded in row chunks (``_CHUNK_ELEMS`` elements at a time) straight from the file
        with ``pread`` into the preallocated F16/BF16 output: peak memory is the output tensor plus one chunk's
        temporaries, never the float32 decode of a whole tensor (a large embedding's would be several times the
        output)."""
        gtype = t.tensor_type.name
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if len(shape) >= 2 and 0 in shape:   # no weights: the head-sized chunking below would divide by zero
            raise Exl2Error(ErrorCode.SLOT_SHAPE, f"a {len(shape)}-D weight of shape {list(shape)}: every dimension "
                            "must be at least 1", tensor=t.name, file=self.src.path)
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
        path = src.path
        cols = shape[-1] if shape else 1
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        row_bytes = t.n_bytes // rows if rows else 0
        step = max(1, _CHUNK_ELEMS // max(cols, 1))
        if heads and len(shape) == 2:
            unpermute_qk(np.empty((shape[0], 0), np.uint8), heads, hf)  # the row-count rule, before any work
            d = shape[0] // heads  # chunks of whole heads: the rope row order moves rows only inside a head
            step = max(d, step // d * d)
        chunk_heads = heads if heads and len(shape) != 2 else None  # 1-D (a bias): one chunk, permuted whole
        out_np = np.float16 if st == "F16" else np.uint16

        def rows_of(r0: int, r1: int) -> np.ndarray:
            raw = src.reader.read_bytes(t, r0 * row_bytes, (r1 - r0) * row_bytes)
            try:
                x = decode(raw.view(np.float32) if gtype == "F32" else raw.reshape(r1 - r0, -1), gtype)
            except (NotImplementedError, KeyError, ValueError):
                raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"the gguf package cannot decode type {gtype}",
                                tensor=t.name, file=path) from None
            x = x.reshape(r1 - r0, cols)
            fin = np.isfinite(x)
            if not fin.all():
                bad = int(fin.size - np.count_nonzero(fin))
                first = r0 * cols + int(np.argmin(fin.reshape(-1)))
                raise Exl2Error(ErrorCode.NONFINITE_VALUES, f"{bad} decoded value(s) are NaN or infinite (the first "
                                f"at element {first}): the tensor's block scales or values are not finite, so it "
                                "has no F16/BF16 conversion", tensor=t.name, file=path)
            if offset:  # Gemma's GGUF norms hold 1 + w (gguf_arch.ArchSpec.norm_offset)
                x = x - np.float32(offset)
            if heads and len(shape) == 2:
                x = unpermute_qk(x, (r1 - r0) // d, hf)
            elif chunk_heads:
                x = unpermute_qk(x.reshape(-1), chunk_heads, hf).reshape(x.shape)
            return x

        def cast(x):
            if st == "F16":
                return f32_to_f16(x)
            return f32_to_bf16_bits(x)

        def build(stats: bool) -> np.ndarray:
            out = np.empty(shape, dtype=out_np)
            flat = out.reshape(rows, cols)
            err, sq_x, sq_d = 0.0, 0.0, 0.0
            for r0 in range(0, rows if cols else 0, step):
                r1 = min(rows, r0 + step)
                x = rows_of(r0, r1)
                o = cast(x)
                back = decode(o, st).reshape(x.shape)
                over = ~np.isfinite(back)
                if over.any():
                    big = float(np.max(np.abs(x[over])))
                    raise Exl2Error(ErrorCode.NONFINITE_VALUES, f"{int(np.count_nonzero(over))} value(s) lie outside "
                                    f"the {st} range (largest magnitude {big:.6g}) and would be written as infinite: "
                                    "convert with --to bf16", tensor=t.name, file=path)
                flat[r0:r1] = o
                if stats:
                    diff = back - x
                    if diff.size:
                        err = max(err, float(np.max(np.abs(diff))))
                    if linear:
                        sq_x += float(np.sum(np.square(x, dtype=np.float64)))
                        sq_d += float(np.sum(np.square(diff, dtype=np.float64)))
                del x, o, back
            if stats:
                rep.exact = err == 0.0
                rep.max_abs_error = err
                if isinstance(rep, LayerReport) and not rep.exact:
                    rep.rel_error = math.sqrt(sq_d) / math.sqrt(sq_x) if sq_x else 0.0
            return out

        def produce():
            out = build(True)
            if names is None:
                return {hf: out}
            return {n: out[e] for e, n in enumerate(names)}

        def verify(dst):
            want = build(False)
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
        # (E was checked against the metadata's expert_count by build_config before any work)
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

    def verify_files(self, tmp) -> None:
        """The written tokenizer.json must load in the ``tokenizers`` library (when installed) and give every
        GGUF token its own id."""
        if "tokenizer.json" not in (self._tok or {}):
            return
        from .gguf_vocab import check_tokenizer_file

        f = self.src.reader.get_field("tokenizer.ggml.tokens")
        check_tokenizer_file(Path(tmp) / "tokenizer.json", None if f is None else f.contents())


def convert_from_gguf(src, dst, target: str, *, force: bool = False, shard_size: int = DEFAULT_SHARD_SIZE,
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
