"""Benchmark: `exl2fmt inspect` / structural `exl2fmt validate` on a synthetic 70B-shaped EXL2 model, and the
read speed of `exl2fmt validate --deep` against `cat FILE > /dev/null`.

    .venv/bin/python bench/bench_inspect.py [--keep DIR] [--no-results] [--deep-mb 300]

1. Builds a Llama-70B-shaped EXL2 model in a temporary directory: 80 decoder blocks x 7 linears + lm_head
   (hidden 8192, intermediate 28672, 64 heads / 8 KV heads, vocab 128256), upstream-style mixed plans, 8 shards
   plus model.safetensors.index.json and config.json.  Headers carry the real shapes; the files are extended
   with truncate() so the big tensors are holes (nothing reads them).  The q_groups vectors are real, valid
   int16 data (the header-only path reads them), and so are the norms and q_scale_max.
2. Times `exl2fmt inspect DIR` (human output with the 561-row layer table), `exl2fmt inspect DIR --json`
   and `exl2fmt validate DIR` as subprocesses (wall clock, median of 5 after one warm-up run), and checks
   that the CLI process imports neither torch nor triton nor numba (`-X importtime`).
3. Writes one real (non-sparse) shard of about --deep-mb MB of random, valid EXL2 layers and compares
   `cat FILE > /dev/null` with `exl2fmt validate --deep FILE`, both from a warm page cache and after evicting
   the file from it (posix_fadvise DONTNEED), as a speed ratio (cat time / validate time): whole process,
   and in-process library time (no interpreter start-up, no Numba cache load).
4. Appends a section "## inspect / validate" to bench/RESULTS.md (replacing an earlier one of that name,
   leaving every other section alone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exl2fmt.groups import encode_q_groups  # noqa: E402
from exl2fmt.layout import LAYOUTS, Exl2Geometry, Format, Tier, pad32, plan_rows  # noqa: E402

EXE = [sys.executable, "-m", "exl2fmt.cli.app"]

CONFIG_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "exl2", "version": "0.3.2", "bits": 4.0, "head_bits": 6,
                            "calibration": {"rows": 115, "length": 2048, "dataset": "(default)"}},
}


def T(*parts):
    return [Tier(p, b, g) for p, b, g in parts]


PLANS = {  # upstream-preset-like rows (exl2-format.md §5.3)
    "self_attn.q_proj": T((0.1, 5, 32), (0.9, 4, 128)),
    "self_attn.k_proj": T((0.1, 5, 32), (0.9, 4, 128)),
    "self_attn.v_proj": T((0.1, 6, 32), (0.9, 5, 128)),
    "self_attn.o_proj": T((0.1, 5, 32), (0.9, 4, 128)),
    "mlp.gate_proj": T((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128)),
    "mlp.up_proj": T((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128)),
    "mlp.down_proj": T((0.05, 8, 32), (0.95, 4, 128)),
}
HEAD_PLAN = T((0.15, 8, 128), (0.85, 6, 128))


def _shapes(cfg):
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}


_ITEM = {"I32": 4, "I16": 2, "F16": 2}


def exl2_entries(key, K, N, tiers):
    """name -> (dtype, shape, data bytes or None for a hole) for one EXL2 layer, via the layout table."""
    bits_rows = plan_rows(K, tiers)
    G = len(bits_rows)
    Q = sum(r * b for b, r in bits_rows) // 32
    geom = Exl2Geometry(K=K, N_pad=pad32(N), G=G, Q=Q)
    data = {"q_groups": encode_q_groups(bits_rows).tobytes(),
            "q_scale_max": np.full(G, 0.01, dtype=np.float16).tobytes()}
    out = {}
    for s in LAYOUTS[Format.EXL2]:
        if s.status.value != "required":
            continue
        out[f"{key}.{s.name}"] = (s.write_dtype, tuple(s.shape(geom)), data.get(s.name))
    return out


def build_70b(d: Path, n_shards: int = 8) -> dict:
    cfg = CONFIG_70B
    h = cfg["hidden_size"]
    ents: dict[str, tuple] = {}
    ents["model.embed_tokens.weight"] = ("F16", (cfg["vocab_size"], h), None)
    norm = np.ones(h, dtype=np.float16).tobytes()
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        ents[p + "input_layernorm.weight"] = ("F16", (h,), norm)
        ents[p + "post_attention_layernorm.weight"] = ("F16", (h,), norm)
        for name, (K, N) in _shapes(cfg).items():
            ents.update(exl2_entries(p + name, K, N, PLANS[name]))
    ents["model.norm.weight"] = ("F16", (h,), norm)
    ents.update(exl2_entries("lm_head", h, cfg["vocab_size"], HEAD_PLAN))

    names = sorted(ents)
    sizes = {n: int(np.prod(ents[n][1], dtype=np.int64)) * _ITEM[ents[n][0]] for n in names}
    total = sum(sizes.values())
    target = total / n_shards
    shards: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if shards[-1] and acc + sizes[n] > target * len(shards) and len(shards) < n_shards:
            shards.append([])
        shards[-1].append(n)
        acc += sizes[n]
    weight_map = {}
    for si, members in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        header = {"__metadata__": {"format": "pt"}}
        off = 0
        for n in members:
            dt, shape, _ = ents[n]
            header[n] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + sizes[n]]}
            off += sizes[n]
            weight_map[n] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        start = 8 + len(hb)
        with open(d / fname, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for n in members:
                raw = ents[n][2]
                if raw is not None:
                    f.seek(start + header[n]["data_offsets"][0])
                    f.write(raw)
            f.truncate(start + off)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    # quantization_config.bits = the measured decoder bpw (the optimizer fills its budget), so validate is clean
    dec = [n for n in names if n.startswith("model.layers.") and ".q_" in n]
    numel = 0
    for n in dec:
        if n.endswith(".q_invperm"):
            K = ents[n][1][0]
            numel += K * ents[n[: -len("q_invperm")] + "q_weight"][1][1]
    cfg = json.loads(json.dumps(cfg))
    cfg["quantization_config"]["bits"] = round(sum(sizes[n] for n in dec) * 8 / numel, 2)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"tensors": len(names), "shards": len(shards), "logical_bytes": total,
            "disk_bytes": sum(os.stat(d / f).st_blocks * 512 for f in set(weight_map.values()))}


# Child processes get bytecode caching like an installed package (pip compiles .pyc files at install): with
# PYTHONDONTWRITEBYTECODE set, every run would recompile exl2fmt's sources and time the compiler.
_PYC = tempfile.mkdtemp(prefix="exl2fmt-bench-pyc-")
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
CHILD_ENV["PYTHONPYCACHEPREFIX"] = _PYC

# The floor of issue 18: a bare Python process that opens the same shards, reads each 8-byte length and JSON
# header and parses it (what any safetensors reader must do, with no checks, no tool and no output).
BARE_FLOOR = r"""
import json, os, struct, sys
d = sys.argv[1]
n = 0
for f in sorted(os.listdir(d)):
    if f.endswith(".safetensors"):
        with open(os.path.join(d, f), "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            n += len(json.loads(fh.read(size)))
print(n)
"""


def run(cmd, cwd=None, **kw):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(cwd or ROOT), env=CHILD_ENV,
                       **kw)
    return time.perf_counter() - t0, p


def interleaved(cmds: dict, reps: int = 7, cwd=None) -> dict:
    """{name: (median s, min s, last CompletedProcess)}: one warm-up each, then ``reps`` rounds, the commands
    interleaved within each round (so load changes hit them alike)."""
    last = {k: run(c, cwd=cwd)[1] for k, c in cmds.items()}
    times = {k: [] for k in cmds}
    for _ in range(reps):
        for k, c in cmds.items():
            t, last[k] = run(c, cwd=cwd)
            times[k].append(t)
    return {k: (statistics.median(v), min(v), last[k]) for k, v in times.items()}


def timed(cmd, reps=5):
    run(cmd)  # warm-up (bytecode, page cache of the headers)
    times = []
    last = None
    for _ in range(reps):
        t, last = run(cmd)
        times.append(t)
    return statistics.median(times), min(times), last


def heavy_imports(cmd_args):
    _, p = run([sys.executable, "-X", "importtime", "-m", "exl2fmt.cli.app", *cmd_args])
    mods = set()
    for line in p.stderr.decode(errors="replace").splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", line)
        if m:
            mods.add(m.group(1).split(".")[0])
    return sorted(mods & {"torch", "triton", "numba"})


# ------------------------------------------------------------------------------------------------ deep


def build_real_shard(d: Path, target_mb: int) -> Path:
    """Random but valid EXL2 layers (K=4096, N=14336, mixed 8/4/3-bit) in one non-sparse file."""
    from exl2fmt.container import write_safetensors
    from exl2fmt.formats.exl2 import exl2_tensors

    rng = np.random.default_rng(0)
    K, N = 4096, 14336
    tiers = T((0.05, 8, 32), (0.1, 4, 128), (0.85, 3, 128))
    bits_rows = plan_rows(K, tiers)
    tensors = {}
    i = 0
    size = 0
    while size < target_mb * 1e6:
        codes = np.empty((K, N), dtype=np.uint8)
        r0 = 0
        for b, r in bits_rows:
            codes[r0:r0 + r] = rng.integers(0, 1 << b, size=(r, N), dtype=np.uint8)
            r0 += r
        sc = rng.integers(0, 16, size=(len(bits_rows), N), dtype=np.uint8)
        qsm = (rng.random(len(bits_rows)) * 0.02 + 0.001).astype(np.float16)
        inv = rng.permutation(K).astype(np.int32)
        for slot, arr in exl2_tensors(codes, sc, qsm, bits_rows, inv).items():
            tensors[f"model.layers.{i}.mlp.up_proj.{slot}"] = arr
            size += arr.nbytes
        i += 1
    path = d / "real.safetensors"
    write_safetensors(path, tensors)
    return path


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def deep_bench(d: Path, target_mb: int) -> dict:
    from exl2fmt.validate import validate_model

    path = build_real_shard(d, target_mb)
    nbytes = path.stat().st_size
    cat = ["sh", "-c", f"cat '{path}' > /dev/null"]
    deep = [*EXE, "validate", "--deep", str(path)]
    run(deep)  # compile / load the Numba cache once
    res = {"file_bytes": nbytes}
    for mode in ("warm", "cold"):
        tc, tv, tl = [], [], []
        for _ in range(3):
            if mode == "cold":
                evict(path)
            else:
                run(cat)
            tc.append(run(cat)[0])
            if mode == "cold":
                evict(path)
            else:
                run(cat)
            t, p = run(deep)
            if p.returncode != 0:
                raise SystemExit(f"validate --deep failed:\n{p.stdout.decode()}\n{p.stderr.decode()}")
            tv.append(t)
            if mode == "cold":
                evict(path)
            t0 = time.perf_counter()
            rep = validate_model(path, deep=True)
            tl.append(time.perf_counter() - t0)
            assert not rep.failed
        res[mode] = {"cat_s": statistics.median(tc), "validate_s": statistics.median(tv),
                     "library_s": statistics.median(tl)}
        res[mode]["ratio_process"] = res[mode]["cat_s"] / res[mode]["validate_s"]
        res[mode]["ratio_library"] = res[mode]["cat_s"] / res[mode]["library_s"]
    # where the time goes (warm cache): the fused decode -> statistics kernel --deep runs per layer, next to the
    # older route (materialize the fp16 nn.Linear weight, then a statistics pass over it)
    from exl2fmt.container import open_model
    from exl2fmt.model import load_layer
    from exl2fmt.validate import weight_stats

    model = open_model(path)
    keys = sorted({n.rsplit(".", 1)[0] for n in model.names()})
    t_fused = t_dec = t_st = 0.0
    out_bytes = 0
    for k in keys:
        layer = load_layer(model, k)
        t0 = time.perf_counter()
        layer.stats()
        t1 = time.perf_counter()
        w = layer.dequantize()
        t2 = time.perf_counter()
        weight_stats(w)
        t_st += time.perf_counter() - t2
        t_dec += t2 - t1
        t_fused += t1 - t0
        out_bytes += w.nbytes
    model.close()
    res["breakdown"] = {"layers": len(keys), "fused_s": t_fused, "dequantize_s": t_dec, "stats_s": t_st,
                        "fp16_bytes": out_bytes}
    return res


# ------------------------------------------------------------------------------------------------ report


def write_results(text: str) -> None:
    p = ROOT / "bench" / "RESULTS.md"
    old = p.read_text() if p.exists() else "# Benchmark results\n"
    # replace an earlier "## inspect / validate" section (up to the next "## " heading), keep the rest
    pat = re.compile(r"^## inspect / validate\n.*?(?=^## |\Z)", re.S | re.M)
    if pat.search(old):
        new = pat.sub(lambda _: text, old)
    else:
        new = old.rstrip("\n") + "\n\n" + text
    tmp = p.with_name(".RESULTS.md.tmp")
    tmp.write_text(new)
    os.replace(tmp, p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", help="build the models in this directory and keep them")
    ap.add_argument("--no-results", action="store_true", help="do not touch bench/RESULTS.md")
    ap.add_argument("--deep-mb", type=int, default=300, help="size of the real shard for the --deep test")
    ap.add_argument("--skip-deep", action="store_true", help="only the 70B-shaped inspect/validate timings")
    ap.add_argument("--reps", type=int, default=7, help="rounds of the interleaved inspect timings")
    ap.add_argument("--compare-python", metavar="PY", help="also time the commands with this interpreter (e.g. a "
                    "venv holding the tree before a change), interleaved, and compare their stdout")
    args = ap.parse_args()

    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="exl2fmt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        load0 = os.getloadavg()[0]
        d70 = base / "synthetic-70b"
        if d70.exists():
            shutil.rmtree(d70)
        d70.mkdir()
        t0 = time.perf_counter()
        info = build_70b(d70)
        t_build = time.perf_counter() - t0
        print(f"built {info['tensors']} tensors in {info['shards']} shards: {info['logical_bytes'] / 1e9:.1f} GB "
              f"logical, {info['disk_bytes'] / 1e6:.1f} MB on disk ({t_build:.1f} s)")

        # issue 18: inspect against the bare floor, side by side (and against --compare-python, e.g. the tree before
        # the change, in the same rounds); run from a neutral directory so each interpreter finds its own exl2fmt
        cmds = {"bare": [sys.executable, "-c", BARE_FLOOR, str(d70)],
                "json": [*EXE, "inspect", str(d70), "--json"], "human": [*EXE, "inspect", str(d70)],
                "validate": [*EXE, "validate", str(d70)]}
        if args.compare_python:
            for k in ("json", "human", "validate"):
                cmds["before " + k] = [args.compare_python, *cmds[k][1:]]
        floor = interleaved(cmds, reps=args.reps, cwd=tempfile.gettempdir())
        for k, r in floor.items():
            if r[2].returncode != 0:
                raise SystemExit(f"{k} failed: {r[2].stderr.decode()[-2000:]}")
        if args.compare_python:
            same = {k: floor[k][2].stdout == floor["before " + k][2].stdout for k in ("json", "human", "validate")}
        r_inspect, r_json, r_validate = floor["human"], floor["json"], floor["validate"]
        for name, r in (("inspect", r_inspect), ("inspect --json", r_json), ("validate", r_validate)):
            print(f"{name:16s} median {r[0]:.3f} s  min {r[1]:.3f} s  exit {r[2].returncode}")
        rep = json.loads(r_json[2].stdout)
        vrep = subprocess.run([*EXE, "validate", str(d70), "--json"], stdout=subprocess.PIPE, cwd=str(ROOT))
        vdoc = json.loads(vrep.stdout)
        heavy = {tuple(c): heavy_imports(c) for c in (["inspect", str(d70), "--json"], ["validate", str(d70)],
                                                        ["--help"])}
        print("heavy imports:", heavy)
        t_help = timed([*EXE, "--help"])

        b = floor["bare"]
        lines = ["| command | median | min | median / bare median | min / bare min | target |",
                 "|---|---:|---:|---:|---:|---:|"]
        labels = {"bare": "bare floor: `python -c` reading + json-parsing the 8 headers",
                  "json": "`exl2fmt inspect DIR --json`", "human": "`exl2fmt inspect DIR` (561-row table)",
                  "validate": "`exl2fmt validate DIR` (structural)"}
        for k, r in floor.items():
            name = labels.get(k) or f"before: {labels[k.split(' ', 1)[1]]}"
            tgt = "<= 5x" if k in ("json", "human") else ""
            lines.append(f"| {name} | {r[0] * 1e3:.0f} ms | {r[1] * 1e3:.0f} ms | {r[0] / b[0]:.2f}x | {r[1] / b[1]:.2f}x "
                         f"| {tgt} |")
        floor_table = "\n".join(lines)
        print(f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} now")
        print(floor_table)
        if args.compare_python:
            print("identical stdout before/after:", same)
        if args.skip_deep:
            return
        deep = deep_bench(base, args.deep_mb)
        print(json.dumps(deep, indent=1))

        s = rep["summary"]
        cpu = platform.processor() or platform.machine()
        text = f"""## inspect / validate

`bench/bench_inspect.py` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, {cpu}, Python {platform.python_version()};
load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end: the machine was shared with other jobs).

