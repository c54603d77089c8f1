"""exl2fmt's FP16 -> GGUF converter against llama.cpp's convert_hf_to_gguf.py: wall time and peak RSS (issue 15).

    flock /work/heavy.lock nice -n 5 python bench/gguf_stream.py --llama-cpp DIR --python PY [--rounds 2]

Model: a 307M-parameter Llama (TinyLlama's shape with 4 layers: hidden 2048, 32 heads / 4 KV heads,
intermediate 5632, vocab 32000, untied lm_head), F16 weights from a seeded NumPy generator, the SentencePiece
tokenizer of ``tests/tiny_hf`` (320 pieces; both converters pad the vocabulary to 32000).  Both converters write
``--outtype f16`` / ``--gguf-type f16`` to the same disk; ours includes its verify pass (re-read, checksum of
every tensor).  Each run is measured by ``/usr/bin/time`` (wall clock and the command's own peak RSS); the
runs alternate, the page cache is warm for both (one untimed warm-up read).
Targets: our peak RSS <= 0.5x llama.cpp's and our wall time <= 1x.  Also checks that the two files hold the same
tensors bytes (tests/gguf_diff.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
       "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
       "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
       "hidden_act": "silu", "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}


def build(d: Path) -> int:
    from safetensors.numpy import save_file

    from tiny_hf import write_spm_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    H, F, V, L = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"], CFG["num_hidden_layers"]
    kv = H // CFG["num_attention_heads"] * CFG["num_key_value_heads"]
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    t = {"model.embed_tokens.weight": w(V, H), "lm_head.weight": w(V, H), "model.norm.weight": np.ones(H, np.float16)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(H, H), p + "self_attn.k_proj.weight": w(kv, H),
                  p + "self_attn.v_proj.weight": w(kv, H), p + "self_attn.o_proj.weight": w(H, H),
                  p + "mlp.gate_proj.weight": w(F, H), p + "mlp.up_proj.weight": w(F, H),
                  p + "mlp.down_proj.weight": w(H, F), p + "input_layernorm.weight": np.ones(H, np.float16),
                  p + "post_attention_layernorm.weight": np.ones(H, np.float16)})
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(CFG, indent=2))
    write_spm_tokenizer(d)
    return sum(a.size for a in t.values())


def measure(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``cmd`` under ``/usr/bin/time -f '%e %M'`` (a small process that
    execs the command, so the peak is the command's own, not this script's memory inherited at fork)."""
    r = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", *cmd], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    line = [x for x in r.stderr.splitlines() if x.startswith("TIME ")]
    if r.returncode != 0 or not line:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    _, wall, kb = line[-1].split()
    return float(wall), int(kb) * 1024


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--build"]:
        print(build(Path(argv[1])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path)
    ap.add_argument("--python", required=True, help="interpreter for llama.cpp's converter (transformers 4.57)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--results", type=Path, default=None, help="append a markdown section to this file")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as td:
        src = Path(td) / "tinyllama-4l"
        # built by a child process: this script stays small (its memory is not the converters')
        out = subprocess.run([sys.executable, __file__, "--build", str(src)], check=True, capture_output=True,
                             text=True).stdout
        n_params = int(out.split()[-1])
        subprocess.run(["cat", str(src / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)  # warm cache
        ours_out, ref_out = Path(td) / "ours.gguf", Path(td) / "ref.gguf"
        ours = [str(Path(sys.executable).parent / "exl2fmt"), "convert", str(src), str(ours_out), "--to", "gguf",
                "--gguf-type", "f16", "--force"]
        ref = [a.python, str(a.llama_cpp / "convert_hf_to_gguf.py"), str(src), "--outtype", "f16", "--outfile",
               str(ref_out)]
        rows = {"ours": [], "llama.cpp": []}
        for r in range(a.rounds):
            for name, cmd in (("llama.cpp", ref), ("ours", ours)):
                wall, rss = measure(cmd)
                rows[name].append((wall, rss))
                print(f"round {r + 1} {name:9s}: {wall:6.2f} s, peak RSS {rss / 2**20:7.1f} MiB", flush=True)
        from gguf_diff import gguf_diff

        diffs = gguf_diff(ref_out, ours_out, ignore=("general.quantized_by", "general.source.format"))
        size = ours_out.stat().st_size
    med = {k: (statistics.median(w for w, _ in v), statistics.median(m for _, m in v)) for k, v in rows.items()}
    tr, mr = med["ours"][0] / med["llama.cpp"][0], med["ours"][1] / med["llama.cpp"][1]
    print(f"median: ours {med['ours'][0]:.2f} s / {med['ours'][1] / 2**20:.0f} MiB; llama.cpp "
          f"{med['llama.cpp'][0]:.2f} s / {med['llama.cpp'][1] / 2**20:.0f} MiB; time ratio {tr:.2f} (target <= 1), "
          f"RSS ratio {mr:.2f} (target <= 0.5); files differ in {len(diffs)} places {diffs[:3]}")
    if a.results:
        lines = [f"\n## Issue 15: FP16 -> GGUF streaming vs llama.cpp's converter (2026-12-01)\n",
                 f"Command: `flock /work/heavy.lock nice -n 5 python bench/gguf_stream.py --rounds {a.rounds}` on the "
                 f"shared 2-core VM (other jobs running; wall times are noisy). Model: {n_params / 1e6:.0f}M-parameter "
                 "Llama (hidden 2048, 4 layers, 32/4 heads, intermediate 5632, vocab 32000), F16 -> GGUF F16 "
                 f"({size / 1e6:.0f} MB). llama.cpp: convert_hf_to_gguf.py from llama-cpp-python 0.3.36 (vendor "
                 "commit 0c1e5709), transformers 4.57.6. Ours includes the verify pass. Peak RSS and wall from "
                 "/usr/bin/time (%M, %e).\n",
                 "| converter | runs (wall s / peak RSS MiB) | median wall | median peak RSS |",
                 "|---|---|---|---|"]
        for k, v in rows.items():
            lines.append(f"| {k} | {', '.join(f'{w:.1f} / {m / 2**20:.0f}' for w, m in v)} | {med[k][0]:.1f} s | "
                         f"{med[k][1] / 2**20:.0f} MiB |")
        lines.append(f"\nRatios ours / llama.cpp: wall **{tr:.2f}** (target <= 1: {'met' if tr <= 1 else 'NOT met'}), "
                     f"peak RSS **{mr:.2f}** (target <= 0.5: {'met' if mr <= 0.5 else 'NOT met'}). The two files "
                     f"differ only in: {diffs if diffs else 'nothing'}.\n")
        with open(a.results, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
