"""Benchmark: the Numba EXL2 codecs (``exl2fmt.codec.exl2``) on one large mixed-tier layer.

    .venv/bin/python bench/bench_codec.py [--quick] [--write] [--repeats N]

Layer: K = 11008 input features, N = 4096 outputs (Llama-7B ``down_proj``), groups from
``layout.plan_rows(K, [Tier(0.05, 8, 32), Tier(0.1, 5, 32), Tier(0.85, 4, 128)])``, random codes, scale codes
and q_scale_max, a random act-order permutation.  Output: the fp16 ``nn.Linear`` weight [4096, 11008], C order
(90 MB); q_weight is int32 [1488, 4096] (24 MB).

Measured side by side in one process, interleaved round by round: median (and min) of ``--repeats`` runs after
one warm-up run (compile / cache load excluded).  The machine may be shared, so each run waits (at most 2 s)
until no other process is runnable (Linux ``/proc/stat`` procs_running), and a one-thread run is repeated (at
most twice) when another process was runnable at its end; the load average is reported.

* ``numpy.copyto`` of an fp16 [4096, 11008] array into an existing one: the memory-bandwidth floor (NumPy, one
  thread); and ``np.empty`` + ``copyto``: the same floor for a function that returns a new array (it pays the
  page faults of a fresh 90 MB output);
* ``np.empty`` + one store per 4 KiB page: the page faults of a fresh 90 MB output alone (the OS zeroes
  every new page), which ``dequantize`` pays and ``copyto`` into an existing buffer does not;
* ``dequantize(..., out=buf)`` into an existing 64-byte-aligned buffer (issue 18: no page faults, non-temporal
  stores), and the kernel as it was before issue 18 (plain stores into a fresh ``np.empty``);
* ``dequantize`` (public; allocates its output), ``dequantize_stored``, ``pack_q_weight``,
  ``unpack_q_weight``, each with ``numba.set_num_threads(1)`` and with all cores;
* the NumPy twin ``exl2fmt.codec.oracle.dequantize`` (pure-Python unpacking loops): the full layer once, its
  output compared bit for bit with ``dequantize``; with ``--quick`` only the first 128 columns, scaled
  linearly to N (its cost is linear in N);
* Numba's on-disk cache: two fresh processes sharing one initially empty ``NUMBA_CACHE_DIR``; each reports its
  import time, its first ``dequantize`` call (a small layer, so the time is compile or cache load) and the
  dispatchers' cache hits / misses; plus the cache files written.

Targets (issue): (a) dequantize <= 3x the copyto floor; (b) >= 5x faster than the NumPy twin; (c)
pack_q_weight at least as fast as dequantize; (d) a second process does not recompile; issue 18: dequantize
<= 1.5x copyto on all cores (out= and fresh output reported separately).  ``--write`` replaces
(or appends) the section "## Format core codecs" of bench/RESULTS.md and leaves the other sections alone.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numba  # noqa: E402

from exl2fmt.codec import exl2, oracle  # noqa: E402
from exl2fmt.groups import group_table_from_rows  # noqa: E402
from exl2fmt.layout import Tier, plan_rows  # noqa: E402

SECTION = "## Format core codecs"
K, N = 11008, 4096
TIERS = (Tier(0.05, 8, 32), Tier(0.1, 5, 32), Tier(0.85, 4, 128))
PLAN_DESC = "0.05:8b_32g / 0.1:5b_32g / 0.85:4b_128g"


# ------------------------------------------------------------------------------------------------ machine


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return ", ".join(f for f in ("avx2", "avx512f", "avx512bw", "f16c", "fma") if f in flags)
    except OSError:
        pass
    return "?"


def llvm_cpu() -> str:
    try:
        from llvmlite import binding
        return binding.get_host_cpu_name()
    except Exception:  # pragma: no cover
        return "?"


def load_average() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def procs_running() -> int:
    try:
        for line in open("/proc/stat"):
            if line.startswith("procs_running"):
                return int(line.split()[1])
    except OSError:
        pass
    return 1


QUIET_WAIT_S = 2.0  # --quiet-wait


def wait_quiet(max_s: float | None = None) -> None:
    """Wait until this process is the only runnable one (shared machine), at most ``max_s`` seconds."""
    end = time.monotonic() + (QUIET_WAIT_S if max_s is None else max_s)
    while procs_running() > 1 and time.monotonic() < end:
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ layer


def make_layer(seed: int = 0):
    rng = np.random.default_rng(seed)
    bits_rows = plan_rows(K, TIERS)
    groups = group_table_from_rows(bits_rows)
    codes = np.empty((K, N), dtype=np.uint8)
    for b, r0, r in zip(groups.bits.tolist(), groups.row_start.tolist(), groups.rows.tolist()):
        codes[r0:r0 + r] = rng.integers(0, 1 << b, size=(r, N), dtype=np.uint8)
    scale_codes = rng.integers(0, 16, size=(groups.G, N), dtype=np.uint8)
    q_scale_max = rng.uniform(0.01, 2.0, size=groups.G).astype(np.float16)
    q_invperm = exl2.invert_permutation(rng.permutation(K))
    q_weight = exl2.pack_q_weight(codes, groups)
    q_scale = exl2.pack_q_scale(scale_codes)
    return dict(bits_rows=bits_rows, groups=groups, codes=codes, q_weight=q_weight, q_scale=q_scale,
                q_scale_max=q_scale_max, q_invperm=q_invperm)


# ------------------------------------------------------------------------------------------------ timing


def time_side_by_side(cases, repeats: int):
    """cases: [(key, fn, threads)]; threads None = not Numba (NumPy, one thread).

    Returns {key: (median s, min s)} of wall-clock times."""
    all_cores = numba.config.NUMBA_NUM_THREADS
    for _, fn, threads in cases:  # warm-up: compile or load from cache, touch the buffers
        numba.set_num_threads(threads or all_cores)
        fn()
    samples = {key: [] for key, _, _ in cases}
    for _ in range(repeats):
        for key, fn, threads in cases:
            numba.set_num_threads(threads or all_cores)
            for _attempt in range(3):  # one-thread runs: retry if another process woke up meanwhile
                wait_quiet()
                t = time.perf_counter()
                fn()
                t = time.perf_counter() - t
                if (threads or 1) > 1 or procs_running() <= 1 or QUIET_WAIT_S <= 0:
                    break
            samples[key].append(t)
    numba.set_num_threads(all_cores)
    return {k: (statistics.median(v), min(v)) for k, v in samples.items()}


CACHE_CHILD = r"""
import json, time
t0 = time.perf_counter()
import numpy as np
from numba.core.registry import CPUDispatcher
from exl2fmt.codec import exl2
from exl2fmt.groups import group_table_from_rows
from exl2fmt.layout import Tier, plan_rows
t1 = time.perf_counter()
K, N = 256, 64
g = group_table_from_rows(plan_rows(K, (Tier(0.05, 8, 32), Tier(0.1, 5, 32), Tier(0.85, 4, 128))))
rng = np.random.default_rng(0)
qw = rng.integers(-2**31, 2**31, size=(g.Q, N)).astype(np.int32)
qs = rng.integers(-2**31, 2**31, size=(g.G, N // 8)).astype(np.int32)
qsm = np.ones(g.G, np.float16)
inv = rng.permutation(K)
t2 = time.perf_counter()
exl2.dequantize(qw, qs, qsm, g, inv)
t3 = time.perf_counter()
hits = misses = 0
for f in vars(exl2).values():
    if isinstance(f, CPUDispatcher):
        hits += sum(f.stats.cache_hits.values())
        misses += sum(f.stats.cache_misses.values())
print(json.dumps(dict(imports=t1 - t0, first_call=t3 - t2, to_first_result=t3 - t0,
                      hits=hits, misses=misses)))
"""


def cache_check():
    """Two fresh processes, one initially empty NUMBA_CACHE_DIR: does the second one recompile?"""
    with tempfile.TemporaryDirectory(prefix="exl2fmt-numba-cache-") as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d, PYTHONPATH=str(ROOT))
        runs = []
        for _ in range(2):
            p = subprocess.run([sys.executable, "-c", CACHE_CHILD], env=env, capture_output=True, text=True,
                               check=True, cwd=ROOT)
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        files = [f for f in Path(d).rglob("*") if f.suffix in (".nbi", ".nbc")]
        return runs, len(files)


# ------------------------------------------------------------------------------------------------ report


def ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms"


def cell(r) -> str:
    return f"{ms(r[0])} ({ms(r[1])})"


def write_results(text: str) -> None:
    p = ROOT / "bench" / "RESULTS.md"
    old = p.read_text() if p.exists() else "# Benchmark results\n"
    pat = re.compile(r"^" + re.escape(SECTION) + r"\n.*?(?=^## |\Z)", re.S | re.M)
    new = pat.sub(lambda _m: text, old) if pat.search(old) else old.rstrip("\n") + "\n\n" + text
    tmp = p.with_name(".RESULTS.md.codec.tmp")
    tmp.write_text(new)
    os.replace(tmp, p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats; the NumPy twin on 128 columns, scaled")
    ap.add_argument("--repeats", type=int, help="measured runs per case (default 21, --quick 5)")
    ap.add_argument("--write", action="store_true", help=f"replace/append '{SECTION}' in bench/RESULTS.md")
    ap.add_argument("--quiet-wait", type=float, default=2.0,
                    help="seconds each run may wait for no other runnable process (0: never wait; a niced background "
                         "build keeps the machine busy for good)")
    args = ap.parse_args()
    global QUIET_WAIT_S
    QUIET_WAIT_S = args.quiet_wait
    repeats = args.repeats or (5 if args.quick else 21)
    cores = numba.config.NUMBA_NUM_THREADS
    load_start = load_average()
    date = datetime.date.today().isoformat()

    print(f"building the layer K={K}, N={N} ({PLAN_DESC}) ...", flush=True)
    L = make_layer()
    g, qw, qs, qsm, inv, codes = L["groups"], L["q_weight"], L["q_scale"], L["q_scale_max"], L["q_invperm"], L["codes"]
    src = np.random.default_rng(1).standard_normal((N, K)).astype(np.float16)
    dst = np.empty_like(src)
    dst[...] = 0  # fault the pages in once: copyto then measures the copy alone

    def fault_fresh_output():
        np.empty_like(src).reshape(-1)[::2048] = 0  # one store per 4 KiB page

    cases = [("copyto", lambda: np.copyto(dst, src), None),
             ("empty+copyto", lambda: np.copyto(np.empty_like(src), src), None),
             ("faults", fault_fresh_output, None)]
    # issue 18: dequantize into a caller's buffer (out=; 64-byte aligned like the fresh outputs, so the kernel
    # uses non-temporal stores), and the kernel as it was before (plain stores into a fresh np.empty)
    out_buf = exl2.empty_aligned((N, K)).view(np.float16)
    out_buf[...] = 0
    args_ = exl2._common_args(qw, qs, qsm, g)
    tab_ = exl2._features(args_, inv.astype(np.int64))

    def before_18():
        o = np.empty((N, K), dtype=np.uint16)
        exl2._dequant_linear(*args_[:4], tab_, N, o, False)
        return o

    for label, th in (("1", 1), ("all", cores)):
        cases += [
            (f"dequantize/{label}", lambda: exl2.dequantize(qw, qs, qsm, g, inv), th),
            (f"dequantize_out/{label}", lambda: exl2.dequantize(qw, qs, qsm, g, inv, out=out_buf), th),
            (f"before18/{label}", before_18, th),
            (f"stored/{label}", lambda: exl2.dequantize_stored(qw, qs, qsm, g), th),
            (f"pack/{label}", lambda: exl2.pack_q_weight(codes, g), th),
            (f"unpack/{label}", lambda: exl2.unpack_q_weight(qw, g), th),
        ]
    print(f"timing {len(cases)} cases x {repeats} runs (1 thread and {cores} threads) ...", flush=True)
    R = time_side_by_side(cases, repeats)

    # correctness guard on the full layer, and the twin's time
    W = exl2.dequantize(qw, qs, qsm, g, inv)
    same_paths = (np.array_equal(out_buf.view(np.uint16), W.view(np.uint16))
                  and np.array_equal(before_18(), W.view(np.uint16)))
    if args.quick:
        cols = 128
        print(f"NumPy twin on the first {cols} columns ...", flush=True)
        t = time.perf_counter()
        Wt = oracle.dequantize(np.ascontiguousarray(qw[:, :cols]), np.ascontiguousarray(qs[:, :cols // 8]), qsm,
                               L["bits_rows"], inv)
        twin_s = (time.perf_counter() - t) * N / cols
        twin_note = f"measured on the first {cols} of {N} columns and scaled x{N // cols} (linear in N)"
        identical = np.array_equal(Wt.view(np.uint16), W[:cols].view(np.uint16))
    else:
        print("NumPy twin on the full layer (about 10-60 s) ...", flush=True)
        t = time.perf_counter()
        Wt = oracle.dequantize(qw, qs, qsm, L["bits_rows"], inv)
        twin_s = time.perf_counter() - t
        twin_note = "the full layer, one run"
        identical = np.array_equal(Wt.view(np.uint16), W.view(np.uint16))
    del Wt
    print("Numba cache: two fresh processes ...", flush=True)
    cache_runs, cache_files = cache_check()
    load_end = load_average()

    # ------------------------------------------------------------------ tables
    floor = R["copyto"][0]
    rows = [
        ("`numpy.copyto` into the existing fp16 [4096, 11008] (floor; NumPy, 1 thread)", R["copyto"], None),
        ("`np.empty` + `numpy.copyto` (floor with a fresh 90 MB output)", R["empty+copyto"], None),
        ("`np.empty` + one store per 4 KiB page (page faults of a fresh 90 MB output alone)", R["faults"], None),
        ("**`dequantize`** -> fp16 `nn.Linear` weight (allocates its output)", R["dequantize/1"], R["dequantize/all"]),
        ("**`dequantize(..., out=buf)`** into an existing fp16 [4096, 11008] (no page faults; non-temporal stores)",
         R["dequantize_out/1"], R["dequantize_out/all"]),
        ("`dequantize` before issue 18 (plain stores into a fresh `np.empty`)", R["before18/1"], R["before18/all"]),
        ("`dequantize_stored` -> fp16 [11008, 4096], stored order", R["stored/1"], R["stored/all"]),
        ("`pack_q_weight` (uint8 codes -> int32 [1488, 4096])", R["pack/1"], R["pack/all"]),
        ("`unpack_q_weight`", R["unpack/1"], R["unpack/all"]),
    ]
    lines = [f"| operation | 1 thread | {cores} threads |", "|---|---:|---:|"]
    for name, one, many in rows:
        lines.append(f"| {name} | {cell(one)} | {cell(many) if many else '-'} |")
    lines.append(f"| NumPy twin `oracle.dequantize` ({twin_note}) | {twin_s:.2f} s | - |")
    table = "\n".join(lines)

    d1, dn = R["dequantize/1"][0], R["dequantize/all"][0]
    faults = R["faults"][0]
    p1, pn = R["pack/1"][0], R["pack/all"][0]
    fault = R["empty+copyto"][0] - floor
    ok_a1, ok_an = d1 <= 3 * floor, dn <= 3 * floor
    do1, don = R["dequantize_out/1"][0], R["dequantize_out/all"][0]
    b18 = R["before18/all"][0]
    efloor = R["empty+copyto"][0]
    c1, c2 = cache_runs
    ok_d = c2["misses"] == 0 and c2["hits"] > 0
    targets = "\n".join([
        "| target | measured | met |", "|---|---|---|",
        f"| (a) `dequantize` <= 3x `copyto` ({ms(floor)}) | 1 thread {d1 / floor:.2f}x, {cores} threads "
        f"{dn / floor:.2f}x | "
        f"1 thread: {'yes' if ok_a1 else 'no'}; {cores} threads: {'yes' if ok_an else 'no'} |",
        f"| (b) >= 5x faster than the NumPy twin | 1 thread {twin_s / d1:.0f}x, {cores} threads {twin_s / dn:.0f}x"
        f" | {'yes' if twin_s / d1 >= 5 else 'no'} |",
        f"| (c) `pack_q_weight` at least as fast as `dequantize` | 1 thread {ms(p1)} vs {ms(d1)}, {cores} threads "
        f"{ms(pn)} vs {ms(dn)} | {'yes' if p1 <= d1 and pn <= dn else 'no'} |",
        f"| issue 18: `dequantize` <= 1.5x `copyto` on {cores} threads, into an existing buffer (`out=`) | "
        f"{don / floor:.2f}x (1 thread {do1 / floor:.2f}x) | {'yes' if don <= 1.5 * floor else 'no'} |",
        f"| issue 18: the same for a fresh output (`dequantize` allocates) | {dn / floor:.2f}x copyto, "
        f"{dn / efloor:.2f}x `np.empty`+`copyto` (its fair floor); before issue 18 {b18 / floor:.2f}x copyto | "
        f"{'yes' if dn <= 1.5 * floor else 'no'} |",
        f"| (d) no recompilation in a second process | process 2: {c2['misses']} cache misses, {c2['hits']} hits;"
        f" first call {ms(c2['first_call'])} (process 1: {c1['first_call']:.2f} s) | {'yes' if ok_d else 'no'} |",
    ])
    cache = "\n".join([
        "| process | import exl2fmt.codec.exl2 | first `dequantize` call | start -> first result | cache hits | "
        "cache misses |", "|---|---:|---:|---:|---:|---:|",
        f"| 1 (empty `NUMBA_CACHE_DIR`) | {ms(c1['imports'])} | {c1['first_call']:.2f} s | "
        f"{c1['to_first_result']:.2f} s | {c1['hits']} | {c1['misses']} |",
        f"| 2 (same directory) | {ms(c2['imports'])} | {ms(c2['first_call'])} | {c2['to_first_result']:.2f} s | "
        f"{c2['hits']} | {c2['misses']} |",
    ])

    bound = ""
    if not (ok_a1 and ok_an):
        bound = (
            f"\n**What bounds (a) on one thread.** `dequantize` returns a new 90 MB array, and the OS zeroes "
            f"every fresh page on its first touch: those page faults alone take {ms(faults)} here "
            f"({faults / floor:.1f}x the copyto floor, which writes into an existing buffer and pays none). "
            f"On top of that `dequantize` copies each 64-column tile of q_weight (24 MB in all, read along "
            f"{4 * N // 1024} KiB strides) into a contiguous buffer, runs one vectorised decode pass per input "
            f"feature and tile (shift, mask, int->float, scale, fp16 rounding over 64 columns), transposes "
            f"32x32 blocks in registers and stores 90 MB; single-threaded that is "
            f"{d1 / floor:.1f}x in all. With {cores} threads the decode and the page faults are shared out "
            f"and the target holds.\n")
    text = f"""{SECTION}

`bench/bench_codec.py`{' --quick' if args.quick else ''} ({date}; CPU: {cpu_model()} (LLVM: {llvm_cpu()}; {cpu_flags()}),
{os.cpu_count()} cores, Numba threads {cores}; Python {platform.python_version()}, NumPy {np.__version__},
Numba {numba.__version__}; load average {load_start} at the start, {load_end} at the end: the machine may be shared,
each run waits until no other process is runnable, at most 2 s, see the script's docstring).

Layer K={K}, N={N}, plan {PLAN_DESC} (`layout.plan_rows`, {g.G} groups, q_weight int32 [{g.Q}, {N}]), random
codes / scales / permutation; output fp16 [{N}, {K}] C order (90 MB). Median (min) of {repeats} runs after a
warm-up, cases interleaved round by round. `dequantize` output bit-identical to the NumPy twin on
{'the first 128 columns' if args.quick else 'the full layer'}: {'yes' if identical else '**NO**'}; the `out=` path and the
pre-issue-18 kernel bit-identical to it on the full layer: {'yes' if same_paths else '**NO**'}.

{table}

{targets}
{bound}
Numba on-disk cache (`cache=True` on every kernel): two fresh processes sharing one initially empty
`NUMBA_CACHE_DIR`; first call = a small layer (K=256, N=64), so it is compile time (process 1) or cache load
(process 2). {cache_files} cache files (`.nbi` index + `.nbc` code) were written.

{cache}
"""
    print()
    print(text)
    if args.write:
        write_results(text)
        print(f"wrote the '{SECTION}' section of bench/RESULTS.md")


if __name__ == "__main__":
    main()
