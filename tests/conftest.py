"""Shared hypothesis strategies and small array helpers for the format-core tests.

Import them with ``from conftest import ...`` (pytest puts ``tests/`` on ``sys.path``).  Everything here is
generic: strategies draw *descriptions* (group plans, widths, seeds, fp16 bit patterns) and the helpers turn a
seed into NumPy arrays, so that examples shrink well and stay cheap.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# pytest-xdist workers share the cores: each worker's thread pools (OpenMP for torch, Numba's, BLAS) get
# cores / workers threads (1 for -n 2 on 2 cores), set before anything imports them, and inherited by the CLI
# subprocesses the tests start.  Each pool sized to every core made 2 workers run 4+ spinning threads on 2
# cores: the quality test took 137 s in the suite against 42 s alone.  An explicit setting in the environment wins.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_var, _threads)

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: EXL2 bit widths in tier order (descending), and the GPTQ widths exl2fmt handles.
EXL2_TIER_BITS = (8, 6, 5, 4, 3, 2)
GPTQ_BITS = (2, 3, 4, 8)

#: fp16 bit patterns worth hitting on purpose (all finite, positive).
F16_SPECIAL_POSITIVE = (
    0x0001,  # smallest subnormal 2^-24
    0x0002, 0x0155, 0x03FF,  # subnormals, largest subnormal
    0x0400,  # smallest normal 2^-14
    0x0401, 0x1400, 0x1401,  # small normals whose /256 is subnormal (rounds)
    0x2000, 0x3BFF, 0x3C00, 0x3C01,  # around 1.0
    0x5BFF, 0x7800, 0x7BFE, 0x7BFF,  # large, largest finite 65504
)


def hyp_settings(max_examples: int, **kw) -> settings:
    """Settings for tests that call Numba code: no deadline (the first example may compile)."""
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **kw)


def seeds() -> st.SearchStrategy[int]:
    """A seed for ``np.random.default_rng`` (arrays are drawn from it, not by hypothesis)."""
    return st.integers(0, 2**32 - 1)


def n_pads(max_n_pad: int = 256) -> st.SearchStrategy[int]:
    """N_pad: a positive multiple of 32, at most ``max_n_pad`` (32 is drawn often)."""
    return st.integers(1, max(1, max_n_pad // 32)).map(lambda m: 32 * m)


@st.composite
def bits_rows(draw, max_K: int = 1024, max_group_rows: int = 256, max_groups_per_tier: int = 4,
              widths=EXL2_TIER_BITS) -> list[tuple[int, int]]:
    """A valid EXL2 group plan [(bits, rows)] in stored order: a non-empty subset of ``widths`` in descending
    order, each tier 1.. groups whose row counts are multiples of 32, total K <= max_K (>= 32)."""
    chosen = draw(st.lists(st.sampled_from(widths), min_size=1, max_size=len(widths), unique=True))
    chosen = sorted(chosen, reverse=True)
    out: list[tuple[int, int]] = []
    K = 0
    for b in chosen:
        n = draw(st.integers(1, max_groups_per_tier))
        for _ in range(n):
            room = min(max_group_rows, max_K - K) // 32
            if room < 1:
                break
            r = 32 * draw(st.integers(1, room))
            out.append((b, r))
            K += r
    assert out, "max_K must be >= 32"
    return out


def f16_positive(special_weight: bool = True) -> st.SearchStrategy[np.float16]:
    """A finite positive fp16 value: subnormals, tiny, ordinary and huge ones all occur."""
    pats = st.integers(0x0001, 0x7BFF)
    if special_weight:
        pats = st.one_of(st.sampled_from(F16_SPECIAL_POSITIVE), pats)
    return pats.map(lambda h: np.array([h], dtype=np.uint16).view(np.float16)[0])


# ---------------------------------------------------------------------------------------------------
# plain helpers (seeded NumPy)
# ---------------------------------------------------------------------------------------------------


def random_codes(rng: np.random.Generator, bits_rows, n_cols: int, extremes: float = 0.15) -> np.ndarray:
    """uint8 [K, n_cols] codes, group by group in [0, 2^b); a fraction ``extremes`` of the cells is forced to
    0 or 2^b - 1 so the limits always occur."""
    blocks = []
    for b, r in bits_rows:
        top = (1 << b) - 1
        c = rng.integers(0, top + 1, size=(r, n_cols))
        pick = rng.random((r, n_cols)) < extremes
        c[pick] = rng.choice(np.array([0, top]), size=int(pick.sum()))
        blocks.append(c)
    return np.concatenate(blocks).astype(np.uint8) if blocks else np.zeros((0, n_cols), np.uint8)


def random_f16(rng: np.random.Generator, n: int, lo: int = 0x0001, hi: int = 0x7BFF,
               negative: bool = False) -> np.ndarray:
    """float16 [n] drawn uniformly over the bit patterns [lo, hi] (finite, positive unless ``negative``)."""
    pats = rng.integers(lo, hi + 1, size=n).astype(np.uint16)
    if negative:
        pats |= (rng.integers(0, 2, size=n).astype(np.uint16) << 15)
    return pats.view(np.float16)


def f16_bits(a) -> np.ndarray:
    """The uint16 bit patterns of a float16 array (compare fp16 results bit for bit with this)."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float16)).view(np.uint16)


#: The repository root (bench/ scripts, the CLI's working directory in subprocess tests).
ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """Import ``bench/<name>.py`` as a module (the tests reuse the benchmarks' helpers on smaller runs)."""
    spec = importlib.util.spec_from_file_location(f"exl2fmt_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_cli(*args, pythonpath: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m exl2fmt.cli.app ARGS`` in a fresh process (no inherited TRITON_INTERPRET; ``pythonpath``
    prepended, e.g. to shadow a dependency)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "exl2fmt.cli.app", *map(str, args)], capture_output=True,
                          text=True, cwd=str(ROOT), env=env, timeout=timeout)


#: Test modules that hold the longest tests (``pytest --durations``), moved to the front of the collection in this
#: order (each module's own order kept, so module-scoped fixtures are still built once per worker).  pytest-xdist's
#: load scheduler hands tests out in collection order: a 60 s test handed out among the last ones keeps one worker
#: busy alone at the end of the run.
LONG_MODULES_FIRST = ("test_quality.py", "test_validate_kernel.py", "test_validate_run.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def force_delta_scoring(monkeypatch) -> list[str]:
    """Score every block of a quantizer run from the reference tape (``scoring.DELTA_MIN_WEIGHTS`` lowered to 0,
    for tiny test models) and return the list that collects the linear name of every ``DeltaLinear`` made."""
    from exl2fmt.quant import scoring

    made: list[str] = []
    init = scoring.DeltaLinear.__init__

    def counted(self, tape, n, *a):
        made.append(n)
        init(self, tape, n, *a)
    monkeypatch.setattr(scoring, "DELTA_MIN_WEIGHTS", 0)
    monkeypatch.setattr(scoring.DeltaLinear, "__init__", counted)
    return made
