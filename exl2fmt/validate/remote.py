"""``validate`` of ``hf://`` models: the structural checks on the fetched headers (``validate_hub``), and
``validate --reference hf://...`` (``reference_shape_checks``): a local quantized model against its FP16/BF16
source on the Hub, from headers alone.  The reading is ``exl2fmt.hub``'s."""

from __future__ import annotations

import json
import os

from ..errors import ErrorCode, Exl2Error
from ..hub import fetch_snapshot, parse_hub_uri, remote_errors, to_remote

__all__ = ["validate_hub", "reference_shape_checks"]


def validate_hub(uri: str, *, revision: str | None = None, strict: bool = False):
    """``exl2fmt validate hf://...``: the structural checks (headers, index, config, names, layers, bits) on the
    fetched headers.  Returns (report dict, exit code)."""
    from . import validate_model

    ref = parse_hub_uri(uri, revision)
    if ref.path.endswith(".gguf"):
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, "validate checks safetensors models; this is a GGUF file "
                        "(exl2fmt inspect summarises it)", file=ref.uri())
    with fetch_snapshot(ref) as snap:
        with remote_errors(snap, ref):
            rep = validate_model(snap.target, strict=strict)
        doc = to_remote(rep.as_dict(), snap, ref)
        doc["hub"] = snap.as_dict()
    return doc, rep.exit_code


_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


def reference_shape_checks(rep, path: str | os.PathLike, uri: str, *, revision: str | None = None) -> dict:
    """``validate --reference hf://...``: compare the local quantized model at ``path`` with its FP16/BF16 source
    on the Hub from headers alone: every linear layer's (out, in) against the source's ``{key}.weight`` (EXL2:
    out padded to 32; EXL3: the sizes config.json gives, else any that pad to the stored 128-multiples), every
    other tensor's shape, and the architecture fields of config.json.  Adds ``reference`` checks to the validate
    ``Report`` ``rep``; returns the snapshot's ``hub`` dict."""
    from ..arch import features_of
    from ..container import open_model
    from ..detect import detect_model
    from ..formats.exl3 import fits_padding
    from ..layout import Format
    from ..layout import pad32
    from .report import CheckId, PassCode, Status

    ref = parse_hub_uri(uri, revision)
    with fetch_snapshot(ref, groups=False) as snap:
        src = open_model(snap.target)
        try:
            model = open_model(path)
        except Exl2Error:
            src.close()
            return snap.as_dict()  # validate has already reported why the local model does not open
        try:
            try:
                cfg = model.config or {}
            except Exl2Error:
                cfg = {}
            det = detect_model(model.tensors, cfg or None, root=model.root)
            features = features_of(cfg if isinstance(cfg, dict) else None)
            try:
                scfg = src.config or {}
            except Exl2Error as e:
                rep.add(CheckId.REFERENCE, Status.FAIL, e.code, e.message, file=uri)
                scfg = {}
            base = to_remote({"p": str(snap.target)}, snap, ref)["p"]
            sfile = lambda t: str(t.file).replace(str(snap.target), base)  # noqa: E731
            n_ok, bad = 0, 0
            covered: set[str] = set()
            for key, info in sorted(det.layers.items()):
                covered.update(t.name for t in info.slots.values())
                w = src.tensors.get(f"{key}.weight")
                if w is None:
                    rep.add(CheckId.REFERENCE, Status.WARN, ErrorCode.LAYER_NOT_FOUND, f"the reference {uri} has no "
                            f"{key}.weight; layer not compared", tensor=key)
                    continue
                K, N = info.in_features, info.out_features
                if len(w.shape) != 2 or K is None or N is None:
                    continue
                rn, rk = w.shape
                note = ", out padded to 32" if info.format is Format.EXL2 else ""
                if info.format is Format.EXL3:
                    # the tensors hold K_p x N_p (padded to 128); config.json gives the true sizes when it names
                    # the layer, else any size that pads to the stored one matches
                    hk, hn = features(key)
                    kt = hk if hk is not None and fits_padding(hk, K) else None
                    nt = hn if hn is not None and fits_padding(hn, N) else None
                    ok = (rk == kt if kt else fits_padding(rk, K)) and (rn == nt if nt else fits_padding(rn, N))
                    note = f"; stored {N} x {K}, padded to 128"
                    K, N = kt or K, nt or N
                else:
                    ok = rk == K and (rn == N or (info.format is Format.EXL2 and pad32(rn) == N))
                if ok:
                    n_ok += 1
                else:
                    bad += 1
                    rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"{info.format.value} "
                            f"layer is {N} x {K} (out x in{note}) but the reference's {key}.weight is {rn} x {rk} "
                            f"({sfile(w)})", tensor=key, file=str(next(iter(info.slots.values())).file))
            for name, t in model.tensors.items():
                if name in covered:
                    continue
                s = src.tensors.get(name)
                if s is None:
                    continue
                if tuple(s.shape) == tuple(t.shape):
                    n_ok += 1
                else:
                    bad += 1
                    rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"shape {list(t.shape)} but "
                            f"the reference has {list(s.shape)} ({sfile(s)})", tensor=name, file=str(t.file))
            if isinstance(cfg, dict) and isinstance(scfg, dict):
                tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
                ts = scfg.get("text_config") if isinstance(scfg.get("text_config"), dict) else scfg
                for k in _CONFIG_KEYS:
                    if k in tc and k in ts:
                        if tc[k] == ts[k]:
                            n_ok += 1
                        else:
                            bad += 1
                            rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"config.json {k} = "
                                    f"{json.dumps(tc[k])[:60]} but the reference's is {json.dumps(ts[k])[:60]}",
                                    file=str(model.config_path))
            if not bad and n_ok:
                rep.ok(CheckId.REFERENCE, PassCode.REFERENCE_OK, f"shapes and config match the reference {uri} "
                       f"({n_ok} comparisons from headers alone; a local --reference DIR also compares the weights)",
                       count=n_ok)
            elif not bad:
                rep.add(CheckId.REFERENCE, Status.WARN, ErrorCode.LAYER_NOT_FOUND, f"nothing in common with the "
                        f"reference {uri} to compare")
        finally:
            src.close()
            model.close()
        return snap.as_dict()
