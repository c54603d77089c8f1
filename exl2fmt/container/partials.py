"""Working directories next to DST that a killed run can leave behind, and interrupts around publishing.

Every conversion (and the quantizer) builds its output in a hidden sibling ``.<DST name>.exl2fmt-partial-<hex>``
and renames it to DST at the end.  A ``SIGKILL`` (or a power cut) skips all cleanup and leaves that directory.
So that the next run can remove it without ever deleting something exl2fmt did not make, each working
directory carries an owner marker, ``.exl2fmt-owner.json``::

    {"tool": "exl2fmt", "destination": "/abs/path/DST", "host": "...", "boot_id": "...", "pid": 1234,
     "pid_start": "98765"}

``remove_stale_partials(dst)`` (run by ``make_partial_dir`` before it makes a new one) removes a sibling only
when **all** of these hold: its name has DST's partial prefix; it is a real directory (``lstat``: never a
symlink), owned by the current user; its marker is a regular file (opened with ``O_NOFOLLOW``), small, and
names exactly this DST; it was made on this host; and its owner is gone (another boot, no such pid, or the
pid now belongs to a process that started at another time).  A partial of a run still going on, of another
host sharing the filesystem, or without a readable marker is left alone.  The removal is ``shutil.rmtree``,
which on Linux works through directory descriptors and does not follow symlinks inside.

``SHIELD`` handles the other end: once ``publish`` starts renaming, SIGINT / SIGTERM no longer raise.  They
are noted and the run finishes (the published DST is complete and verified), so an interrupt can never leave
DST half-replaced, turn a published result into exit 130, or kill the process raw after "verified".  The
driver lowers the shield when it returns; the CLI holds it up until its report is printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import threading
from pathlib import Path

from ..errors import Exl2Error
from .jsonload import MARKER_JSON, loads_json

__all__ = ["MARKER", "PARTIAL_TAG", "WORK_TAG", "work_dir_name", "make_owned_dir", "owner_record", "read_marker",
           "remove_stale_partials", "InterruptShield", "SHIELD", "fault_point"]

MARKER = ".exl2fmt-owner.json"
PARTIAL_TAG = ".exl2fmt-partial-"
WORK_TAG = ".exl2fmt-work"
"""Suffix of the quantizer's resumable work directory ``.<DST name>.exl2fmt-work`` (kept across runs, unlike a
partial: ``exl2fmt.quant.workdir``)."""
_MAX_MARKER_BYTES = 4096


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip() or None
    except OSError:
        return None


def _pid_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    fields = data.rpartition(b")")[2].split()
    return fields[19].decode("ascii", "replace") if len(fields) > 19 else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return True


def _destination_key(dst: Path) -> str:
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        parent = parent.resolve(strict=False)
    except (OSError, RuntimeError):
        parent = Path(os.path.abspath(parent))
    return str(parent / dst.name)


def owner_record(dst: Path) -> dict:
    pid = os.getpid()
    return {"tool": "exl2fmt", "destination": _destination_key(dst), "host": socket.gethostname(),
            "boot_id": _boot_id(), "pid": pid, "pid_start": _pid_start(pid)}


def work_dir_name(dst: Path) -> str:
    """The name of the quantizer's default work directory next to ``dst``."""
    return f".{dst.name}{WORK_TAG}"


def partial_prefix(dst: Path) -> str:
    return f".{dst.name[:150]}{PARTIAL_TAG}"


