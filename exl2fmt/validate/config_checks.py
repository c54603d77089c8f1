"""The ``config`` check: config.json's sizes (hidden, intermediate, vocab, heads, layer count) against the tensor
shapes (``CONFIG_MISMATCH`` naming the config field and the tensor)."""

from __future__ import annotations

from ..errors import ErrorCode, Issue

__all__ = ["config_issues"]


_CONFIG_FIELDS = {
    "q_proj": ("hidden_size", "num_attention_heads x head_dim"),
    "k_proj": ("hidden_size", "num_key_value_heads x head_dim"),
    "v_proj": ("hidden_size", "num_key_value_heads x head_dim"),
    "o_proj": ("num_attention_heads x head_dim", "hidden_size"),
    "gate_proj": ("hidden_size", "intermediate_size"),
    "up_proj": ("hidden_size", "intermediate_size"),
    "down_proj": ("intermediate_size", "hidden_size"),
    "qkv_proj": ("hidden_size", "(num_attention_heads + 2 x num_key_value_heads) x head_dim"),
    "gate_up_proj": ("hidden_size", "2 x intermediate_size"),
    "w1": ("hidden_size", "intermediate_size"),
    "w3": ("hidden_size", "intermediate_size"),
    "w2": ("intermediate_size", "hidden_size"),
    "c_fc": ("hidden_size", "intermediate_size"),
    "c_proj": ("intermediate_size", "hidden_size"),
    "lm_head": ("hidden_size", "vocab_size"),
}


def _config_fields(key: str) -> tuple[str, str]:
    """The config.json fields that ``expected_features`` used for ``key`` (named in messages)."""
    f_in, f_out = _CONFIG_FIELDS.get(key.rsplit(".", 1)[-1], ("in_features", "out_features"))
    for part, field in ((".experts.", "moe_intermediate_size"), (".shared_expert.", "shared_expert_intermediate_size"),
                        (".shared_experts.", "moe_intermediate_size x n_shared_experts")):
        if part in key:
            f_in, f_out = (x.replace("intermediate_size", field) if "intermediate_size" in x and
                           "moe_" not in x else x for x in (f_in, f_out))
    return f_in, f_out


_EMBED = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings")


def config_issues(config: dict, det, tensors, config_file: str) -> tuple[list[Issue], int]:
    """config.json <-> tensor shapes.  Returns (issues, number of comparisons made)."""
    from ..arch import expected_features
    from ..inspect import block_of
    from ..layout import DenseSlot, pad32

    issues: list[Issue] = []
    n = 0
    cfg = dict(config)
    if isinstance(config.get("text_config"), dict):
        cfg.update(config["text_config"])

    def cint(name):
        v = cfg.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    hidden, vocab, nl = cint("hidden_size"), cint("vocab_size"), cint("num_hidden_layers")
    for name, t in tensors.items():
        leaf_key = name.rsplit(".", 1)[0]
        if name.endswith(f".{DenseSlot.WEIGHT}") and len(t.shape) == 2 and any(leaf_key.endswith(e) for e in _EMBED):
            rows, cols = t.shape
            if vocab is not None:
                n += 1
                if rows != vocab:
                    issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"embedding has {rows} rows but config.json "
                                        f"vocab_size is {vocab}", tensor=name, file=config_file))
            if hidden is not None:
                n += 1
                if cols != hidden:
                    issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"embedding has {cols} columns but config.json "
                                        f"hidden_size is {hidden}", tensor=name, file=config_file))
    for key, info in det.layers.items():
        k_exp, n_exp = expected_features(config, key)
        f_in, f_out = _config_fields(key)
        if k_exp is not None and info.in_features is not None:
            n += 1
            if info.in_features != k_exp:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"in_features {info.in_features} but config.json "
                                    f"{f_in} = {k_exp}", tensor=key, file=config_file))
        if n_exp is not None and info.out_features is not None:
            n += 1
            if info.format.value == "exl2":
                if info.out_features != pad32(n_exp):
                    issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"{info.out_features} stored columns (N_pad) but "
                                        f"config.json {f_out} = {n_exp} pads to {pad32(n_exp)}", tensor=key,
                                        file=config_file))
            elif info.out_features != n_exp:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"out_features {info.out_features} but config.json "
                                    f"{f_out} = {n_exp}", tensor=key, file=config_file))
    if nl is not None:
        blocks = {block_of(k) for k in det.layers if block_of(k) is not None}
        if blocks:
            n += 1
            if len(blocks) != nl:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"the tensors hold {len(blocks)} decoder blocks but "
                                    f"config.json num_hidden_layers = {nl}", file=config_file))
    return issues, n
