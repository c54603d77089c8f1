"""A/B of the measurement's block error on the trained fixture (issue 40): the per-token relative error
(``common.rel_err_tokens``, the default since 2026-12-07) against the former per-calibration-row error, in one
process and one session, through ``bench/quality.py``'s run (the same calibration, evaluation and bitrates; only the
error function differs). GPTQ and round-to-nearest use no measurement and are left out.

    python bench/measure_ab.py [--bits 4.0,3.0,2.5] [--before rows|rms_tokens]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rows_error(y, y_ref) -> float:
    """The former block error: mean over calibration rows of ||y_row - y_ref_row||_F / ||y_ref_row||_F."""
    d = (y - y_ref).flatten(1).norm(dim=1)
    r = y_ref.flatten(1).norm(dim=1).clamp_min(1e-30)
    return float((d / r).mean())


def rms_tokens_error(y, y_ref) -> float:
    """A variant: the root mean square over tokens of ||y_t - y_ref_t|| / ||y_ref_t||."""
    d = (y - y_ref).norm(dim=-1)
    r = y_ref.norm(dim=-1).clamp_min(1e-30)
    return float(((d / r) ** 2).mean().sqrt())


VARIANTS = {"rows": rows_error, "rms_tokens": rms_tokens_error}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="4.0,3.0,2.5")
    ap.add_argument("--before", default="rows", choices=sorted(VARIANTS), help="the error the default is compared with")
    a = ap.parse_args()
    bits = tuple(float(b) for b in a.bits.split(","))
    from exl2fmt.quant import common, gptq_pass, measure
    from quality import run

    per_token = common.rel_err_tokens
    users = (measure, gptq_pass)            # the modules that call it: the measurement and the block results
    out = {}
    for name, fn in (("rows", VARIANTS[a.before]), ("tokens", per_token)):
        for m in users:
            m.rel_err_tokens = fn
        with tempfile.TemporaryDirectory() as d:
            out[name] = run(Path(d), exl2_bits=bits, gptq=False, rtn=False, fp16_head=False, log=lambda *x: None)
    for m in users:
        m.rel_err_tokens = per_token
    print(f"| model | KL {a.before} | KL tokens (default) | top-1 {a.before} | top-1 tokens | ppl {a.before} | ppl tokens |")
    print("|---|---|---|---|---|---|---|")
    for k in out["tokens"]:
        b, t = out["rows"][k], out["tokens"][k]
        print(f"| {k} | {b['kl_mean']:.3e} | {t['kl_mean']:.3e} | {b['top1_agree']:.3f} | {t['top1_agree']:.3f} | "
              f"{b['ppl_test']:.3f} | {t['ppl_test']:.3f} |")


if __name__ == "__main__":
    main()
