"""Benchmark: the Triton EXL2 kernels (exl2fmt.kernels) on a GPU against torch fp16 matmul.

    .venv/bin/python bench/kernel.py                 # GPU run, markdown to stdout (about 4-8 minutes on one H200)
    .venv/bin/python bench/kernel.py --write         # ... and append it to bench/RESULTS.md, "## Triton kernel (GPU)"
    .venv/bin/python bench/kernel.py --smoke         # CPU: Triton interpreter, one tiny shape, end to end check
    .venv/bin/python bench/kernel.py --compile-only  # no GPU needed: compile every kernel variant for sm_90

GPU run
-------
* Layers (K, N) in {(4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)}; plans at about 2.5 / 4.0 / 6.0 bpw
  built with ``exl2fmt.layout.plan_rows`` (mixed tiers, as ExLlamaV2 presets do); q_weight / q_scale are random
  int32 words (every bit pattern decodes to valid codes of any width), q_scale_max = 0.01, a random act-order
  permutation.  x [M, K] fp16 for M in {1, 4, 16, 64, 256}.
* L2 is defeated by rotating over R copies of every operand (layer tensors, x, fp16 weights) with R copies
  >= 256 MiB in all (H200 L2: 50 MB).  One CUDA graph replays one call on each copy; the time per call is
  graph time / R, median of 7 replays (no Python or launch overhead in it; ``eager`` repeats that without a graph).
* Effective GB/s = (stored bytes of the layer at its bpw + x + y bytes) / time; "% copy" relates it to the
  device copy bandwidth measured here (torch ``copy_`` of a 1 GiB buffer, read + write bytes).
* Compared with torch fp16 ``x @ W`` (W [K, N] fp16) and with dequantize + matmul (our Triton dequantize into a
  [K, N] fp16 W, then ``torch.matmul``).  For each M the plausible kernel paths are timed (gemv / dot for small
  M, dot / dense for large M); "auto" is what ``exl2_matmul`` picks.  "err" is the max relative difference
  between the auto path and dequantize + matmul (sanity at full size).
* Then GPTQ 4-bit g128 act-order through ``kt.gptq_matmul`` (fused and dense) on the same shapes, while the
  budget lasts (not a target of issue 6; a comparison point).
* ``--budget-s`` (default 420) stops starting new configurations when the run gets near the lease.

Targets (issue 6): M = 1 at 4.0 bpw on the large shapes >= 70 % of copy bandwidth; M = 16 >= 2.5x fp16 matmul;
M >= 64 never slower than dequantize + matmul.  The summary at the end says PASS / FAIL for each.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exl2fmt.groups import encode_q_groups, group_table_from_rows  # noqa: E402
from exl2fmt.layout import Exl2Geometry, Format, Tier, bpw, pad32, plan_rows  # noqa: E402

SHAPES = [(4096, 14336), (14336, 4096), (8192, 28672), (28672, 8192)]
MS = [1, 4, 16, 64, 256]
#: Plans named by their target bpw (the actual bpw, overhead included, is printed).
PLANS = {
    "2.5": [Tier(0.05, 4, 128), Tier(0.35, 3, 128), Tier(0.6, 2, 128)],
    "4.0": [Tier(0.05, 5, 32), Tier(0.85, 4, 128), Tier(0.1, 3, 128)],
    "6.0": [Tier(0.05, 8, 32), Tier(0.85, 6, 128), Tier(0.1, 5, 128)],
}
ROTATE_BYTES = 256 << 20
SECTION = "## Triton kernel (GPU)"


def paths_for(M: int) -> list[str]:
    return ["gemv", "dot"] if M <= 16 else ["dot", "dense"]


# ------------------------------------------------------------------------------------------------ layers


def make_layer(torch, K: int, N: int, tiers, device, seed: int) -> dict:
    """Random EXL2 tensors of one layer on ``device`` (plan from plan_rows, random words)."""
    bits_rows = plan_rows(K, tiers)
    gt = group_table_from_rows(bits_rows)
    n_pad = pad32(N)
    g = torch.Generator(device="cpu").manual_seed(seed)
    qw = torch.randint(-2**31, 2**31 - 1, (gt.Q, n_pad), dtype=torch.int32, generator=g).to(device)
    qs = torch.randint(-2**31, 2**31 - 1, (gt.G, n_pad // 8), dtype=torch.int32, generator=g).to(device)
    qsm = torch.full((gt.G,), 0.01, dtype=torch.float16, device=device)
    inv = np.random.default_rng(seed).permutation(K).astype(np.int32)
    geom = Exl2Geometry(K=K, N_pad=n_pad, G=gt.G, Q=gt.Q)
    b = bpw(Format.EXL2, geom, {"q_weight": "I32", "q_scale": "I32", "q_scale_max": "F16", "q_groups": "I16",
                                "q_invperm": "I32"})
    nbytes = qw.numel() * 4 + qs.numel() * 4 + qsm.numel() * 2 + 4 * gt.G + 4 * K
    return {"q_weight": qw, "q_scale": qs, "q_scale_max": qsm, "groups": gt, "q_invperm": inv,
            "q_groups": encode_q_groups(bits_rows), "bpw": b, "bytes": nbytes, "N": N, "K": K}


# ------------------------------------------------------------------------------------------------ timing


class Timer:
    """Time fn(i) for i over R rotating operand sets: CUDA graph of R calls (GPU) or a plain loop (CPU)."""

    def __init__(self, torch, device, reps: int = 7):
        self.torch, self.device, self.reps = torch, device, reps
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def eager(self, fn, R: int) -> float:
        """Seconds per call, calls issued from Python back to back (launch overhead included)."""
        torch = self.torch
        for i in range(R):
            fn(i)
        self.sync()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for i in range(R):
                    fn(i)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3 / R)
            else:
                t0 = time.perf_counter()
                for i in range(R):
                    fn(i)
                times.append((time.perf_counter() - t0) / R)
        return statistics.median(times)

    def graph(self, fn, R: int) -> float:
        """Seconds per call from replays of one CUDA graph holding the R calls (GPU time only); falls back to
        eager timing (and says so on stderr) if the capture fails."""
        if not self.cuda:
            return self.eager(fn, R)
        try:
            return self._graph(fn, R)
        except Exception as e:  # keep the run going: one failed capture must not lose the lease
            print(f"    graph capture failed ({type(e).__name__}: {str(e)[:120]}); timing eagerly", file=sys.stderr)
            self.torch.cuda.synchronize()
            return self.eager(fn, R)

    def _graph(self, fn, R: int) -> float:
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a side stream (compiles, allocator)
            for i in range(R):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for i in range(R):
                fn(i)
        gr.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            gr.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / R)
        del gr
        return statistics.median(times)


def copy_bandwidth(torch, device) -> float:
    """Device copy bandwidth in bytes/s (read + write) of a 1 GiB (GPU) / 64 MiB (CPU) buffer."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = Timer(torch, device, reps=9).eager(lambda i: dst.copy_(src), 4)
    del src, dst
    return 2 * n / t