**Synthetic 70B-shaped EXL2 model**: Llama-3-70B shapes (hidden 8192, intermediate 28672, 64/8 heads, vocab 128256),
80 blocks x 7 linears + lm_head = {s['linear_layers']} EXL2 layers, {info['tensors']} tensors in {info['shards']} shards + index,
{info['logical_bytes'] / 1e9:.1f} GB of tensor data declared, {info['disk_bytes'] / 1e6:.1f} MB actually on disk (sparse; the
q_groups vectors, norms and q_scale_max are real data). Measured: {s['parameters'] / 1e9:.2f} B logical parameters,
decoder {s['bpw']['decoder']:.3f} bpw, head {s['bpw']['head']:.3f} bpw. Wall clock of the whole CLI process, median of {args.reps} after a warm-up (interleaved with the bare floor):

| command | median | min | target | exit |
|---|---:|---:|---:|---:|
| `exl2fmt inspect DIR` (human, 561-row layer table) | {r_inspect[0]:.3f} s | {r_inspect[1]:.3f} s | <= 1.5 s | {r_inspect[2].returncode} |
| `exl2fmt inspect DIR --json` | {r_json[0]:.3f} s | {r_json[1]:.3f} s | <= 1.5 s | {r_json[2].returncode} |
| `exl2fmt validate DIR` (structural) | {r_validate[0]:.3f} s | {r_validate[1]:.3f} s | <= 1.5 s | {r_validate[2].returncode} |
| `exl2fmt --help` (start-up floor) | {t_help[0]:.3f} s | {t_help[1]:.3f} s | | {t_help[2].returncode} |

