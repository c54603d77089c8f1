"""End-to-end FP16 -> EXL2 time and peak memory, for the trained fixture and for a 1B-class model.

The 1B-class model has TinyLlama-1.1B's shapes (hidden 2048, 22 layers, 32/4 heads, MLP 5632, vocab 32000;
1.1B parameters, 2.2 GB in fp16) with random weights written straight to safetensors (no download is possible
here).  Random weights make the quality numbers meaningless but exercise exactly the same work: measurement of
every candidate of every block, the solver, the GPTQ pass and the compile/verify.

Each quantization runs in a child process so its peak RSS (``ru_maxrss``) is its own.  ``--record`` appends
the results to bench/RESULTS.md.

    python bench/bench_quant_e2e.py [--skip-1b] [--rows 16] [--length 256] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"

TINYLLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
             "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 32000,
             "torch_dtype": "float16"}


def make_1b(d: Path, layers: int | None = None) -> None:
    """Write the random 1B-class model shard by shard (one layer in memory at a time); ``layers`` keeps
    TinyLlama's shapes with fewer decoder layers (the same work per layer, the fixed costs weigh more)."""
    import numpy as np

    from exl2fmt.container import write_safetensors

    d.mkdir(parents=True)
    c = dict(TINYLLAMA, num_hidden_layers=layers or TINYLLAMA["num_hidden_layers"])
    H, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = H // c["num_attention_heads"] * c["num_key_value_heads"]
    rng = np.random.default_rng(0)

    def w(n, k):
        return (rng.standard_normal((n, k), dtype=np.float32) * (1 / np.sqrt(k))).astype(np.float16)

    weight_map = {}
    write_safetensors(d / "model-embed.safetensors", {"model.embed_tokens.weight": w(V, H),
                                                       "lm_head.weight": w(V, H),
                                                       "model.norm.weight": np.ones(H, np.float16)})
    weight_map.update({n: "model-embed.safetensors" for n in ("model.embed_tokens.weight", "lm_head.weight",
                                                               "model.norm.weight")})
    for i in range(L):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": np.ones(H, np.float16),
             f"{p}.post_attention_layernorm.weight": np.ones(H, np.float16),
             f"{p}.self_attn.q_proj.weight": w(H, H), f"{p}.self_attn.k_proj.weight": w(kv, H),
             f"{p}.self_attn.v_proj.weight": w(kv, H), f"{p}.self_attn.o_proj.weight": w(H, H),
             f"{p}.mlp.gate_proj.weight": w(I, H), f"{p}.mlp.up_proj.weight": w(I, H),
             f"{p}.mlp.down_proj.weight": w(H, I)}
        name = f"model-{i:02d}.safetensors"
        write_safetensors(d / name, t)
        weight_map.update({n: name for n in t})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(c, indent=2))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(src: str, dst: str, bits: float, rows: int, length: int, ids: str | None) -> None:
    import threading

    from exl2fmt.cli.app import set_runtime_env

    set_runtime_env(["convert", src, dst, "--to", "exl2"])   # what that exl2fmt command sets before torch loads
    from exl2fmt.converters import validate_quantized_output
    from exl2fmt.quant.options import QuantOptions
    from exl2fmt.quant.pipeline import quantize_model

    phase, peaks = ["setup"], {}
    base = _rss_kb()

    def sample():                       # resident set per phase, sampled every 20 ms
        while True:
            p = phase[0]
            peaks[p] = max(peaks.get(p, 0), _rss_kb())
            time.sleep(0.02)

    def progress(ph, done, total, what):
        phase[0] = ph

    threading.Thread(target=sample, daemon=True).start()
    t = time.monotonic()
    rep = quantize_model(src, dst, QuantOptions(target="exl2", bits=bits, rows=rows, length=length, device="cpu",
                                                calibration=ids), progress=progress,
                         verify_output=validate_quantized_output)
    time.sleep(0.05)
    print(json.dumps({"seconds": rep.seconds, "wall": time.monotonic() - t, "bpw": rep.decoder_bpw,
                      "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "base_kb": base,
                      "phase_peak_kb": peaks}))


def run_child(src, dst, bits, rows, length, ids=None) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", str(src), str(dst), str(bits), str(rows), str(length),
                        ids or ""], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr[-4000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def _describe(r: dict) -> str:
    peaks = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in r["phase_peak_kb"].items())
    return (f"{r['wall'] / 60:.1f} min ({', '.join(f'{k} {v:.0f} s' for k, v in r['seconds'].items())}), "
            f"peak RSS {r['maxrss_kb'] / 1e6:.2f} GB (process after imports {r['base_kb'] / 1e6:.2f} GB; peak by "
            f"phase, GB: {peaks})")


def _floor(c: dict, rows: int, length: int) -> str:
    """The issue's memory yardstick for one decoder layer: its weights in float32, the calibration hidden
    states, the MLP's widest activation batch and the Hessians of its linear layers."""
    H, I = c["hidden_size"], c["intermediate_size"]
    kv = H // c["num_attention_heads"] * c["num_key_value_heads"]
    weights = 4 * (2 * H * H + 2 * H * kv + 3 * H * I)
    acts = 4 * rows * length * H * 3 + 4 * min(rows * length, 8192) * I * 2
    hess = 4 * (2 * H * H + I * I)
    return (f"one layer's float32 weights {weights / 1e9:.2f} GB + calibration activations {acts / 1e9:.2f} GB + "
            f"Hessians {hess / 1e9:.2f} GB = {(weights + acts + hess) / 1e9:.2f} GB above the process itself")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        s, d, b, r, n, ids = sys.argv[2:8]
        child(s, d, float(b), int(r), int(n), ids or None)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    lines = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        r = run_child(FIXTURE, tmp / "fx", 4.0, 32, 512)
        lines.append(f"- fixture (4.2M params, 4 layers), 4.0 bpw, calibration 32 x 512 (CPU defaults): "
                     + _describe(r))
        print(lines[-1], flush=True)
        if not a.skip_1b:
            t = time.monotonic()
            make_1b(tmp / "1b")
            import numpy as np

            ids = tmp / "ids.npy"
            np.save(ids, np.random.default_rng(0).integers(0, 32000, (a.rows, a.length)))
            print(f"wrote the 1B-class model in {time.monotonic() - t:.0f} s", flush=True)
            r = run_child(tmp / "1b", tmp / "1b-exl2", 4.0, a.rows, a.length, str(ids))
            lines.append(f"- 1B-class (TinyLlama-1.1B shapes, random weights, 2.2 GB fp16), 4.0 bpw, calibration "
                         f"{a.rows} x {a.length}: decoder {r['bpw']:.4f} bpw, " + _describe(r)
                         + "; " + _floor(TINYLLAMA, a.rows, a.length))
            print(lines[-1], flush=True)
    if a.record:
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(f"\n### End-to-end FP16 -> EXL2 on the CPU ({datetime.date.today()}, {platform.machine()}, "
                    f"{os.cpu_count()} cores)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
