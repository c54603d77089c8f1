"""codec.cache_deps: a cached Numba kernel is recompiled when a file it inlines code from changes (issue 39's
trap: editing exl3_ops.py left exl3.py's cached kernels stale).  Two fresh interpreters over a throw-away
package; the second runs after the dependency (not the kernel's own file) was edited."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DEP = '''from numba import njit


@njit(inline="always")
def value():
    return {v}
'''

KERNEL = '''from numba import njit
{watch}
from .dep import value


@njit(cache=True)
def kernel():
    return value()
'''


def _run(pkg: Path, cache: Path) -> str:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=f"{pkg.parent}{os.pathsep}{ROOT}")
    code = "from pkgx.kern import kernel; print(kernel())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


@pytest.mark.parametrize("watched", [True, False])
def test_kernel_recompiled_when_dependency_changes(tmp_path, watched):
    pkg = tmp_path / "pkgx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "dep.py").write_text(DEP.format(v=1))
    watch = ("from exl2fmt.codec.cache_deps import watch\nimport os as _os\n"
             "watch(__file__, [_os.path.join(_os.path.dirname(__file__), 'dep.py')])") if watched else ""
    (pkg / "kern.py").write_text(textwrap.dedent(KERNEL.format(watch=watch)))
    cache = tmp_path / "cache"
    assert _run(pkg, cache) == "1"
    assert any(cache.rglob("*.nbi"))  # the kernel was cached
    (pkg / "dep.py").write_text(DEP.format(v=2))
    # without the watch Numba returns the stale machine code (the trap this module removes)
    assert _run(pkg, cache) == ("2" if watched else "1")
    assert _run(pkg, cache) == ("2" if watched else "1")  # and the recompiled kernel is cached again