Against the bare floor (issue 18), same rounds:

{floor_table}

Structural validate result on it: {vdoc['result']} ({vdoc['counts']['pass']} passed, {vdoc['counts']['warn']} warnings,
{vdoc['counts']['fail']} failed).
"""
        imp = "; ".join(f"`exl2fmt {' '.join(a[:1])}`: {', '.join(v) or 'none'}" for a, v in heavy.items())
        text += (f"Heavy modules imported by the CLI process (`python -X importtime -m exl2fmt.cli.app ...`): {imp} "
                 "(torch and triton must never appear; numba only for --deep and dequantize).\n")
        w, c, b = deep["warm"], deep["cold"], deep["breakdown"]
        text += f"""
**`validate --deep` read speed** on one real (non-sparse) shard of {deep['file_bytes'] / 1e6:.0f} MB of random valid EXL2 layers
(K=4096, N=14336, 0.05:8b_32g/0.1:4b_128g/0.85:3b_128g): speed ratio = time of `cat FILE > /dev/null` / time of
`exl2fmt validate --deep FILE` (target >= 0.5). "process" = the whole CLI process (interpreter start-up, imports,
Numba cache load); "library" = `validate_model(path, deep=True)` in a warm process. Cold = the file evicted from the
page cache (posix_fadvise DONTNEED) before each run.

