"""``inspect_model(path)``: what a model file or directory really is, from its headers alone.

The report is a plain JSON-able dict whose shape is documented by ``spec/inspect.schema.json`` (``$defs/inspect``).
Nothing here reads tensor data, with one exception: the ``q_groups`` vector of each EXL2 layer (2G int16
values, a few hundred bytes) is read through the memory map, because the group plan is written nowhere else.
A 70B model is inspected in well under a second.

Conventions (also in the schema):

* ``parameters``: logical weights, not stored elements: K*N for every linear layer (N the true output width,
  EXL2's padding dropped when config.json says it) plus its bias, plus the element count of every other tensor.
* ``bpw`` of a layer: stored bits of all its tensors (codes, scales, groups, permutation, bias) divided by
  K*N_pad (+N_pad with a bias) for EXL2, K*N (+N) otherwise, ExLlamaV2's convention (``QParams.total_bits``).
  ``bpw.decoder`` and ``bpw.head`` are the same ratio summed over the decoder-block linears / the lm_head;
  MoE routers and other modules that stay 16-bit by convention (``layout.STAYS_16BIT``, stored dense) are left
  out of ``bpw.decoder``, as the quantizer's budget and ExLlamaV2's leave them out (``stays_16bit`` on their
  rows); ``bpw.decoder_incl_16bit`` counts them too (null when the model has none);
  ``bpw.overall`` is 8 * stored bytes of every tensor / parameters.
* ``weight_memory_bytes``: stored bytes plus what a loader derives per EXL2 layer (q_group_map int16 [2K] and
  uint16 q_perm + q_invperm instead of int32 q_invperm: +4K bytes).  An estimate for weights only (no KV cache,
  no activations).
* ``act_order``: EXL2 layers always store an input permutation (``q_invperm``), so ``true``; GPTQ layers are
  ``true`` when ``g_idx`` is present and the config says ``desc_act``, ``false`` without ``g_idx``, ``null`` when
  only reading ``g_idx`` could tell (``exl2fmt validate --deep`` does).

``.gguf`` files are summarised through the ``gguf`` package (optional: ``pip install exl2fmt[gguf]``), after a
bounded structural pre-scan of our own (the package trusts its input's counts and lengths).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .errors import Category, ErrorCode, Exl2Error, Issue
from .names import block_of, has_control_chars, is_head, layer_order_key, natural_key

__all__ = ["inspect_model", "inspect_gguf", "is_gguf", "gguf_prescan", "gguf_scan_summary", "SCHEMA_VERSION"]

#: Version of the JSON report shape (spec/inspect.schema.json).  Additive changes keep it; a removed or
#: renamed field bumps it.
SCHEMA_VERSION = "1"

_EMBED_TOKENS = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings", "token_embd")


def is_gguf(path: str | os.PathLike) -> bool:
    """A regular file named ``*.gguf`` or starting with the GGUF magic."""
    p = Path(path)
    try:
        if not p.is_file():
            return False
        if p.suffix.lower() == ".gguf":
            return True
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _tool() -> dict:
    from . import __version__

    return {"name": "exl2fmt", "version": __version__}


# ------------------------------------------------------------------------------------------------ producer


def _split_tool(text: str) -> tuple[str, str | None]:
    text = text.strip()
    for sep in (":", " ", "=="):
        if sep in text:
            a, b = text.split(sep, 1)
            return a.strip(), b.strip() or None
    return text, None


def producer(qc: dict | None, method: str | None, metadata: dict[str, str]) -> dict:
    """Who wrote the model, from quantization_config (preferred) or safetensors ``__metadata__``."""
    q = qc if isinstance(qc, dict) else {}
    prod = q.get("producer")
    if method in ("exl2", "exl3") and isinstance(prod, dict) and isinstance(prod.get("name"), str) and prod["name"]:
        ver = prod.get("version")
        return {"name": prod["name"], "version": ver if isinstance(ver, str) else None,
                "source": "quantization_config.producer"}
    if method in ("exl2", "exl3") and isinstance(q.get("version"), str):
        v = q["version"]
        if " " in v.strip():
            name, ver = _split_tool(v)
        else:
            name, ver = {"exl2": "exllamav2", "exl3": "exllamav3"}[method], v
        return {"name": name, "version": ver, "source": "quantization_config.version"}
    meta = q.get("meta") if isinstance(q.get("meta"), dict) else {}
    qz = meta.get("quantizer")
    if isinstance(qz, list) and qz and all(isinstance(x, str) for x in qz):
        qz = qz[0]
    if isinstance(qz, str) and qz:
        name, ver = _split_tool(qz)
        return {"name": name, "version": ver, "source": "quantization_config.meta.quantizer"}
    for key, name in (("auto_gptq_version", "auto_gptq"), ("gptqmodel_version", "gptqmodel")):
        if key in metadata:
            return {"name": name, "version": metadata[key], "source": f"__metadata__.{key}"}
    for key in ("producer", "quantizer", "creator", "software"):
        if key in metadata:
            name, ver = _split_tool(metadata[key])
            return {"name": name, "version": ver, "source": f"__metadata__.{key}"}
    return {"name": None, "version": None, "source": None}


# ------------------------------------------------------------------------------------------------ layers


def _layer_row(model, info, config, issues: list[Issue], features=None) -> dict:
    """One per-layer row (header-only except EXL2 q_groups); the per-format facts come from
    ``exl2fmt.formats``.  ``features``: ``arch.features_of(config)``, shared by the rows of one model."""
    from .formats import inspect_facts
    from .layout import Format

    key, fmt = info.key, info.format
    N_stored = info.out_features
    if fmt is Format.EXL2:
        from .formats.exl2 import inspect_facts as exl2_facts

        facts = exl2_facts(model, info, config, issues, features=features)
    else:
        facts = inspect_facts(fmt)(model, info, config, issues)
    K, N, G, plan, hist, act, layer_bpw, error = (facts[k] for k in ("K", "N", "G", "plan", "hist", "act", "bpw",
                                                                      "error"))
    numel_n = N_stored if fmt is Format.EXL2 else N
    if error is None and (K == 0 or N == 0 or N_stored == 0):
        # a layer of no weights: listed with this finding and no bpw (its formula would divide by zero)
        error = f"empty layer: {K} inputs x {N_stored} outputs stored"
        first = next(iter(info.slots.values()), None)
        issues.append(Issue(ErrorCode.SLOT_SHAPE, f"{error}; a linear layer needs at least one input and one "
                            "output feature", tensor=key, file=None if first is None else str(first.file)))
    if layer_bpw is None and K and numel_n:
        numel = K * numel_n + (numel_n if info.has_bias else 0)
        layer_bpw = info.stored_bytes * 8 / numel if numel else None
    params = (K * N + (N if info.has_bias else 0)) if K and N else 0
    numel_conv = (K * numel_n + (numel_n if info.has_bias else 0)) if K and numel_n else 0
    return {
        "key": key,
        "block": block_of(key) or ("head" if is_head(key) else None),
        "format": fmt.value,
        "in_features": K,
        "out_features": N,
        "out_features_stored": N_stored,
        "plan": plan,
        "groups": G,
        "bits": {str(b): hist[b] for b in sorted(hist, reverse=True)},
        "bpw": None if layer_bpw is None else round(layer_bpw, 6),
        "act_order": act,
        "bias": info.has_bias,
        "params": params,
        "stored_bytes": info.stored_bytes,
        "error": error,
        "_numel": numel_conv,
        **({"codebook": facts.get("codebook")} if fmt is Format.EXL3 else {}),
    }


def _histogram(rows) -> list[dict]:
    total: dict[int | float, int] = {}
    for r in rows:
        for b, w in r["bits"].items():
            if w:  # a bit width holding no weights (an empty layer's plan) is no bar of the histogram
                x = float(b)
                x = int(x) if x.is_integer() else x  # EXL3's half rates (1.5, 2.5, 3.5) stay halves
                total[x] = total.get(x, 0) + w
    s = sum(total.values())
    return [{"bits": b, "weights": total[b], "fraction": round(total[b] / s, 6) if s else 0.0}
            for b in sorted(total, reverse=True)]


def _ratio(bits: int, numel: int) -> float | None:
    return round(bits / numel, 6) if numel else None


def _block_rows(rows: list[dict], numel_field: str) -> list[dict]:
    """Per-block aggregation of layer rows (decoder blocks in natural order, then ``head``, then ``other``);
    a block's ``bpw`` is its stored bits over the sum of its rows' ``numel_field``."""
    blocks: dict[str, list[dict]] = {}
    for r in rows:
        blocks.setdefault(r["block"] or "other", []).append(r)
    out = []
    for name in sorted(blocks, key=lambda b: (0 if b not in ("head", "other") else 1 if b == "head" else 2,
                                             natural_key(b))):
        rs = blocks[name]
        bp = [r["bpw"] for r in rs if r["bpw"] is not None]
        out.append({"block": name, "layers": len(rs), "params": sum(r["params"] for r in rs),
                    "stored_bytes": sum(r["stored_bytes"] for r in rs),
                    "bpw": _ratio(sum(r["stored_bytes"] * 8 for r in rs), sum(r[numel_field] for r in rs)),
                    "bpw_min": min(bp) if bp else None, "bpw_max": max(bp) if bp else None})
    return out


# ------------------------------------------------------------------------------------------------ main


def inspect_model(path: str | os.PathLike, *, layers: bool = True) -> dict:
    """Inspect a ``.safetensors`` file, a model directory or a ``.gguf`` file (headers only).

    Returns the report dict (``spec/inspect.schema.json``, ``$defs/inspect``).  Raises ``Exl2Error`` when the
    input cannot be opened or a header is malformed.  ``layers=False`` leaves the per-layer list empty.
    """
    if is_gguf(path):
        return inspect_gguf(path, layers=layers)
    from .container import open_model

    p = Path(os.fspath(path))
    try:
        model = open_model(p)
    except Exl2Error as e:
        if e.code is ErrorCode.NO_SAFETENSORS and p.is_dir():
            ggufs = sorted(q.name for q in p.glob("*.gguf"))
            if ggufs:
                raise Exl2Error(ErrorCode.NO_SAFETENSORS, f"no .safetensors files, but {len(ggufs)} .gguf file(s) "
                                f"(e.g. {ggufs[0]}): inspect a .gguf file directly", file=str(p)) from None
        raise
    try:
        return _inspect_safetensors(p, model, layers)
    finally:
        model.close()


def _inspect_safetensors(p: Path, model, want_layers: bool) -> dict:
    from .detect import FORMAT_TITLES, detect_model, quantization_config
    from .layout import Format

    issues: list[Issue] = list(model.index_issues())
    try:
        config = model.config
    except Exl2Error as e:
        if e.code.category is Category.UNREADABLE:  # a FIFO, device or directory: exit 3 like any input
            raise
        issues.append(e.as_issue())
        config = None
    from .config_values import config_value_issues

    issues += config_value_issues(config, quantization_config(config, model.root)[0], str(model.config_path))
    tensors = model.tensors
    det = detect_model(tensors, config, root=model.root, file=str(model.files[0]) if model.files else None)
    issues += det.issues
    for name in tensors:
        if has_control_chars(name):
            issues.append(Issue(ErrorCode.NAME_CONTROL_CHARS, "tensor name contains control characters",
                                tensor=name, file=str(tensors[name].file)))
    rows = []
    covered: set[str] = set()
    from .arch import features_of, ties_head

    features = features_of(config)
    for key in sorted(det.layers, key=layer_order_key):
        info = det.layers[key]
        rows.append(_layer_row(model, info, config, issues, features))
        covered.update(t.name for t in info.slots.values())
    # tensors that belong to no layer (embeddings, norms, ...) plus stray slot tensors
    other = [t for n, t in tensors.items() if n not in covered]
    other_params = sum(t.numel for t in other)
    stored_bytes = sum(t.nbytes for t in tensors.values())
    params = sum(r["params"] for r in rows) + other_params

    from .layout import counts_in_decoder_bpw

    in_blocks = [r for r in rows if r["block"] not in (None, "head")]
    # MoE routers (and other modules that stay 16-bit by convention) are not counted: layout.STAYS_16BIT
    dec = [r for r in in_blocks if counts_in_decoder_bpw(r["key"], r["format"])]
    head = [r for r in rows if r["block"] == "head"]
    embed = [t for t in other if any(tok in t.name for tok in _EMBED_TOKENS)]
    bpw = {
        "decoder": _ratio(sum(r["stored_bytes"] * 8 for r in dec), sum(r["_numel"] for r in dec)),
        "decoder_incl_16bit": (_ratio(sum(r["stored_bytes"] * 8 for r in in_blocks),
                                      sum(r["_numel"] for r in in_blocks)) if len(in_blocks) > len(dec) else None),
        "head": _ratio(sum(r["stored_bytes"] * 8 for r in head), sum(r["_numel"] for r in head)),
        "embeddings": _ratio(sum(t.nbytes * 8 for t in embed), sum(t.numel for t in embed)),
        "overall": _ratio(stored_bytes * 8, params),
    }
    exl2_k = sum(r["in_features"] or 0 for r in rows if r["format"] == Format.EXL2.value)
    memory = stored_bytes + 4 * exl2_k

    block_rows = _block_rows(rows, "_numel")

    qc, qc_source = quantization_config(config, model.root)
    metadata: dict[str, str] = {}
    for h in model.headers.values():
        for k, v in h.metadata.items():
            metadata.setdefault(k, v)
    cfg = config if isinstance(config, dict) else {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    arch = cfg.get("architectures")
    arch = arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else None
    by_format: dict[str, int] = {}
    for r in rows:
        by_format[r["format"]] = by_format.get(r["format"], 0) + 1

    def cfg_int(name):
        v = text.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    kept = {id(r) for r in in_blocks} - {id(r) for r in dec}
    for r in rows:
        del r["_numel"]
        r["stays_16bit"] = id(r) in kept
    report = {
        "report": "inspect",
        "schema_version": SCHEMA_VERSION,
        "tool": _tool(),
        "path": str(p),
        "input": "directory" if p.is_dir() else "file",
        "files": [{"path": str(f), "bytes": model.headers[str(f)].file_size,
                   "tensors": len(model.headers[str(f)].tensors)} for f in model.files],
        "index": str(model.index_path) if model.index_path else None,
        "format": {"name": det.format.value, "title": FORMAT_TITLES[det.format], "label": det.label,
                   "variant": det.variant, "config_quant_method": det.config_method, "config_source": qc_source},
        "producer": producer(qc, det.config_method, metadata),
        "summary": {
            "architecture": arch,
            "model_type": cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None,
            "num_hidden_layers": cfg_int("num_hidden_layers"),
            "hidden_size": cfg_int("hidden_size"),
            "vocab_size": cfg_int("vocab_size"),
            "blocks": len({r["block"] for r in in_blocks}),
            "linear_layers": len(rows),
            "layers_by_format": by_format,
            "tensors": len(tensors),
            "parameters": params,
            "stored_bytes": stored_bytes,
            "file_bytes": sum(model.headers[str(f)].file_size for f in model.files),
            "bpw": bpw,
            # no head layer and a config that ties the head to the embedding: the embedding serves as the head
            "head_tied": not head and ties_head(cfg),
            "weight_memory_bytes": memory,
        },
        "layers": rows if want_layers else [],
        "blocks": block_rows,
        "bits_histogram": {"decoder": _histogram(dec), "head": _histogram(head)},
        "gguf": None,
        "issues": [i.as_dict() for i in issues],
    }
    return report


# ------------------------------------------------------------------------------------------------ GGUF

_GGUF_ARRAY = 9


def gguf_prescan(path: str) -> dict:
    """The bounded walk of ``exl2fmt.gguf_scan`` (see there for the checks), as a summary dict:
    ``{"version", "byte_order", "n_kv", "n_tensors", "header_end", "size", "alignment", "data_start",
    "tensors"}``; ``tensors`` lists ``(name, ne, ggml_type, offset, numel, nbytes)`` per tensor (``ne`` in GGUF
    order, fastest dimension first; ``offset`` relative to ``data_start``).  Raises ``GGUF_INVALID``."""
    from .gguf_scan import open_gguf_file

    with open_gguf_file(path) as g:
        return gguf_scan_summary(g)


def gguf_scan_summary(g) -> dict:
    return {"version": g.version, "byte_order": g.byte_order, "n_kv": g.n_kv, "n_tensors": g.n_tensors,
            "header_end": g.header_end, "size": g.size, "alignment": g.alignment, "data_start": g.data_start,
            "tensors": [(t.name, [int(x) for x in t.shape.tolist()], int(t.tensor_type), t.data_offset - g.data_start,
                         t.n_elements, t.n_bytes) for t in g.tensors]}


#: GGUF's 2-D tensors that are embedding tables (looked up, not multiplied): not linear layers, not in the decoder bpw
_GGUF_EMBEDDINGS = frozenset({"token_embd", "position_embd", "token_types", "per_layer_token_embd"})


def inspect_gguf(path: str | os.PathLike, *, layers: bool = True) -> dict:
    """Summarise a ``.gguf`` file through the ``gguf`` package (an optional dependency)."""
    p = str(path)
    try:
        import gguf  # noqa: F401  (optional extra: the ggml type table)
    except ImportError:
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, "this is a GGUF file; reading it needs the optional gguf "
                        "package: pip install 'exl2fmt[gguf]'", file=p) from None
    from .gguf_scan import open_gguf_file

    with open_gguf_file(p) as reader:  # bounded walk; arrays stay lazy (only their lengths are reported)
        return _inspect_gguf(p, reader, layers)


def _inspect_gguf(p: str, reader, layers: bool) -> dict:
    from .gguf_scan import gguf_hparam_issues

    scan = gguf_scan_summary(reader)
    size = scan["size"]
    issues: list[Issue] = []
    meta: dict[str, Any] = {}
    arrays: dict[str, int] = {}
    for name, fld in reader.fields.items():
        if fld.types[0] == _GGUF_ARRAY:
            arrays[name] = fld.count
            continue
        try:
            v = fld.contents()
        except Exception:  # noqa: BLE001 - a field we cannot render (not UTF-8) is skipped, never fatal
            continue
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)  # JSON has no NaN / Infinity
        if isinstance(v, str) and len(v) > 200:
            v = v[:200] + "..."
        if isinstance(v, (str, int, float, bool)):
            meta[name] = v
    arch0 = meta.get("general.architecture")
    for key, problem in gguf_hparam_issues(reader, arch0 if isinstance(arch0, str) else None):
        issues.append(Issue(ErrorCode.GGUF_METADATA_INVALID, f"{key}: {problem}", file=p))

    rows = []
    types: dict[str, dict] = {}
    stored = 0
    params = 0
    for t in reader.tensors:
        tname = t.tensor_type.name
        nbytes, numel = int(t.n_bytes), int(t.n_elements)
        if int(t.data_offset) + nbytes > size:
            raise Exl2Error(ErrorCode.GGUF_INVALID, f"tensor data ends at byte {int(t.data_offset) + nbytes}, past "
                            f"the end of the {size}-byte file (truncated?)", file=p, tensor=t.name)
        stored += nbytes
        params += numel
        e = types.setdefault(tname, {"type": tname, "tensors": 0, "params": 0, "bytes": 0})
        e["tensors"] += 1
        e["params"] += numel
        e["bytes"] += nbytes
        if has_control_chars(t.name):
            issues.append(Issue(ErrorCode.NAME_CONTROL_CHARS, "tensor name contains control characters",
                                tensor=t.name, file=p))
        shape = [int(x) for x in t.shape]
        if len(shape) == 2 and 0 in shape:
            issues.append(Issue(ErrorCode.SLOT_SHAPE, f"empty 2-D tensor of shape {shape}: a weight needs at least "
                                "one row and one column", tensor=t.name, file=p))
        if len(shape) == 2 and t.name.split(".", 1)[0] not in _GGUF_EMBEDDINGS:  # lookup tables are no linears
            rows.append({
                "key": t.name, "block": block_of(t.name) or ("head" if t.name.startswith("output.") else None),
                "format": "gguf", "in_features": shape[0], "out_features": shape[1], "out_features_stored": shape[1],
                "plan": tname, "groups": None, "bits": {}, "bpw": round(nbytes * 8 / numel, 6) if numel else None,
                "act_order": None, "bias": False, "params": numel, "stored_bytes": nbytes, "error": None,
            })
    for e in types.values():
        e["bpw"] = round(e["bytes"] * 8 / e["params"], 6) if e["params"] else None
    rows.sort(key=lambda r: layer_order_key(r["key"]) if not r["key"].startswith("blk.") else (0, natural_key(r["key"])))
    block_rows = _block_rows(rows, "params")
    arch = meta.get("general.architecture") if isinstance(meta.get("general.architecture"), str) else None
    dec = [r for r in rows if r["block"] not in (None, "head")]
    head = [r for r in rows if r["block"] == "head"]

    def m_int(k):
        v = meta.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return {
        "report": "inspect",
        "schema_version": SCHEMA_VERSION,
        "tool": _tool(),
        "path": p,
        "input": "gguf",
        "files": [{"path": p, "bytes": size, "tensors": len(reader.tensors)}],
        "index": None,
        "format": {"name": "gguf", "title": "GGUF", "label": "GGUF v%d (%s)" % (scan["version"],
                   ", ".join(sorted(types)) or "no tensors"),
                   "variant": {"version": scan["version"], "byte_order": scan["byte_order"],
                               "file_type": m_int("general.file_type")},
                   "config_quant_method": None, "config_source": None},
        "producer": {"name": None, "version": None, "source": None},
        "summary": {
            "architecture": arch, "model_type": arch,
            "num_hidden_layers": m_int(f"{arch}.block_count") if arch else None,
            "hidden_size": m_int(f"{arch}.embedding_length") if arch else None,
            "vocab_size": arrays.get("tokenizer.ggml.tokens"),
            "blocks": len({r["block"] for r in dec}), "linear_layers": len(rows), "layers_by_format": {"gguf": len(rows)},
            "tensors": len(reader.tensors), "parameters": params, "stored_bytes": stored, "file_bytes": size,
            "bpw": {"decoder": _ratio(sum(r["stored_bytes"] * 8 for r in dec), sum(r["params"] for r in dec)),
                    "head": _ratio(sum(r["stored_bytes"] * 8 for r in head), sum(r["params"] for r in head)),
                    "embeddings": _ratio(sum(int(t.n_bytes) * 8 for t in reader.tensors if t.name == "token_embd.weight"),
                                         sum(int(t.n_elements) for t in reader.tensors if t.name == "token_embd.weight")),
                    "overall": _ratio(stored * 8, params)},
            "weight_memory_bytes": stored,
        },
        "layers": rows if layers else [],
        "blocks": block_rows,
        "bits_histogram": {"decoder": [], "head": []},
        "gguf": {"version": scan["version"], "byte_order": scan["byte_order"], "kv_count": scan["n_kv"],
                 "tensor_count": scan["n_tensors"], "alignment": int(getattr(reader, "alignment", 32) or 32),
                 "data_start": scan["data_start"],
                 "metadata": meta, "arrays": arrays,
                 "types": sorted(types.values(), key=lambda e: -e["bytes"])},
        "issues": [i.as_dict() for i in issues],
    }
