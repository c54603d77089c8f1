"""Tiny Hugging Face models of every architecture the GGUF bridge knows, deterministic across library versions.

``make_tiny(arch, dst, dtype="float16", tokenizer="spm"|"bpe"|None)`` writes ``config.json`` (from the
transformers config class, ``save_pretrained``), ``model.safetensors`` and tokenizer files into ``dst``.

The tensor *names and shapes* come from instantiating the transformers model class on the meta device; the
*values* are not transformers' random init (which changes between versions) but NumPy's PCG64 seeded with the
CRC32 of each tensor name, scaled 0.05 (norm weights: 1 + 0.1 N(0,1), so a norm offset such as Gemma's +1 is
visible in the bytes).  The same call therefore gives the same bytes under transformers 4.57 and 5.x, which is
what lets ``spec/vectors/gguf/`` hold goldens made by llama.cpp's converter in one venv and compared in another.

Dimensions: hidden 64, 2 layers, 4 heads (2 KV heads), head_dim 16, intermediate 128, experts 4 (top 2), vocab
from the tokenizer (``spm``: a SentencePiece BPE model with byte fallback, trained here, 320 pieces; ``bpe``: a
byte-level BPE (Qwen2 split regex) trained with ``tokenizers``, 320 tokens).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV, HEAD_DIM, FF, EXPERTS = 64, 2, 4, 2, 16, 128, 4
VOCAB = 320

_WORDS = ("the quick brown fox jumps over lazy dog model tensor weight layer block quantized format scale "
          "group bits row column matrix vector token embedding attention head rope norm expert router gate "
          "up down output input hello world numbers 0123456789 alpha beta gamma delta").split()


def _corpus(n: int = 400) -> list[str]:
    rng = np.random.default_rng(1234)
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(5, 20)))).capitalize() + "." for _ in range(n)]


def _base(arch: str) -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV, intermediate_size=FF, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    extra = {
        "llama": {}, "mistral": {"sliding_window": None}, "granite": {
            "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
            "logits_scaling": 8.0},
        "qwen2": {}, "qwen3": {"head_dim": HEAD_DIM},
        "mixtral": {"num_local_experts": EXPERTS, "num_experts_per_tok": 2},
        "qwen2_moe": {"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "shared_expert_intermediate_size": 48},
        # norm_topk_prob as every published Qwen3-MoE has it, and as llama.cpp's qwen3moe computes
        "qwen3_moe": {"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "head_dim": HEAD_DIM, "norm_topk_prob": True},
        "gemma": {"head_dim": HEAD_DIM, "tie_word_embeddings": True},
        "gemma2": {"head_dim": HEAD_DIM, "tie_word_embeddings": True, "sliding_window": 64,
                   "query_pre_attn_scalar": HEAD_DIM, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0},
        "gemma3_text": {"head_dim": HEAD_DIM, "tie_word_embeddings": True, "sliding_window": 64,
                        "query_pre_attn_scalar": HEAD_DIM},
        "phi3": {"pad_token_id": None},
        "cohere": {"logit_scale": 0.0625, "tie_word_embeddings": True},
        "starcoder2": {"use_bias": True, "sliding_window": None},
    }[arch]
    return {**common, **extra}


def config_class(arch: str):
    import transformers

    return {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "granite": transformers.GraniteConfig, "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config, "mixtral": transformers.MixtralConfig,
            "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
            "gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config,
            "gemma3_text": transformers.Gemma3TextConfig, "phi3": transformers.Phi3Config,
            "cohere": transformers.CohereConfig, "starcoder2": transformers.Starcoder2Config}[arch]


def _values(name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith(("norm.weight", "layernorm.weight", "ln_f.weight")) or ".norm." in name:
        return 1.0 + 0.1 * x
    return 0.05 * x


def make_tiny(arch: str, dst: Path, dtype: str = "float16", tokenizer: str | None = "spm", **config) -> Path:
    """A tiny model directory of ``arch`` (a ``model_type``); see the module docstring.  ``config``: keys that
    override the architecture's tiny config (e.g. ``rope_scaling``).  ``tokenizer="sp-<style>"``: the
    ``write_sp_tokenizer`` vocabulary of that style (384 pieces, special ids as the style's family has them)."""
    if tokenizer and tokenizer.startswith("sp-"):
        config = {"vocab_size": 384, **(dict(bos_token_id=2, eos_token_id=1, pad_token_id=0)
                                        if tokenizer == "sp-gemma" else {}), **config}
    import torch
    import transformers
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    import copy

    cfg = config_class(arch)(**{**_base(arch), **copy.deepcopy(config)})  # config classes edit nested dicts
    cfg.torch_dtype = dtype
    cfg.architectures = [{"gemma3_text": "Gemma3ForCausalLM"}.get(arch, cfg.__class__.__name__.replace(
        "Config", "ForCausalLM"))]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    sd = {}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for n, p in model.state_dict().items():
        if n.endswith("rotary_emb.inv_freq") or (tied and n == "lm_head.weight"):
            continue
        if arch == "mixtral":  # the published checkpoints' names (transformers 5 renames them on load)
            n = n.replace(".mlp.", ".block_sparse_moe.")
        sd[n] = _expand(n, tuple(p.shape), arch, tdt)
    out = {}
    for n, t in sd.items():
        out.update(t) if isinstance(t, dict) else out.__setitem__(n, t)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(str(dst))
    c = json.loads((dst / "config.json").read_text())
    c.pop("transformers_version", None)
    (dst / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    if tokenizer == "spm":
        write_spm_tokenizer(dst)
    elif tokenizer == "bpe":
        write_bpe_tokenizer(dst)
    elif tokenizer == "llama3":
        write_bpe_tokenizer(dst, style="llama3")
    elif tokenizer and tokenizer.startswith("sp-"):
        write_sp_tokenizer(dst, style=tokenizer[3:])
    return dst


def _expand(n: str, shape, arch, tdt):
    """One tensor, or (for transformers 5's fused expert parameters) the per-expert checkpoint tensors."""
    import torch

    # transformers 5 holds MoE experts as 3-D parameters (gate_up_proj [E, 2F, H], down_proj [E, H, F]); the
    # checkpoints people have (and transformers' loaders accept) store one 2-D tensor per expert.
    if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "block_sparse_moe.experts.gate_up_proj",
                   "block_sparse_moe.experts.down_proj")):
        pre = n.rsplit(".", 1)[0]
        E = shape[0]
        res = {}
        if arch == "mixtral":
            names = {"gate": "w1", "up": "w3", "down": "w2"}
        else:
            names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        if n.endswith("gate_up_proj"):
            F2, H = shape[1], shape[2]
            for e in range(E):
                for part in ("gate", "up"):
                    k = f"{pre}.{e}.{names[part]}.weight"
                    res[k] = torch.from_numpy(_values(k, (F2 // 2, H))).to(tdt)
        else:
            H, F = shape[1], shape[2]
            for e in range(E):
                k = f"{pre}.{e}.{names['down']}.weight"
                res[k] = torch.from_numpy(_values(k, (H, F))).to(tdt)
        return res
    return torch.from_numpy(_values(n, shape)).to(tdt)


def write_spm_tokenizer(dst: Path, vocab: int = VOCAB) -> None:
    """A SentencePiece BPE model with byte fallback (``tokenizer.model``) plus the ``tokenizer.json`` that
    transformers converts from it, as Llama 2 / Mistral / Gemma repositories ship both."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, num_threads=1, minloglevel=2,
                                   split_digits=True, allow_whitespace_only_pieces=True,
                                   remove_extra_whitespaces=False, normalization_rule_name="identity")
    (dst / "tokenizer.model").write_bytes(buf.getvalue())
    from transformers import LlamaTokenizerFast

    tok = LlamaTokenizerFast(vocab_file=str(dst / "tokenizer.model"), legacy=False, add_bos_token=True,
                             add_eos_token=False, from_slow=True)
    tok.save_pretrained(str(dst))
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "LlamaTokenizerFast"
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def write_bpe_tokenizer(dst: Path, vocab: int = VOCAB, style: str = "qwen2") -> None:
    """A byte-level BPE ``tokenizer.json`` trained here.  ``qwen2``: Qwen2's split regex, no BOS, ChatML
    specials.  ``llama3``: Llama 3's split regex and a ``TemplateProcessing`` post-processor that prepends
    ``<|begin_of_text|>`` (what Llama 3 repositories ship)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from exl2fmt.converters.gguf_vocab import PRE_PATTERNS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_PATTERNS["llama-bpe" if style == "llama3" else "qwen2"]),
                             behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab - 3, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), tr)
    if style == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        tok.add_special_tokens(specials)
        bos = tok.token_to_id(specials[0])
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", bos)])
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[2],
              "model_max_length": 256}
    else:
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 256,
              "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
                               "\n{% endfor %}"}
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


