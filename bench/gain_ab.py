"""Issue 40: block gains measured with another perturbation than round-to-nearest, for an A/B of the solver's
weights (``quant.sensitivity.block_gains(perturb=)``).

Every block's perturbed copy is taken from an FP16 decode of a quantized file of the same model (for example the
EXL2 3.0 file's own GPTQ-quantized blocks: ``exl2fmt convert exl2-3.0 exl2-3.0-fp16 --to fp16``), and the gains
are measured exactly as ``--block-gains`` measures them (the same calibration rows, the same carry to the final
norm).  The result is a copy of the run's ``measurement.json`` with these gains stored in it; quantizing with
``--measurement THAT --block-gains`` then plans with them.

    python bench/gain_ab.py --model gemma3 --perturb-from <runs>/exl2-3.0-fp16 --out <runs>/measurement-g.json

``<runs>`` is ``bench/real_quality.py``'s directory (``~/.cache/exl2fmt-bench/<model>-runs``): its ``fp16``
reference, ``cal.npy`` calibration ids (the quantizer's own built-in set, 32 x 512) and ``measurement.json``.
``--gains-from M --power A`` instead takes the gains stored in measurement M and writes them raised to the power A
(renormalised to geometric mean 1): A = 0.5 halves every gain's log, a damped weighting for an A/B.

Prints the gains beside the stored round-to-nearest ones (``measurement-gains.json`` where present) and their log
correlation.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from exl2fmt.quant.qparams import GAINS_KEY
from exl2fmt.quant.sensitivity import block_gains
from exl2fmt.runner.model import HFModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--perturb-from", help="an FP16 decode of a quantized file of the model")
    ap.add_argument("--gains-from", help="a measurement.json with gains stored: raise them to --power instead")
    ap.add_argument("--power", type=float, default=1.0)
    ap.add_argument("--out", required=True, help="where the measurement copy with these gains goes")
    ap.add_argument("--runs", default=None, help="default ~/.cache/exl2fmt-bench/<model>-runs")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    a = ap.parse_args()
    runs = Path(a.runs) if a.runs else Path.home() / ".cache/exl2fmt-bench" / f"{a.model}-runs"
    if a.gains_from:
        doc = json.loads(Path(a.gains_from).read_text())
        g = {k: v ** a.power for k, v in doc[GAINS_KEY].items()}
        mean = math.exp(sum(math.log(v) for v in g.values()) / len(g))
        doc[GAINS_KEY] = {k: v / mean for k, v in g.items()}
        Path(a.out).write_text(json.dumps(doc, indent=1))
        print(f"gains of {a.gains_from} to the power {a.power} -> {a.out}")
        return
    torch.set_num_threads(2)
    ids = torch.from_numpy(np.load(runs / "cal.npy")).long()
    dec = safe_open(str(Path(a.perturb_from) / "model.safetensors"), "pt")
    spec = HFModel.open(runs / "fp16")
    t = time.monotonic()
    try:
        def perturb(i, name, w):
            w_hat = dec.get_tensor(spec.linear_key(i, name) + ".weight").float()
            assert w_hat.shape == w.shape, (i, name, w_hat.shape, w.shape)
            return w_hat
        gains = block_gains(spec, ids, torch.device("cpu"), a.batch_tokens, perturb=perturb)
    finally:
        spec.close()
    secs = time.monotonic() - t
    doc = json.loads((runs / "measurement.json").read_text())
    doc[GAINS_KEY] = gains
    Path(a.out).write_text(json.dumps(doc, indent=1))
    old = runs / "measurement-gains.json"
    rtn = json.loads(old.read_text()).get(GAINS_KEY) if old.exists() else None
    print(f"gains from {a.perturb_from}: {secs:.0f} s -> {a.out}")
    for k, g in gains.items():
        print(f"  {k:40s} {g:7.3f}" + (f"   rtn {rtn[k]:7.3f}" if rtn else ""))
    if rtn:
        x = np.log([gains[k] for k in gains]); y = np.log([rtn[k] for k in gains])
        print(f"log correlation with the round-to-nearest gains: {np.corrcoef(x, y)[0, 1]:.3f}")


if __name__ == "__main__":
    main()
