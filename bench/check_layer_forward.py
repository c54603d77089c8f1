"""Issue 40: the quantizer's layer-by-layer forward (``runner.model.HFModel``: embedding, each decoder layer, the
attention half's stop at the norm in front of the MLP, the final norm and head) against transformers' whole model
on two calibration rows, each layer fed transformers' own hidden state; prints the largest per-token relative
difference per layer (0 = bit for bit).

    python bench/check_layer_forward.py FP16_DIR      (FP16_DIR/../cal.npy: the calibration ids)
"""
import sys, numpy as np, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from exl2fmt.container import open_model
from exl2fmt.runner.model import HFModel
from exl2fmt.runner.weights import WeightSource
d = Path(sys.argv[1]); rows = [0, 13]
ids = torch.from_numpy(np.load(d.parent / "cal.npy")[rows])
torch.manual_seed(0)
m = AutoModelForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32).eval()
outs, mids = [], []
for L in m.model.layers:
    L.register_forward_hook(lambda mod, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach().clone()))
    nm = getattr(L, "pre_feedforward_layernorm", None) or getattr(L, "post_attention_layernorm")
    nm.register_forward_pre_hook(lambda mod, a: mids.append(a[0].detach().clone()))
emb = []
m.model.layers[0].register_forward_pre_hook(lambda mod, a, kw: emb.append((a[0] if a else kw["hidden_states"]).clone()), with_kwargs=True)
with torch.no_grad():
    lg = m(ids).logits
mo = open_model(d); spec = HFModel(mo.config, WeightSource(mo), "cpu", split_fused=True)
print("mid_norm", spec.structure.mid_norm, "attn", spec.structure.attn_child, "mlp", spec.structure.mlp_child)
h = spec.embed(ids)
def rel(a, b): return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())
print("embed max rel", rel(h, emb[0]))
for i in range(spec.num_layers):
    r = spec.runner(i)
    mid = r.forward(h, stop_mid=True)
    h2 = r.forward(h)
    print(f"layer {i:2d} mid rel {rel(mid, mids[i]):.2e}  out rel {rel(h2, outs[i]):.2e}  |h| med {float(outs[i].norm(dim=-1).median()):.1f}")
    h = outs[i]  # teacher-forced: next layer from HF's state
spec.release()
print("logits max abs diff", float((spec.logits(outs[-1]) - lg).abs().max()))
