"""bench/exl3_gpu_check.py's path on a machine without CUDA (issue 39): it must say it skipped, build nothing and
exit 0, whether torch is missing or sees no device (CUDA_VISIBLE_DEVICES="" hides a real one).  The GPU path
itself runs on a GPU machine (bench/RESULTS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "exl3_gpu_check.py"


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "EXL3_SRC": "", "EXL3_WHEEL": ""}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_no_cuda_device_is_a_clear_skip():
    r = _run(f"import runpy, sys; sys.argv = ['exl3_gpu_check']; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("skipped: no CUDA device"), r.stdout
    assert "VERDICT" not in r.stdout


def test_without_torch_or_numpy_the_skip_needs_nothing_else():
    r = _run("import runpy, sys; sys.modules['torch'] = None; sys.modules['numpy'] = None; "
             f"sys.argv = ['exl3_gpu_check']; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("skipped: no CUDA device (torch is not installed)"), r.stdout
