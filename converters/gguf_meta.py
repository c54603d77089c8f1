"""The metadata of a GGUF file for ``gguf_write``: hyper-parameters, the ``general.*`` block as llama.cpp's
converter derives it from the model card, and the gated copies of the source files it is read from."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

__all__ = ["staged_inputs", "write_metadata"]


_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
               "Q5_1": "MOSTLY_Q5_1", "Q5_0": "MOSTLY_Q5_0", "Q4_1": "MOSTLY_Q4_1", "Q4_0": "MOSTLY_Q4_0",
               # a K-quant file names its main type as llama.cpp's presets do (Q3_K_M, Q4_K_M, Q5_K_M: the
               # medium mix; the file type is informative, every tensor carries its own)
               "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
               "Q6_K": "MOSTLY_Q6_K", "IQ4_NL": "MOSTLY_IQ4_NL"}


#: the source's files that the GGUF's metadata is derived from (gguf.Metadata.load, SpecialVocab, gguf_vocab)
_METADATA_INPUTS = ("README.md", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "tokenizer.model", "added_tokens.json", "special_tokens_map.json", "merges.txt", "vocab.json",
                    "chat_template.json", "chat_template.jinja")


@contextlib.contextmanager
def staged_inputs(src_dir: Path, report):
    """A private copy of ``_METADATA_INPUTS`` (and ``additional_chat_templates/*.jinja``) that passed the
    side-file gate, named like the source directory (gguf.Metadata derives the model name from it).  A card that
    exl2fmt wrote for a quantized source is replaced by the original card it kept (its tags and format are not
    this GGUF's)."""
    from ..container.sidefiles import stage_side_files
    from ..modelcard import is_generated_card, original_card

    names = list(_METADATA_INPUTS)
    extra = src_dir / "additional_chat_templates"
    if extra.is_dir() and not extra.is_symlink():
        with contextlib.suppress(OSError):
            names += sorted(f"additional_chat_templates/{e.name}" for e in os.scandir(extra)
                            if e.name.endswith(".jinja"))
    with stage_side_files(src_dir, names, report.warnings) as d:
        card = d / "README.md"
        if card.is_file():
            text = card.read_text(encoding="utf-8", errors="replace")
            if is_generated_card(text):
                orig = original_card(text)
                if orig:
                    card.write_text(orig, encoding="utf-8")
                else:
                    card.unlink()
        yield d


def write_metadata(w, arch, hp, cfg, layer_t, model, items, report, card_dir: Path | None = None) -> None:
    """Hyper-parameters (``gguf_arch.write_common_hparams`` + the architecture's own table entry) and the
    ``general.*`` block as llama.cpp's converter derives it (``gguf.Metadata.load`` on the model directory:
    model card, directory name heuristics for name/basename/finetune/size label; ``gguf.size_label`` from the
    parameter count when the card gives none)."""
    import gguf

    from .gguf_arch import spec_for_model_type, write_common_hparams

    spec = spec_for_model_type(cfg.get("model_type"))
    from .gguf_arch import phi3_rope_factors

    if spec.model_type == "phi3" and (lr := phi3_rope_factors(cfg, str(model.root))) is not None:
        # llama.cpp adds it while generating the factor tensors, before any other metadata (conversion/phi.py)
        w.add_rope_scaling_attn_factors(lr[0])
    root = Path(str(model.root))
    total, shared, expert, n_exp = w.get_total_parameter_count()
    log = logging.getLogger("gguf")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        meta = gguf.Metadata.load(None, card_dir, None, total)
    except Exception as e:  # noqa: BLE001 - a malformed model card must not stop the conversion
        report.warnings.append(f"model card metadata not read ({type(e).__name__}: {e})")
        meta = gguf.Metadata()
    finally:
        log.setLevel(level)
    if meta.name is None:
        meta.name = root.name if root.is_dir() else root.stem
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_exp)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    if spec.model_type == "llama" and cfg.get("head_dim") is None and \
            cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        # llama.cpp's converter sees transformers' LlamaConfig, which fills head_dim = hidden / heads, so it
        # writes key_length / value_length even when config.json has no head_dim (bench/gguf_stream.py)
        cfg = {**cfg, "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}
    log.setLevel(logging.ERROR)  # a family entry overriding a generic key is intended (gguf logs a warning)
    try:
        if spec.common:
            write_common_hparams(cfg, w, hp["n_layer"], report.warnings, head_dim_keys=spec.head_dim_keys)
        if spec.hparams is not None:
            spec.hparams(cfg, w)
    finally:
        log.setLevel(level)
    w.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[layer_t]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string("general.source.format", report.source_format)
    from .. import __version__

    w.add_string("general.quantized_by", f"exl2fmt {__version__}")
    if report.source_format != "dense":
        # A dense source gets exactly the general.* block llama.cpp's converter derives from its card (above), so
        # the file stays byte-identical with llama.cpp's (spec/vectors/gguf/).  A quantized EXL2/GPTQ source has
        # no such counterpart: its card's facts are added where the card did not already give them.
        _card_metadata(w, cfg, model, layer_t, report, meta)


def _card_metadata(w, cfg, model, layer_t, report, meta) -> None:
    """The model card of a GGUF output, as general.* metadata (``exl2fmt.modelcard.gguf_card_metadata``), for the
    keys ``meta`` (gguf.Metadata from the source's card) left unset."""
    from ..modelcard import gguf_card_metadata

    given = {"general.base_model": bool(getattr(meta, "base_models", None)),
             "general.license": bool(getattr(meta, "license", None)),
             "general.tags": bool(getattr(meta, "tags", None)),
             "general.description": bool(getattr(meta, "description", None))}
    for key, kind, value in gguf_card_metadata(model.root, cfg, report.source_format, layer_t):
        if any(key.startswith(k) and v for k, v in given.items()):
            continue
        if kind == "u32":
            w.add_uint32(key, value)
        elif kind == "strs":
            w.add_array(key, value)
        else:
            w.add_string(key, value)