| page cache | cat | validate --deep (process) | ratio | validate_model (library) | ratio |
|---|---:|---:|---:|---:|---:|
| warm | {w['cat_s']:.3f} s | {w['validate_s']:.3f} s | {w['ratio_process']:.2f} | {w['library_s']:.3f} s | {w['ratio_library']:.2f} |
| cold | {c['cat_s']:.3f} s | {c['validate_s']:.3f} s | {c['ratio_process']:.2f} | {c['library_s']:.3f} s | {c['ratio_library']:.2f} |

Where the time goes (warm cache, in-process): the deep pass decodes every weight of the {b['layers']} layers
({b['fp16_bytes'] / 2e9:.2f} G weights from {deep['file_bytes'] / 1e6:.0f} MB stored) straight into statistics with the fused
kernel (`exl2fmt.codec.exl2_stats`, {os.cpu_count()} threads): {b['fused_s']:.3f} s, i.e. {b['fp16_bytes'] / 2 / b['fused_s'] / 1e9:.2f} G weights/s.
Materializing the fp16 weight instead would cost {b['dequantize_s']:.3f} s plus {b['stats_s']:.3f} s of statistics.
Reading runs ahead (posix_fadvise WILLNEED) while a layer decodes. Against a cold page cache the library call
keeps up with `cat` at the ratio above; the whole process adds interpreter start-up, imports and the Numba cache
load (about {w['validate_s'] - w['library_s']:.1f} s, a constant that matters on a small file and fades on a
multi-GB shard). From a warm page cache `cat` runs at memory speed, which a decoder on {os.cpu_count()} cores cannot match.

"""
        print(text)
        if not args.no_results:
            write_results(text)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
