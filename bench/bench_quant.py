"""GPTQ on one 4096 x 4096 layer (one candidate setting) against its linear-algebra floor, on the CPU.

The floor is what any GPTQ must do on this layer, measured on this machine in the same run:

* the Cholesky factorization of H, ``cholesky_inverse`` and the Cholesky factor of the inverse (timed);
* K^2 * N / 2 multiply-adds of the error feedback (each of the K rows updates the later rows, in total
  K(K-1)/2 * N), at the machine's measured float32 matmul rate (a 4096^3 ``torch.mm``, timed).

``quantize_exl2`` also runs the per-group scale search (97 grid points per group) and the row loop; the target
is total time <= 2 x floor.  Results are appended to bench/RESULTS.md with ``--record``.

    python bench/bench_quant.py [--K 4096] [--N 4096] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch


def _best(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    from exl2fmt.layout import Tier, plan_rows
    from exl2fmt.quant.gptq import HessianAccumulator, prepare, quantize_exl2

    K, N = a.K, a.N
    torch.manual_seed(0)
    X = torch.randn(2 * K, K) @ (torch.eye(K) + 0.1 * torch.randn(K, K) / K ** 0.5)
    acc = HessianAccumulator(K)
    acc.add(X)
    H = acc.result()
    W = torch.randn(N, K) * 0.02
    bits_rows = plan_rows(K, [Tier(1.0, 4, 128)])

    A = torch.randn(4096, 4096)
    B = torch.randn(4096, 4096)
    torch.mm(A, B)
    t_mm = _best(lambda: torch.mm(A, B))
    gflops = 2 * 4096 ** 3 / t_mm / 1e9

    eye = torch.eye(K)

    def factor():  # the cheapest route to chol(H^-1) torch offers on the CPU
        L = torch.linalg.cholesky(H + 0.01 * eye)
        Linv = torch.linalg.solve_triangular(L, eye, upper=False)
        torch.linalg.cholesky(Linv.T @ Linv, upper=True)

    t_factor = _best(factor)
    t_update = (K * (K - 1) / 2 * N * 2) / (gflops * 1e9)
    floor = t_factor + t_update

    prep = prepare(H)
    quantize_exl2(W, prep, bits_rows)  # warm-up (Numba compile / cache load)
    t_prep = _best(lambda: prepare(H), repeat=2)
    t_quant = statistics.median([_best(lambda: quantize_exl2(W, prep, bits_rows), repeat=1) for _ in range(3)])
    total = t_prep + t_quant
    lines = [
        f"- GPTQ one candidate (1x4b_128g), K={K}, N={N}, torch {torch.__version__}, {torch.get_num_threads()} threads:",
        f"  prepare (act-order + damped Cholesky of H^-1) {t_prep:.2f} s, sweep (scale search + row loop + "
        f"lazy updates) {t_quant:.2f} s, total {total:.2f} s",
        f"  floor: factorization {t_factor:.2f} s + K^2*N/2 multiply-adds at the measured {gflops:.0f} GFLOP/s "
        f"({t_update:.2f} s) = {floor:.2f} s -> **{total / floor:.2f}x floor** (target <= 2x)",
    ]
    print("\n".join(lines))
    if a.record:
        path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"\n### GPTQ vs linear-algebra floor ({datetime.date.today()}, {platform.machine()}, "
                    f"{os.cpu_count()} cores)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