# ------------------------------------------------------------------------------------------------ run


def run(args) -> str:
    import torch

    from exl2fmt.kernels import load_triton

    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke (CPU interpreter) or --compile-only")
    kt = load_triton(device.type)
    timer = Timer(torch, device, reps=3 if args.smoke else 7)
    t_start = time.perf_counter()

    shapes = [(256, 192)] if args.smoke else SHAPES
    ms = [1, 16] if args.smoke else MS
    plans = {"4.0": PLANS["4.0"]} if args.smoke else PLANS
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU interpreter ({platform.machine()})"
    bw = copy_bandwidth(torch, device)
    lines = []
    date = _dt.date.today().isoformat()
    lines.append(f"### {card}, {date}" + (" (smoke: CPU interpreter, not a performance number)" if args.smoke else ""))
    lines.append("")
    lines.append(f"`bench/kernel.py{' --smoke' if args.smoke else ''}`: torch {torch.__version__}, triton "
                 f"{__import__('triton').__version__}, measured copy bandwidth {bw / 1e9:.0f} GB/s"
                 + (f", {torch.cuda.get_device_properties(device).multi_processor_count} SMs" if timer.cuda else "")
                 + ". Times per call in µs (CUDA graph of rotating operand copies, median of 7); GB/s = stored "
                   "layer bytes + x + y over time; % = of the copy bandwidth; × = speed-up over torch fp16 x @ W "
                   "and over dequantize + matmul; err = max |y - y_dense| / max |y_dense|.")
    lines.append("")
    results = []
    fp16_all: dict = {}
    stopped = None
    for (K, N) in shapes:
        # fp16 reference weights, rotated
        w_bytes = K * N * 2
        Rw = max(2, math.ceil(ROTATE_BYTES / w_bytes)) if timer.cuda else 1
        g = torch.Generator(device="cpu").manual_seed(K + N)
        Ws = [(torch.randn(K, N, generator=g) * 0.02).half().to(device) for _ in range(Rw)]
        fp16_t = {}
        for M in ms:
            xs = [torch.randn(M, K, generator=g).half().to(device) for _ in range(Rw)]
            fp16_t[M] = timer.graph(lambda i: torch.matmul(xs[i % Rw], Ws[i % Rw]), Rw)
            fp16_all[(K, N, M)] = fp16_t[M]
        del Ws
        for pname, tiers in plans.items():
            if time.perf_counter() - t_start > args.budget_s:
                stopped = f"stopped at {K}x{N} {pname} bpw: budget of {args.budget_s:.0f} s reached"
                break
            base = make_layer(torch, K, N, tiers, device, seed=K * 7 + N)
            tables = kt.build_tables(base["groups"], base["q_invperm"], device)
            R = max(2, math.ceil(ROTATE_BYTES / base["bytes"])) if timer.cuda else 1
            copies = [base] + [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in base.items()}
                               for _ in range(R - 1)]

            def ours(i, x, path=None):
                c = copies[i % R]
                return kt.exl2_matmul(x, c["q_weight"], c["q_scale"], c["q_scale_max"], out_features=N,
                                      tables=tables, path=path)

            def deq_mm(i, x):
                c = copies[i % R]
                w = kt.exl2_dequantize(c["q_weight"], c["q_scale"], c["q_scale_max"], tables=tables,
                                       out_features=N, unpermute=True)
                return torch.matmul(x, w)

            for M in ms:
                xs = [torch.randn(M, K, generator=g).half().to(device) for _ in range(R)]
                auto = kt.choose_path(M)
                times = {}
                for p in paths_for(M):
                    times[p] = timer.graph(lambda i, p=p: ours(i, xs[i], p), R)
                if auto not in times:
                    times[auto] = timer.graph(lambda i: ours(i, xs[i], auto), R)
                t_auto = times[auto]
                t_eager = timer.eager(lambda i: ours(i, xs[i]), R)
                t_dm = timer.graph(lambda i: deq_mm(i, xs[i]), R)
                y = ours(0, xs[0]).float()
                yd = deq_mm(0, xs[0]).float()
                err = float((y - yd).abs().max() / yd.abs().max().clamp_min(1e-30))
                moved = base["bytes"] + M * K * 2 + M * N * 2
                gbs = moved / t_auto
                results.append(dict(K=K, N=N, plan=pname, bpw=base["bpw"], M=M, path=auto, t=t_auto, eager=t_eager,
                                    times=times, gbs=gbs, pct=gbs / bw, fp16=fp16_t[M], dm=t_dm, err=err))
                r = results[-1]
                print(f"  {K}x{N} {pname}bpw M={M}: {auto} {t_auto * 1e6:.1f} us, {gbs / 1e9:.0f} GB/s "
                      f"({100 * r['pct']:.0f}% copy), x{fp16_t[M] / t_auto:.2f} fp16, x{t_dm / t_auto:.2f} deq+mm, "
                      f"err {err:.1e}  [{time.perf_counter() - t_start:.0f} s]", file=sys.stderr)
            del copies, base
            if timer.cuda:
                torch.cuda.empty_cache()
        if stopped:
            break

    for (K, N) in shapes:
        rows = [r for r in results if (r["K"], r["N"]) == (K, N)]
        if not rows:
            continue
        lines.append(f"**K = {K}, N = {N}**")
        lines.append("")
        lines.append("| plan | bpw | M | path | µs | eager µs | GB/s | % copy | × fp16 | × deq+mm | other paths µs "
                     "| err |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            other = ", ".join(f"{p} {t * 1e6:.1f}" for p, t in r["times"].items() if p != r["path"])
            lines.append(f"| {r['plan']} | {r['bpw']:.2f} | {r['M']} | {r['path']} | {r['t'] * 1e6:.1f} | "
                         f"{r['eager'] * 1e6:.1f} | {r['gbs'] / 1e9:.0f} | {100 * r['pct']:.0f} | "
                         f"{r['fp16'] / r['t']:.2f} | {r['dm'] / r['t']:.2f} | {other} | {r['err']:.1e} |")
        lines.append("")
    lines += summary(results, args.smoke)
    if not stopped:
        lines += gptq_rows(torch, kt, timer, device, shapes, ms, fp16_all, t_start, args.budget_s)
    if stopped:
        lines += ["", f"Incomplete: {stopped}."]
    lines.append("")
    return "\n".join(lines)


def gptq_rows(torch, kt, timer, device, shapes, ms, fp16_all, t_start, budget_s) -> list[str]:
    """GPTQ 4-bit g128 act-order through the GPTQ kernels of the same family (fused and dense paths) against
    torch fp16 x @ W, on the same shapes, while the budget lasts."""
    out = ["", "GPTQ 4-bit, group size 128, act-order g_idx (`kt.gptq_matmul`): µs per call; × = over torch fp16.",
           "", "| K | N | M | fused µs | dense µs | × fp16 (fused) | err |", "|---|---|---|---|---|---|---|"]
    n = 0
    for (K, N) in shapes:
        if time.perf_counter() - t_start > budget_s:
            out.append(f"| stopped at {K}x{N}: budget reached | | | | | | |")
            break
        G = K // 128
        g = torch.Generator(device="cpu").manual_seed(K * 3 + N)
        lay = {"qw": torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, generator=g),
               "qz": torch.randint(-2**31, 2**31 - 1, (G, N // 8), dtype=torch.int32, generator=g),
               "sc": (torch.rand(G, N, generator=g) * 0.01).half(),
               "gi": torch.from_numpy(np.random.default_rng(K).permutation(np.arange(K) // 128).astype(np.int32))}
        nbytes = sum(t.numel() * t.element_size() for t in lay.values())
        R = max(2, math.ceil(ROTATE_BYTES / nbytes)) if timer.cuda else 1
        copies = [{k: v.to(device) for k, v in lay.items()} for _ in range(R)]

        def mm(i, x, path):
            c = copies[i % R]
            return kt.gptq_matmul(x, c["qw"], c["qz"], c["sc"], c["gi"], 4, path=path)

        for M in ms:
            xs = [torch.randn(M, K, generator=g).half().to(device) for _ in range(R)]
            tf = timer.graph(lambda i: mm(i, xs[i], "fused"), R)
            td = timer.graph(lambda i: mm(i, xs[i], "dense"), R)
            y, yd = mm(0, xs[0], "fused").float(), mm(0, xs[0], "dense").float()
            err = float((y - yd).abs().max() / yd.abs().max().clamp_min(1e-30))
            f16 = fp16_all.get((K, N, M))
            out.append(f"| {K} | {N} | {M} | {tf * 1e6:.1f} | {td * 1e6:.1f} | "
                       f"{'-' if f16 is None else f'{f16 / tf:.2f}'} | {err:.1e} |")
            n += 1
        del copies
        if timer.cuda:
            torch.cuda.empty_cache()
    return out if n else []


def summary(results, smoke: bool) -> list[str]:
    out = ["Targets (issue 6)" + (" — not meaningful in smoke mode" if smoke else "") + ":", ""]
    big = [r for r in results if r["plan"] == "4.0" and r["M"] == 1 and r["K"] * r["N"] >= 8192 * 28672]
    if big:
        worst = min(r["pct"] for r in big)
        pcts = ", ".join(f"{100 * r['pct']:.0f}%" for r in big)
        out.append(f"- M = 1, 4.0 bpw, large shapes: {pcts} of copy bandwidth (target >= 70%): "
                   f"{'PASS' if worst >= 0.70 else 'FAIL'}")
    m16 = [r for r in results if r["M"] == 16]
    if m16:
        worst = min(r["fp16"] / r["t"] for r in m16)
        out.append(f"- M = 16: worst speed-up over fp16 matmul {worst:.2f}x (target >= 2.5x): "
                   f"{'PASS' if worst >= 2.5 else 'FAIL'}")
    m64 = [r for r in results if r["M"] >= 64]
    if m64:
        worst = min(r["dm"] / r["t"] for r in m64)
        out.append(f"- M >= 64: worst ratio to dequantize + matmul {worst:.2f}x (target >= 1.0x): "
                   f"{'PASS' if worst >= 1.0 else 'FAIL'}")
    errs = [r["err"] for r in results]
    if errs:
        out.append(f"- max relative difference from dequantize + matmul: {max(errs):.1e}")
    return out


def write_results(text: str) -> None:
    """Append ``text`` (a "### card, date" subsection) under SECTION in bench/RESULTS.md, creating it if needed;
    other sections are left alone."""
    p = ROOT / "bench" / "RESULTS.md"
    old = p.read_text() if p.exists() else "# Benchmark results\n"
    pat = re.compile(r"^" + re.escape(SECTION) + r"\n.*?(?=^## |\Z)", re.S | re.M)
    m = pat.search(old)
    if m:
        new = old[:m.end()].rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n\n" + old[m.end():].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + SECTION + "\n\n" + text
    new = new.rstrip("\n") + "\n"
    tmp = p.with_name(".RESULTS.md.tmp")
    tmp.write_text(new)
    os.replace(tmp, p)


# ------------------------------------------------------------------------------------------------ compile only


def compile_only(arch: int) -> str:
    """Compile the kernel variants the benchmark launches for a CUDA target, without a GPU (Triton's bundled
    ptxas), and report registers / spills: catches compile errors and register blow-ups on CPU-only machines."""
    import subprocess
    import tempfile

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET for --compile-only")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from exl2fmt.kernels import exl2_jit as kj
    from exl2fmt.kernels import exl2_triton as kt

    target = GPUTarget("cuda", arch, 32)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    L = dict(kj.LAYOUT_CONSTS)
    slots = dict(kj.SLOT_WIDTHS)
    pk = {"qw_ptr": "*i32", "stride_qw": "i32", "qs_ptr": "*i32", "stride_qs": "i32", "qsm_ptr": "*fp16",
          "blk_qrow_ptr": "*i32", "blk_group_ptr": "*i32", "seg_ptr": "*i32"}
    variants = []
    # (name, kernel, signature, constexprs, num_warps, weights per thread per 32-row block)
    cases = [("gemv", 1, False), ("gemv", 4, False), ("dot", 16, False), ("dot", 16, True), ("dot", 64, False)]
    for path, M, bf16 in cases:
        use_dot = path == "dot"
        bm, bn, nw = kt.launch_config(path, M)
        xdt = ("*bf16" if bf16 else "*fp16") if use_dot else "*fp32"
        sig = {"x_ptr": xdt, "stride_xm": "i32", **pk, "bias_ptr": "*fp16", "out_ptr": "*bf16" if bf16 else "*fp16",
               "stride_om": "i32", "stride_on": "i32", "ws_ptr": "*fp32", "M": "i32", "N": "i32", "KB": "i32",
               "blocks_per_split": "i32"}
        variants.append((f"matmul {path} M={M}: BLOCK_M={bm} BLOCK_N={bn} warps={nw} "
                         f"{'bf16' if bf16 else 'fp16'}", kj.matmul_kernel, sig,
                         dict(**slots, BLOCK_M=bm, BLOCK_N=bn, ROWS=kj.BLOCK_ROWS, USE_DOT=use_dot, HAS_BIAS=True,
                              ATOMIC=True, OUT_BF16=bf16, **L), nw, kj.BLOCK_ROWS * bn / (32 * nw)))
    for name, unperm, transposed in [("dequant W^T (dense path)", False, True), ("dequant unpermuted [K, N]", True,
                                                                                 False)]:
        sig = {**pk, "perm_ptr": "*i32", "out_ptr": "*fp16", "stride_ok": "i32", "stride_on": "i32", "N_out": "i32",
               "KB": "i32"}
        unit = {"stride_ok": 1} if transposed else {"stride_on": 1}  # what Triton's specialisation on 1 gives
        _, bn, nw = kt.launch_config("dequant", 0)
        variants.append((f"{name}: BLOCK_N={bn} warps={nw}", kj.dequant_kernel, sig,
                         dict(**unit, **slots, BLOCKS_PER_PROG=4, BLOCK_N=bn, ROWS=kj.BLOCK_ROWS,
                              LOG_ROWS=kj.LOG_BLOCK_ROWS, UNPERMUTE=unperm, OUT_BF16=False, **L), nw, kj.BLOCK_ROWS * bn / (32 * nw)))
    variants.append(("prep", kj.prep_kernel, {"x_ptr": "*fp16", "stride_xm": "i32", "stride_xk": "i32",
                                               "perm_ptr": "*i32", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "K": "i32",
                                               "MK": "i32", "MN": "i32"},
                     dict(BLOCK=1024, HAS_PERM=True, ZERO_WS=True), 4, 0))
    variants.append(("finalize", kj.finalize_kernel, {"ws_ptr": "*fp32", "bias_ptr": "*fp16", "out_ptr": "*bf16",
                                                       "stride_om": "i32", "stride_on": "i32", "N": "i32",
                                                       "MN": "i32"},
                     dict(BLOCK=1024, HAS_BIAS=True, OUT_BF16=True), 4, 0))
    lines = [f"Compile check for sm_{arch} (triton {triton.__version__}, no GPU). Loop statistics: SASS instructions "
             "of each per-width block loop (widths in EXL2_BITS order) per weight handled by a thread.", ""]
    failed = 0
    for name, fn, sig, consts, nw, wpt in variants:
        sig = dict(sig)
        sig.update({k: "constexpr" for k in consts})
        t0 = time.perf_counter()
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                               options={"num_warps": nw})
        except Exception as e:  # report every variant, then fail
            failed += 1
            lines.append(f"- {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        usage, loops = "", ""
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            r = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True)
            m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", r.stdout)
            if m:
                usage = f"{m.group(1)} registers, {m.group(2)} bytes local"
            if wpt:
                sass = subprocess.run([str(bindir / "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
                loops = ", ".join(f"{n / wpt:.1f}" for n in _loop_sizes(sass))
        lines.append(f"- {name}: ok in {time.perf_counter() - t0:.1f} s; {usage}"
                     + (f"; instructions per weight per loop: {loops}" if loops else ""))
    if failed:
        lines.append(f"\n{failed} variant(s) failed to compile")
    return "\n".join(lines) + "\n"


def _loop_sizes(sass: str) -> list[int]:
    """Instruction counts of the innermost loops (a label reached by a backward branch) in nvdisasm output."""
    labels, ins = {}, []
    for line in sass.splitlines():
        m = re.match(r"^\s*\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1))
    sizes = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA.*?(L_x_\d+)", text)
        if m and labels.get(m.group(1), i + 1) <= i:
            sizes.append(i + 1 - labels[m.group(1)])
    return sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, one tiny shape (checks the script only)")
    ap.add_argument("--write", action="store_true", help=f"append the result to bench/RESULTS.md under '{SECTION}'")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting configurations after this long")
    ap.add_argument("--shapes", help="override shapes, e.g. 4096x14336,8192x28672")
    ap.add_argument("--ms", help="override M values, e.g. 1,16")
    ap.add_argument("--compile-only", nargs="?", const=90, type=int, metavar="ARCH",
                    help="compile the kernels for sm_ARCH (default 90) without a GPU and report registers")
    args = ap.parse_args()
    if args.compile_only:
        print(compile_only(args.compile_only))
        return
    if args.smoke and args.write:
        raise SystemExit("--smoke results are not performance numbers; --write is for GPU runs")
    text = run(args)
    print(text)
    if args.write:
        write_results(text)


if __name__ == "__main__":
    main()
