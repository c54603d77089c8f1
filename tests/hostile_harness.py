"""Run the CLI on untrusted input under hard limits: wall time, address space, and a measured peak RSS.

Import with ``from hostile_harness import run_bounded`` (pytest puts ``tests/`` on ``sys.path``).  Each call
starts a fresh ``python -m exl2fmt.cli.app`` process with ``RLIMIT_AS`` set (so a run that tries to size
memory by a number from the file dies instead of swapping the machine), kills its whole process group at
the wall-clock limit, and reads the CLI process's own peak RSS from ``wait4`` in a small trampoline parent (not
the sum over all children, and not the pages a fork of a large test process would inherit: ``_TRAMPOLINE``).
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


#: The CLI runs as the grandchild of the test process, under a small trampoline: a child forked from a large
#: pytest worker (one that loaded torch and a model) inherits its resident pages, and Linux reports that size as
#: the child's peak RSS even after exec.  The trampoline (a fresh interpreter, ~10 MB) sets the limits, forks the
#: CLI, reaps it with wait4 and writes its child's wait status and peak RSS to a report file: the CLI's own numbers.
_TRAMPOLINE = r"""
import os, resource, signal, sys
os.setsid()
signal.signal(signal.SIGINT, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-m", "exl2fmt.cli.app", *sys.argv[3:]])
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[2], "w") as f:
    f.write(f"{status} {ru.ru_maxrss}")
os._exit(0)
"""


def run_bounded(*args, timeout: float = TIME_LIMIT_S, env_extra: dict | None = None,
                cwd: str | os.PathLike | None = None) -> BoundedRun:
    """``python -m exl2fmt.cli.app ARGS`` under the limits above; never raises for the child's behaviour."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("EXL2FMT_DEBUG", None)
    env.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "exl2fmt-numba-cache"))
    env.update(env_extra or {})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        fd, report_path = tempfile.mkstemp(prefix="exl2fmt-bounded-")
        os.close(fd)
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", _TRAMPOLINE, str(AS_LIMIT_BYTES), report_path,
                                 *map(str, args)], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                cwd=str(cwd or ROOT), env=env)
        timed_out = False
        deadline = t0 + timeout
        while True:
            pid, _, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # the trampoline leads the CLI's process group
                except ProcessLookupError:
                    pass
                os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = 0  # reaped by wait4 above; keep Popen from waiting again
        try:
            report = Path(report_path).read_text().split()
        finally:
            os.unlink(report_path)
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
    status, maxrss = (int(report[0]), int(report[1])) if len(report) == 2 else (0, 0)
    if timed_out or len(report) != 2:   # killed at the limit (or the trampoline itself died)
        rc = None
    elif os.WIFSIGNALED(status):
        rc = -os.WTERMSIG(status)
    else:
        rc = os.WEXITSTATUS(status)
    return BoundedRun(rc, stdout, stderr, wall, maxrss * 1024, timed_out)
