"""Staged output: the one way a driver builds DST (a partial directory, write, verify, publish).

::

    with staged_output(dst, force, warnings=report.warnings) as stage:
        write into stage.path             # the partial directory (or, file=True, a file of DST's name in it)
        stage.written()                   # fault point "written"
        verify stage.path
        stage.publish()                   # fault points "verified" / "published" around the rename to DST

The rules it keeps for every driver (the converters' ``run_conversion``, the GGUF writer, the quantizer):

* the working directory is ``make_partial_dir(DST)``: a hidden sibling with an owner marker
  (``container.partials``); the partials that dead earlier runs left for the same DST are removed first and named
  in ``warnings`` (``stale_note``);
* an exception or Ctrl-C before the publish removes the working directory (and every ``stage.scratch()``
  directory) and propagates; a bare ``OSError`` without a file name becomes ``IO_ERROR`` naming the unpublished
  output (``name_unnamed_os_error``);
* ``publish`` renames it to DST; an existing DST is replaced only with ``force`` (``publish.publish``).  From the
  rename on SIGINT / SIGTERM are noted, not raised; the shield is lowered when the scope ends (``lower_shield``:
  unless the CLI holds it), and on success the interrupts that arrived meanwhile are added to ``warnings`` (also
  in ``stage.interrupts``), so a published result is reported as the success it is.

``scratch_dir(DST)`` is the working directory alone, for an intermediate that is never published (the FP16
staging of GGUF -> EXL2 / GPTQ): marked the same way, removed when the scope ends.

The fault points (``partials.fault_point``: ``partial``, ``written``, ``verified``, ``published``) are the
fault-injection tests' hooks (tests/test_hostile_io.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .partials import fault_point
from .publish import lower_shield, make_partial_dir, name_unnamed_os_error, publish, remove_path, stale_note

__all__ = ["Stage", "staged_output", "Scratch", "scratch_dir"]


@dataclass
class Stage:
    """A staged output.  ``dir``: the partial directory; ``path``: where the output is written (``dir``, or a file
    ``dir / DST.name`` for a one-file output); ``stale``: the notes on removed leftovers of dead runs."""

    dst: Path
    force: bool
    dir: Path
    path: Path
    stale: list[str]
    published: bool = False
    interrupts: list[str] = field(default_factory=list)
    _scratch: list[Path] = field(default_factory=list)

    def written(self) -> None:
        """The output is written, not yet verified (the fault point ``written``)."""
        fault_point("written")

    def publish(self) -> None:
        """Rename the verified output to DST (with ``force``, replacing an existing one)."""
        fault_point("verified")
        publish(self.path, self.dst, self.force)
        self.published = True
        fault_point("published")

    def scratch(self) -> Path:
        """Another marked working directory of DST, for intermediates (removed when the scope ends)."""
        d = make_partial_dir(self.dst)
        self._scratch.append(d)
        return d


@contextlib.contextmanager
def staged_output(dst: Path, force: bool, *, warnings: list[str] | None = None, file: bool = False
                  ) -> Iterator[Stage]:
    """The scope of a staged output (see the module docstring).  ``file``: DST is one file (``stage.path`` is
    ``DST.name`` inside the partial directory), else a directory (``stage.path`` is the partial directory)."""
    dst = Path(dst)
    removed: list[str] = []
    d = make_partial_dir(dst, removed)
    stage = Stage(dst, force, d, d / dst.name if file else d, stale_note(removed))
    if warnings is not None:
        warnings.extend(stage.stale)
    ok = False
    try:
        fault_point("partial")
        yield stage
        ok = True
    except BaseException as e:
        err = name_unnamed_os_error(e, None if stage.published else stage.path)
        if err is e:
            raise
        raise err from None
    finally:
        for p in stage._scratch:
            remove_path(p)
        if not stage.published:
            remove_path(stage.path)
        if stage.path != d:
            remove_path(d)
        stage.interrupts = lower_shield()
        if ok and warnings is not None:
            warnings.extend(stage.interrupts)


@dataclass
class Scratch:
    """A marked working directory of DST that is never published (``path``); ``stale`` as in ``Stage``."""

    path: Path
    stale: list[str]


@contextlib.contextmanager
def scratch_dir(dst: Path) -> Iterator[Scratch]:
    """A marked working directory next to DST for an intermediate, removed when the scope ends."""
    removed: list[str] = []
    d = make_partial_dir(Path(dst), removed)
    try:
        yield Scratch(d, stale_note(removed))
    finally:
        remove_path(d)
