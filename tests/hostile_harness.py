"""Run the CLI on untrusted input under hard limits: wall time, address space, and a measured peak RSS.

Import with ``from hostile_harness import run_bounded`` (pytest puts ``tests/`` on ``sys.path``).  Each call
starts a fresh ``python -m exl2fmt.cli.app`` process with ``RLIMIT_AS`` set (so a run that tries to size
memory by a number from the file dies instead of swapping the machine), kills its whole process group at
the wall-clock limit, and reads the child's own peak RSS from ``wait4`` (not the sum over all children).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the issue's bounds for one hostile case
TIME_LIMIT_S = 10.0
RSS_LIMIT_BYTES = 1 << 30
#: address-space cap: above the RSS bound, since Python, NumPy and LLVM reserve address space they never
#: touch; a runaway allocation still fails fast instead of paging the machine.
AS_LIMIT_BYTES = 4 << 30


@dataclass(frozen=True)
class BoundedRun:
    rc: int | None          # exit status; None when killed at the time limit; -N for death by signal N
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_bytes: int
    timed_out: bool

    @property
    def traceback(self) -> bool:
        """True when either stream shows a Python traceback (never acceptable on hostile input)."""
        return "Traceback (most recent call last)" in self.stdout or "Traceback (most recent call last)" in self.stderr

    def check_bounds(self) -> None:
        """Assert the issue's contract: finished in time, within memory, an exit code, no traceback."""
        assert not self.timed_out, f"ran past {TIME_LIMIT_S} s"
        assert self.rc is not None and self.rc >= 0, f"died by signal {self.rc}\n{self.stderr[-2000:]}"
        assert self.peak_rss_bytes <= RSS_LIMIT_BYTES, f"peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB"
        assert not self.traceback, self.stderr[-4000:]


def _limit_child() -> None:  # runs in the child between fork and exec
    os.setsid()
    # a suite started in the background by a shell without job control inherits SIGINT ignored, and Python then
    # installs no handler of its own: the interrupt tests need the disposition a terminal user has
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT_BYTES, AS_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_bounded(*args, timeout: float = TIME_LIMIT_S, env_extra: dict | None = None,
                cwd: str | os.PathLike | None = None) -> BoundedRun:
    """``python -m exl2fmt.cli.app ARGS`` under the limits above; never raises for the child's behaviour."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("EXL2FMT_DEBUG", None)
    env.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "exl2fmt-numba-cache"))
    env.update(env_extra or {})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "exl2fmt.cli.app", *map(str, args)], stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL, cwd=str(cwd or ROOT), env=env,
                                preexec_fn=_limit_child)
        timed_out = False
        status = rusage = None
        deadline = t0 + timeout
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status, rusage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = 0  # reaped by wait4 above; keep Popen from waiting again
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
    if timed_out:
        rc = None
    elif os.WIFSIGNALED(status):
        rc = -os.WTERMSIG(status)
    else:
        rc = os.WEXITSTATUS(status)
    return BoundedRun(rc, stdout, stderr, wall, int(rusage.ru_maxrss) * 1024, timed_out)