#: extra training text for ``write_sp_tokenizer``: accented words become pieces; CJK and emoji stay out of the
#: vocabulary, so they take the byte-fallback path
_SP_EXTRA = ["Café naïve déjà vu, über straße façade.", "Élan résumé coöperate.", "    indented code line",
             "tab\tseparated\tvalues", "line one\nline two\n\nline four"] * 20


def write_sp_tokenizer(dst: Path, style: str = "llama2", vocab: int = 384) -> None:
    """A real SentencePiece BPE vocabulary with byte fallback (``tokenizer.model``) and the ``tokenizer.json`` /
    ``tokenizer_config.json`` transformers 5 makes of it, laid out like the published repositories:

    * ``llama2`` (Llama 2, Mistral v0.1): ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, a dummy prefix space, BOS added;
      ``llama2-eos``: the same with ``add_eos_token`` true;
    * ``phi3``: the ``llama2`` vocabulary in Phi-3's ``tokenizer.json`` layout (normalizer ``Prepend("\u2581")``
      + ``Replace(" ", "\u2581")``, no pre-tokenizer; transformers 5 loads model_type phi3 from that file as is);
    * ``gemma``: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, no dummy prefix, the chat markers
      ``<start_of_turn>`` / ``<end_of_turn>`` as user-defined pieces, BOS added.

    transformers 5 reads a ``tokenizer.model`` only through protobuf; without it, its ``LlamaTokenizer`` /
    ``GemmaTokenizer`` are given the vocabulary and merges its own ``SentencePieceExtractor`` would extract
    (pieces in id order, merges from ``generate_merges``), read here with the sentencepiece API."""
    import io

    import sentencepiece as spm
    from transformers import GemmaTokenizer, LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    gemma = style == "gemma"
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    extra = dict(user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], add_dummy_prefix=False,
                 pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>") if gemma else {}
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus() + _SP_EXTRA), model_writer=buf,
                                   vocab_size=vocab, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   num_threads=1, minloglevel=2, split_digits=True,
                                   allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", **ids, **extra)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    pieces = {sp.IdToPiece(i): i for i in range(sp.GetPieceSize())}
    merges = generate_merges(pieces)
    if gemma:
        from tokenizers import AddedToken

        tok = GemmaTokenizer(vocab=pieces, merges=merges, add_bos_token=True, add_eos_token=False)
        # user-defined pieces stay whole, as transformers' extractor adds them (not special)
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<start_of_turn>", "<end_of_turn>")])
    else:
        tok = LlamaTokenizer(vocab=pieces, merges=merges, legacy=False, add_bos_token=True,
                             add_eos_token=style == "llama2-eos")
    if style == "phi3":  # Phi-3's tokenizer.json: the prefix space and spaces from a normalizer, no pre-tokenizer
        from tokenizers import normalizers

        tok.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                                 normalizers.Replace(" ", "\u2581")])
        tok.backend_tokenizer.pre_tokenizer = None
    tok.save_pretrained(str(dst))
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    tc.update(add_bos_token=True, add_eos_token=style == "llama2-eos")
    # the published repositories (saved by transformers 4) list their added tokens here; llama.cpp's converter
    # types them from this table (special -> CONTROL, else USER_DEFINED); transformers 5 no longer writes it
    tc["added_tokens_decoder"] = {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                   "single_word", "special")}
                                  for a in json.loads((dst / "tokenizer.json").read_text())["added_tokens"]}
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
