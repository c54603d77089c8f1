"""Say once that the Numba kernels are being compiled (the first deep validate of an install spends ~10 s on it).

The codecs are ``@njit(cache=True)``: the compiled machine code is stored next to the module (``__pycache__``)
or, when that directory is not writable (a read-only site-packages), in Numba's per-user cache directory
(``~/.cache/numba``, or ``NUMBA_CACHE_DIR``), so only the first run pays.  Numba broadcasts a
``"numba:compile"`` event only when a function is compiled, not when it is loaded from that cache, so
``compile_notice(say)`` calls ``say(MESSAGE)`` at most once, exactly when compiling starts, and never on a warm
install.  Importing this module imports numba: use it only where the command will use the codecs anyway.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

__all__ = ["MESSAGE", "compile_notice"]

MESSAGE = "compiling kernels, once per install (cached afterwards)..."


@contextlib.contextmanager
def compile_notice(say: Callable[[str], None]) -> Iterator[None]:
    from numba.core import event

    class _Once(event.Listener):
        said = False

        def on_start(self, ev) -> None:
            if not self.said:
                self.said = True
                say(MESSAGE)

        def on_end(self, ev) -> None:
            pass

    with event.install_listener("numba:compile", _Once()):
        yield
