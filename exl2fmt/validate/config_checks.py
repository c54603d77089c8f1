"""The ``config`` check: config.json's sizes (hidden, intermediate, vocab, heads, layer count) against the tensor
shapes (``CONFIG_MISMATCH`` naming the config field and the tensor)."""

from __future__ import annotations

import re

from ..config_values import INT_LIMITS, sane_int
from ..errors import ErrorCode, Issue, Severity

__all__ = ["config_issues", "moe_issues", "EXPERT_COUNT_KEYS", "FAMILY_COUNT_KEYS"]


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
    from ..names import is_vision

    f_in, f_out = _CONFIG_FIELDS.get(key.rsplit(".", 1)[-1], ("in_features", "out_features"))
    if is_vision(key):
        f_in, f_out = (f"vision_config.{x}" if x[0].islower() and "_features" not in x else x for x in (f_in, f_out))
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
    from ..names import block_of, is_mtp, is_vision
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
        if info.format.value == "exl3":
            # EXL3 stores K_p x N_p (padded to 128): the layer check compares them with config.json (EXL3_PADDING)
            n += (k_exp is not None) + (n_exp is not None)
            continue
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
        nextn = cint("num_nextn_predict_layers")
        # the text decoder's blocks: a vision tower's and the multi-token-prediction layers are not counted
        blocks = {block_of(k) for k in det.layers if block_of(k) is not None and not is_vision(k)
                  and not is_mtp(k, nl, nextn)}
        if blocks:
            n += 1
            if len(blocks) != nl:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"the tensors hold {len(blocks)} decoder blocks but "
                                    f"config.json num_hidden_layers = {nl}", file=config_file))
    moe, m = moe_issues(cfg, tensors, config_file)
    return issues + moe, n + m


# --- mixture of experts -------------------------------------------------------------------------------------

#: config.json's routed-expert count, per family: Mixtral / PhiMoE / GraniteMoE ``num_local_experts``,
#: Qwen2-MoE / Qwen3-MoE / OLMoE ``num_experts``, DeepSeek ``n_routed_experts`` (the first present is the one)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
#: the keys each family's transformers config reads as its expert count, the one that wins first when both are
#: present (its own key and the one its attribute_map redirects onto it: transformers 5 lets Mixtral's, OLMoE's
#: and DeepSeek-V3's alias override, Qwen3-MoE's not).  The winner is checked against the tensors; a present
#: alias that disagrees is a warning (another transformers version may read it).  A key a family does not read
#: (Qwen2-MoE has no num_local_experts) is ignored, as transformers ignores it.
FAMILY_COUNT_KEYS = {
    "mixtral": ("num_experts", "num_local_experts"), "qwen3_moe": ("num_local_experts", "num_experts"),
    "qwen2_moe": ("num_experts",), "olmoe": ("num_local_experts", "num_experts"),
    "deepseek_v2": ("n_routed_experts",), "deepseek_v3": ("num_local_experts", "n_routed_experts"),
    "phimoe": ("num_local_experts",), "granitemoe": ("num_local_experts",),
}
#: ``<block>.experts.<e>.<leaf>``: one expert's tensor (Mixtral's block_sparse_moe, Qwen/DeepSeek's mlp)
_EXPERT_RE = re.compile(r"^(?P<block>.+\.layers\.\d+\.[A-Za-z_]+)\.experts\.(?P<e>\d{1,9})\.")
#: ``<block>.experts.<proj>``: all experts stacked in one 3-D tensor (transformers' fused layout)
_STACKED_RE = re.compile(r"^(?P<block>.+\.layers\.\d+\.[A-Za-z_]+)\.experts\.(?:gate_up_proj|down_proj|gate_proj|up_proj|w1|w2|w3)"
                         r"(?:\.weight)?$")
#: ``<block>.gate.weight``: the router, one row per routed expert
_ROUTER_RE = re.compile(r"^(?P<block>.+\.layers\.\d+\.(?:block_sparse_moe|mlp|moe|feed_forward))\.gate\.weight$")


