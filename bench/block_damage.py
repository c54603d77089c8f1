"""Issue 40: one block at a time, the damage of a decoded quantized model's block (its attention or MLP half's
linears swapped into the FP16 model): the logits' KL to FP16 on held-out windows, one JSON line per block.

    python bench/block_damage.py REF_FP16_DIR DECODED_FP16_DIR OUT.json [docs|legal] [windows of 512]
"""
import sys, json, numpy as np, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_eval import eval_windows, load_fp32
from safetensors import safe_open
torch.set_num_threads(2)
ref_dir, dec_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
kind_text = sys.argv[4] if len(sys.argv) > 4 else "docs"
rows = int(sys.argv[5]) if len(sys.argv) > 5 else 2
ids = eval_windows(ref_dir, kind_text, rows * 512, 512)
m = load_fp32(ref_dir); base = m.model; L = len(base.layers)
inputs = []
hs = [base.layers[i].register_forward_pre_hook(lambda mod, a, kw: inputs.append((a, kw)), with_kwargs=True) for i in range(L)]
with torch.no_grad():
    ref = torch.log_softmax(m(ids, use_cache=False).logits[:, :-1].float(), -1)
for h in hs: h.remove()
f = safe_open(str(dec_dir / "model.safetensors"), "pt") if (dec_dir / "model.safetensors").exists() else None
def tail(i, args, kw):
    with torch.no_grad():
        h = args[0] if args else kw["hidden_states"]
        for j in range(i, L):
            aj, kj = inputs[j]
            kj = {k: v for k, v in kj.items() if k not in ("hidden_states", "past_key_values", "past_key_value")}
            o = base.layers[j](h, *aj[1:], **kj); h = o[0] if isinstance(o, tuple) else o
        lg = m.lm_head(base.norm(h))
        cap = getattr(m.config, "final_logit_softcapping", None)
        if cap: lg = torch.tanh(lg / cap) * cap
        lp = torch.log_softmax(lg[:, :-1].float(), -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())
res = []
for i in range(L):
    for kind, child in (("attn", "self_attn"), ("mlp", "mlp")):
        mod = getattr(base.layers[i], child)
        saved = {}
        for n, lin in mod.named_children():
            if isinstance(lin, torch.nn.Linear):
                key = f"model.layers.{i}.{child}.{n}.weight"
                saved[n] = lin.weight.data
                lin.weight.data = f.get_tensor(key).float()
        args, kw = inputs[i]
        kl = tail(i, args, kw)
        for n, w in saved.items(): getattr(mod, n).weight.data = w
        res.append({"layer": i, "kind": kind, "kl": kl})
        print(json.dumps(res[-1]), flush=True)
json.dump(res, open(out, "w"))
