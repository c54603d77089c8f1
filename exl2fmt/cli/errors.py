"""Exception -> message and exit code: the CLI's one table.

=====  ===========================================================================================
exit   meaning
=====  ===========================================================================================
0      success (validate: no check failed; warnings allowed unless --strict)
1      the input was read and breaks a rule (``Category.INVALID``; validate: a check failed)
2      the command line is wrong (``Category.USAGE``; also click/typer usage errors)
3      the input cannot be read or is not a supported kind of file (``Category.UNREADABLE``, ``OSError``)
4      internal error: a bug in exl2fmt.  One line; the traceback only with --debug or EXL2FMT_DEBUG=1
130    interrupted (Ctrl-C)
141    stdout was closed early (broken pipe, e.g. ``exl2fmt inspect DIR | head``); nothing is printed
=====  ===========================================================================================

``Exl2Error`` and ``OSError`` never print a traceback.
"""

from __future__ import annotations

import os
import sys

from ..errors import Category, Exl2Error

__all__ = ["Interrupted", "interrupt_handler", "EXIT_OK", "EXIT_INVALID", "EXIT_USAGE", "EXIT_UNREADABLE",
           "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_BROKEN_PIPE", "EXIT_FOR_CATEGORY", "exit_code_for",
           "debug_enabled", "set_debug", "handle_exception"]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_UNREADABLE = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

EXIT_FOR_CATEGORY = {
    Category.INVALID: EXIT_INVALID,
    Category.USAGE: EXIT_USAGE,
    Category.UNREADABLE: EXIT_UNREADABLE,
}


class Interrupted(BaseException):
    """SIGINT in the CLI process (``main`` installs the handler).  Not a KeyboardInterrupt, which click would
    turn into "Aborted!" and exit 1 outside a command body; every layer maps it to exit 130."""


def interrupt_handler(signum, frame) -> None:  # noqa: ARG001 - signal handler protocol
    raise Interrupted()


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, Exl2Error):
        return EXIT_FOR_CATEGORY[exc.code.category]
    if isinstance(exc, BrokenPipeError):
        return EXIT_BROKEN_PIPE
    if isinstance(exc, OSError):
        return EXIT_UNREADABLE
    if isinstance(exc, (KeyboardInterrupt, Interrupted)):
        return EXIT_INTERRUPTED
    return EXIT_INTERNAL


_DEBUG = {"on": False}


def set_debug(flag: bool) -> None:
    """The global ``--debug`` (set by the root callback): every command's exception boundary sees it."""
    _DEBUG["on"] = bool(flag)


def debug_enabled(flag: bool = False) -> bool:
    return bool(flag) or _DEBUG["on"] or os.environ.get("EXL2FMT_DEBUG", "") not in ("", "0")


def _extra_error(exc: BaseException):
    from ..extras import missing_extra

    return missing_extra(exc)


def _print_traceback(exc: BaseException) -> None:
    import traceback  # only with --debug: the CLI's start-up does not pay for it

    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


def handle_exception(exc: BaseException, out, *, debug: bool = False) -> int:
    """Report ``exc`` through the output sink ``out`` and return the exit code."""
    code = exit_code_for(exc)
    if isinstance(exc, BrokenPipeError):
        # the reader went away: say nothing, and keep Python from complaining when it flushes stdout at exit
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return code
    if isinstance(exc, Exl2Error):
        out.error(exc.code.value, exc.message, file=exc.file, tensor=exc.tensor,
                  category=exc.code.category.value, exit_code=code)
    elif isinstance(exc, OSError):
        out.error("IO_ERROR", exc.strerror or str(exc), file=getattr(exc, "filename", None),
                  category=Category.UNREADABLE.value, exit_code=code)
    elif isinstance(exc, (KeyboardInterrupt, Interrupted)):
        out.error("INTERRUPTED", "interrupted; nothing was published", exit_code=code)
    elif _extra_error(exc) is not None:   # an optional package missing on a path no pre-check foresaw
        e = _extra_error(exc)
        out.error(e.code.value, e.message, category=e.code.category.value, exit_code=EXIT_UNREADABLE)
        code = EXIT_UNREADABLE
        if debug_enabled(debug):
            _print_traceback(exc)
    else:
        hint = None if debug_enabled(debug) else "run with --debug (or EXL2FMT_DEBUG=1) for the traceback"
        out.error("INTERNAL", f"internal error: {type(exc).__name__}: {exc}", category="internal",
                  exit_code=code, hint=hint)
        if debug_enabled(debug):
            _print_traceback(exc)
    return code