def _plain_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def moe_issues(cfg: dict, tensors, config_file: str) -> tuple[list[Issue], int]:
    """config.json's expert settings against the tensors, for every MoE family: the routed-expert count
    (``EXPERT_COUNT_KEYS``) equals the experts each MoE block holds (per-expert tensors ``experts.<e>.``, stacked
    3-D expert tensors, the router's rows) and is at least 1; ``num_experts_per_tok`` (top-k) is an integer with
    1 <= top-k <= experts; a shared expert the config asks for (``shared_expert_intermediate_size`` > 0,
    ``n_shared_experts`` >= 1) has tensors.  CONFIG_MISMATCH (config vs tensors) or CONFIG_VALUE_INVALID (a rule
    among config values), naming config.json, the key and the rule.  Returns (issues, comparisons made)."""
    issues: list[Issue] = []
    n = 0
    seen: dict[str, set[int]] = {}        # block -> expert indices of its per-expert tensors
    first: dict[str, str] = {}            # block -> one of its expert tensors (named in messages)
    stacked: dict[str, tuple[int, str]] = {}   # block -> (experts, a tensor saying so)
    routers: dict[str, tuple[int, str]] = {}
    shared: set[tuple[str, str]] = set()       # (block, ".shared_expert." or ".shared_experts.")
    for name, t in tensors.items():
        if ".experts." in name:
            m = _EXPERT_RE.match(name)
            if m:
                seen.setdefault(m.group("block"), set()).add(int(m.group("e")))
                first[m.group("block")] = min(first.get(m.group("block"), name), name, key=_natural)
                continue
            m = _STACKED_RE.match(name)
            if m and len(t.shape) == 3:
                stacked.setdefault(m.group("block"), (int(t.shape[0]), name))
                continue
        for kind in (".shared_expert.", ".shared_experts."):
            if kind in name:
                shared.add((name.split(kind, 1)[0], kind))
        m = _ROUTER_RE.match(name)
        if m and len(t.shape) == 2:
            routers[m.group("block")] = (int(t.shape[0]), name)
    moe_blocks = set(seen) | set(stacked)
    # values of the wrong type or out of range are config_values' CONFIG_VALUE_INVALID already: not repeated here
    family = FAMILY_COUNT_KEYS.get(str(cfg.get("model_type") or ""))
    keys = [k for k in family or EXPERT_COUNT_KEYS if cfg.get(k) is not None]
    sane = {k: cfg[k] for k in keys if sane_int(cfg[k], 0, INT_LIMITS[k][1]) is not None}
    counts = {k: v for k, v in list(sane.items())[:1]}    # the key transformers uses
    if not moe_blocks:
        live = [(k, v) for k, v in counts.items() if v > 0]
        if live and routers:   # a router per block but no expert tensors at all
            (key, want), (rows, rname) = live[0], routers[min(routers, key=_natural)]
            n += 1
            issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"config.json {key} = {want} and the router has {rows} "
                                "rows, but no tensor is an expert's (expected <block>.experts.<e>.*)",
                                tensor=rname, file=config_file))
        return issues, n
    # what the tensors say, per block: per-expert tensors (highest index + 1), else stacked 3-D tensors
    have: dict[str, tuple[int, str]] = {}
    for b, idx in seen.items():
        have[b] = (max(idx) + 1, first[b])
    for b, v in stacked.items():
        have.setdefault(b, v)
    if not keys:
        issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"the tensors hold a mixture of experts ({len(have)} MoE "
                            f"blocks) but config.json has none of {', '.join(family or EXPERT_COUNT_KEYS)} "
                            "(transformers would "
                            "use its default expert count)", file=config_file))
        return issues, n + 1
    holes = sorted((b for b, idx in seen.items() if len(idx) != max(idx) + 1), key=_natural)
    if holes:
        idx = seen[holes[0]]
        missing = []
        i = 0
        while len(missing) < 8 and i <= max(idx):   # at most len(idx) + 8 steps, whatever the indices
            if i not in idx:
                missing.append(i)
            i += 1
        issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"{holes[0]} lacks the tensors of expert(s) "
                            f"{', '.join(map(str, missing))} of the {max(idx) + 1} its highest index implies",
                            tensor=f"{holes[0]}.experts.{missing[0]}", file=config_file))
    for key, want in counts.items():
        for alias, v in list(sane.items())[1:]:
            if v != want:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"config.json {alias} = {v} disagrees with {key} = "
                                    f"{want}, which transformers reads for {cfg.get('model_type')} (another version "
                                    "may read the other)", file=config_file, severity=Severity.WARNING))
        n += 1
        if want < 1:
            issues.append(Issue(ErrorCode.CONFIG_VALUE_INVALID, f"{key}: a model with experts needs at least 1 "
                                f"(the tensors hold {len(have)} MoE blocks), found {want}", file=config_file))
            continue
        bad = sorted((b for b, (e, _) in have.items() if e != want), key=_natural)
        if bad:
            e, name = have[bad[0]]
            more = f" (and {len(bad) - 1} more MoE blocks)" if len(bad) > 1 else ""
            issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"config.json {key} = {want} but the tensors of "
                                f"{bad[0]} hold {e} experts{more}: the expert count must match the tensors",
                                tensor=name, file=config_file))
        rb = sorted((b for b, (rows, _) in routers.items() if b in have and rows != want), key=_natural)
        if rb:
            n += 1
            rows, rname = routers[rb[0]]
            issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"the router has {rows} rows but config.json {key} = "
                                f"{want}: one row per expert", tensor=rname, file=config_file))
    topk = sane_int(cfg.get("num_experts_per_tok"), 0, INT_LIMITS["num_experts_per_tok"][1])
    if topk is not None:
        n += 1
        limits = [(k, v) for k, v in counts.items() if v >= 1]
        key, limit = min(limits, key=lambda kv: kv[1]) if limits else \
            ("the tensors", max(e for e, _ in have.values()))
        if topk < 1:
            issues.append(Issue(ErrorCode.CONFIG_VALUE_INVALID, "num_experts_per_tok: each token goes to at least 1 "
                                f"expert, found {topk}", file=config_file))
        elif topk > limit:
            of = f"config.json {key} = {limit}" if limits else f"the {limit} experts the tensors hold"
            issues.append(Issue(ErrorCode.CONFIG_VALUE_INVALID, f"num_experts_per_tok = {topk} exceeds {of}: a "
                                "token cannot be routed to more experts than there are (top-k <= experts)",
                                file=config_file))
    # shared experts: Qwen2-MoE's one ``shared_expert`` (shared_expert_intermediate_size wide), DeepSeek's
    # ``shared_experts`` (n_shared_experts x moe_intermediate_size): the config asks for them iff tensors exist
    # (a family without shared experts may carry the key unused: only the families that read it are asked)
    mt = str(cfg.get("model_type") or "")
    for kind, k, lo, reads in ((".shared_expert.", "shared_expert_intermediate_size", 1, mt == "qwen2_moe"),
                               (".shared_experts.", "n_shared_experts", 1, mt.startswith("deepseek"))):
        v = cfg.get(k)
        if not _plain_int(v) or v < 0:
            continue
        n += 1
        with_t = sorted((b for b in have if (b, kind) in shared), key=_natural)
        without = sorted((b for b in have if (b, kind) not in shared), key=_natural)
        if v >= lo and without and reads:
            issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"config.json {k} = {v} asks for a shared expert, but "
                                f"{without[0]} has no {kind.strip('.')} tensors"
                                + (f" (nor {len(without) - 1} more MoE blocks)" if len(without) > 1 else ""),
                                tensor=without[0], file=config_file))
        elif v < lo and with_t:
            issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"config.json {k} = {v} says there is no shared expert, "
                                f"but {with_t[0]} has {kind.strip('.')} tensors", tensor=with_t[0],
                                file=config_file))
    return issues, n


def _natural(s: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]