def make_owned_dir(dst: Path) -> Path:
    """A new, marked working directory ``.<DST name>.exl2fmt-partial-<hex>`` next to DST (OSError on failure)."""
    parent = dst.parent if str(dst.parent) else Path(".")
    record = json.dumps(owner_record(dst)) + "\n"
    for _ in range(100):
        cand = parent / f"{partial_prefix(dst)}{secrets.token_hex(6)}"
        try:
            cand.mkdir()
        except FileExistsError:
            continue
        try:
            fd = os.open(cand / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(record)
        except BaseException:
            shutil.rmtree(cand, ignore_errors=True)
            raise
        return cand
    raise FileExistsError(f"no free working-directory name next to {dst}")


def _read_marker(d: Path) -> dict | None:
    try:
        fd = os.open(d / MARKER, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MARKER_BYTES:
            return None
        raw = os.read(fd, _MAX_MARKER_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:  # the guarded loader: a marker nested 2000 deep or holding a 5000-digit number is no marker
        doc = loads_json(raw, MARKER_JSON)
    except Exl2Error:
        return None
    return doc if isinstance(doc, dict) else None


def read_marker(d: Path) -> dict | None:
    """The owner marker of directory ``d`` as a dict (None when it is missing, not a regular file, too large or
    not a JSON object); never follows a symlink named like the marker."""
    return _read_marker(d)


def _owner_gone(doc: dict) -> bool:
    """True when the run that wrote ``doc`` (on this host) can no longer be running."""
    pid = doc.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    boot = _boot_id()
    if boot is not None and doc.get("boot_id") not in (None, boot):
        return True  # the machine rebooted since: nothing of that boot runs
    if pid == os.getpid():
        return doc.get("pid_start") != _pid_start(pid)  # our pid, reused from an earlier process
    if not _pid_alive(pid):
        return True
    start = doc.get("pid_start")
    now = _pid_start(pid)
    return start is not None and now is not None and start != now


def stale_partials(dst: Path) -> list[Path]:
    """The working directories next to ``dst`` that an earlier, dead exl2fmt run made for this same ``dst``."""
    parent = dst.parent if str(dst.parent) else Path(".")
    prefix = partial_prefix(dst)
    key = None
    host = None
    out = []
    try:
        entries = os.scandir(parent)
    except OSError:
        return []
    with entries:
        for e in entries:
            if not e.name.startswith(prefix):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
                continue
            doc = _read_marker(Path(e.path))
            if doc is None or doc.get("tool") != "exl2fmt":
                continue
            if key is None:
                key, host = _destination_key(dst), socket.gethostname()
            if doc.get("destination") != key or doc.get("host") != host:
                continue
            if _owner_gone(doc):
                out.append(Path(e.path))
    return sorted(out)


def remove_stale_partials(dst: Path) -> list[str]:
    """Remove ``stale_partials(dst)``; returns the paths removed (errors are ignored: a leftover that cannot be
    removed does not stop the new run)."""
    removed = []
    for d in stale_partials(dst):
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                continue
            shutil.rmtree(d)
        except OSError:
            continue
        removed.append(str(d))
    return removed


class InterruptShield:
    """From publishing on, SIGINT and SIGTERM are recorded instead of raised (main thread only; elsewhere a
    no-op).  ``raise_shield`` is idempotent; ``lower`` restores the previous handlers unless a ``held()`` scope
    (the CLI, until its report is out) keeps the shield up; ``received`` lists the signals noted."""

    SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)

    def __init__(self):
        self._saved: dict | None = None
        self._holds = 0
        self._raised = 0
        self.received: list[int] = []

    @property
    def up(self) -> bool:
        return self._saved is not None

    def _note(self, signum, frame) -> None:  # noqa: ARG002 - signal handler protocol
        self.received.append(signum)

    def raise_shield(self) -> None:
        if self._saved is not None or threading.current_thread() is not threading.main_thread():
            return
        if not self._holds:
            self.received = []
        self._raised += 1
        self._saved = {}
        for s in self.SIGNALS:
            try:
                self._saved[s] = signal.signal(s, self._note)
            except (OSError, ValueError):  # pragma: no cover - not the main interpreter
                pass

    def lower(self) -> None:
        if self._holds or self._saved is None:
            return
        saved, self._saved = self._saved, None
        for s, h in saved.items():
            try:
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            except (OSError, ValueError):  # pragma: no cover
                pass

    def intermediate(self) -> "_Intermediate":
        """A scope around a conversion whose published output is not the run's result (the FP16 staging of
        GGUF -> EXL2/GPTQ, which the quantizer then reads): if that publish raised the shield, it is lowered at
        the end of the scope even while the CLI holds it, and a SIGINT / SIGTERM noted meanwhile is delivered
        again then (to the handler the shield had replaced), so the run stops instead of quantizing on."""
        return _Intermediate(self)

    @contextlib.contextmanager
    def held(self):
        """Keep the shield up (once raised) until this scope ends; clears ``received`` on entry."""
        self._holds += 1
        self.received = []
        try:
            yield self
        finally:
            self._holds -= 1
            self.lower()


class _Intermediate:
    def __init__(self, shield: InterruptShield):
        self.shield = shield

    def __enter__(self):
        s = self.shield
        self.was_up, self.n0 = s.up, s._raised
        if not self.was_up:
            s.received = []
        return self

    def __exit__(self, et, ev, tb) -> bool:
        s = self.shield
        if self.was_up or s._raised == self.n0:      # nothing was published in here, or the shield was up before
            return False
        got, s.received = list(s.received), []
        holds, s._holds = s._holds, 0
        try:
            s.lower()
        finally:
            s._holds = holds
        if got and et is None and threading.current_thread() is threading.main_thread():
            signal.raise_signal(got[0])               # the restored handler runs now: KeyboardInterrupt, or exit
        return False


SHIELD = InterruptShield()


def fault_point(name: str) -> None:
    """Test hook for the fault-injection tests (tests/test_hostile_io.py): with ``EXL2FMT_TEST_FAULT=NAME:SIGNAL``
    in the environment the process sends itself SIGNAL (SIGKILL, SIGINT, SIGTERM) when it reaches point NAME:
    ``partial`` (working directory made), ``written`` (output written, not verified), ``verified`` (verified, not
    published), ``published`` (renamed to DST).  Costs one environment lookup when unset."""
    spec = os.environ.get("EXL2FMT_TEST_FAULT")
    if not spec:
        return
    point, _, sig = spec.partition(":")
    if point == name:
        # raise_signal delivers to this (the main) thread before it returns; os.kill(getpid()) may hand the
        # signal to a worker thread, and on a loaded machine the run could finish before Python's handler ran.
        signal.raise_signal(getattr(signal, sig or "SIGKILL"))
