"""The ``exl2fmt`` entry point (``exl2fmt.cli.app:main``, also ``python -m exl2fmt.cli.app``).

Plain ``inspect`` and ``validate`` command lines run without typer: importing typer and building its command tree
costs more than inspecting a 70B model's headers (bench/RESULTS.md, issue 18), and those two commands are the ones
run in loops and CI gates.  ``fast_args`` recognises exactly the command lines of ``FAST`` below - the command,
one path and a few flags, in any order - and hands every other command line (``--help``, any other option, an
option value, a second argument, a path starting with ``-``, ``--``, other commands) to the typer app in
``exl2fmt.cli.commands``, which owns the syntax and its messages.  Both routes call the same functions
(``exl2fmt.cli.checks``), so they print the same bytes and exit with the same code; tests/test_cli.py parses
every combination of these flags and of every option the typer commands declare with both parsers and requires
the same values from each, or a hand-over to typer.

``app`` and the other names of ``exl2fmt.cli.commands`` are available here too (loaded on first use).
"""

from __future__ import annotations

import os
import sys

__all__ = ["app", "main", "fast_args", "set_runtime_env", "FAST"]

#: command -> ({flag: (parameter, value)}, {"--option": parameter} taking one value, defaults of every parameter of
#: the typer command).  A flag may repeat; the last of ``--layers`` / ``--no-layers`` wins, as in click.
FAST: dict[str, tuple[dict[str, tuple[str, bool]], dict[str, str], dict[str, object]]] = {
    "inspect": (
        {"--json": ("json_", True), "--markdown": ("markdown", True), "--layers": ("layers", True),
         "--no-layers": ("layers", False), "--debug": ("debug", True)},
        {},
        {"json_": False, "markdown": False, "layers": True, "revision": None, "debug": False},
    ),
    "validate": (
        {"--json": ("json_", True), "--markdown": ("markdown", True), "--strict": ("strict", True),
         "--deep": ("deep", True), "--debug": ("debug", True)},
        {"--format": "fmt"},
        {"deep": False, "reference": None, "fix_index": False, "strict": False, "kernel": False, "run": False,
         "prompt_ids": None, "device": None, "kernel_m": None, "json_": False, "markdown": False, "fmt": None,
         "revision": None, "debug": False},
    ),
}


def fast_args(argv: list[str]) -> tuple[str, bool, dict] | None:
    """``(command, debug, keyword arguments of its checks function)`` for a command line of ``FAST``, else None
    (typer's to parse).  ``argv`` excludes the program name; ``--debug`` may come first, any number of times, and
    after the command (it is then taken out of the keyword arguments: either place turns it on)."""
    i = 0
    while i < len(argv) and argv[i] == "--debug":
        i += 1
    if i >= len(argv) or argv[i] not in FAST:
        return None
    cmd = argv[i]
    flags, valued, defaults = FAST[cmd]
    kw = dict(defaults)
    path = None
    rest = argv[i + 1:]
    j = 0
    while j < len(rest):
        tok = rest[j]
        j += 1
        if tok in flags:
            name, value = flags[tok]
            kw[name] = value
            continue
        opt, eq, value = tok.partition("=")
        if opt in valued:
            if not eq:
                if j >= len(rest):
                    return None
                value = rest[j]
                j += 1
            if not value or value.startswith("-"):
                return None
            kw[valued[opt]] = value
            continue
        if path is not None or not tok or tok.startswith("-"):
            return None
        path = tok
    if path is None:
        return None
    kw["path"] = path
    debug = kw.pop("debug")
    return cmd, i > 0 or debug, kw


#: OpenMP spin-wait of the compute threads (torch's and Numba's libgomp) before they sleep, unless the user set
#: ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``.  libgomp's default (300 000 spins) burns a second core for up to a
#: few hundred microseconds after every parallel op; 10 000 spins kept the 1B quantizer's wall time and cut the
#: fixture GPTQ run's CPU time by ~0.6 s (bench/RESULTS.md, issue 18).  Read once, when libgomp loads.
GOMP_SPINCOUNT = "10000"
#: torch's CPU allocator puts allocations of 2 MB and more on transparent huge pages (``THP_MEM_ALLOC_ENABLE``,
#: read at its first allocation) for ``convert --to exl2``, unless the user set it: the 1B EXL2 quantizer's peak
#: resident set -50 to -70 MB at the same wall time.  Not for other commands: on the fixture's GPTQ run the huge
#: pages cost ~0.3 s more system time and saved nothing that matters (bench/RESULTS.md, issue 18).
THP_MEM_ALLOC_ENABLE = "1"


def _quantizes_exl2(argv: list[str]) -> bool:
    """Whether a command line is ``convert ... --to exl2`` (also ``--to=exl2``, ``-t exl2``): a scan, not a parse
    (typer parses later; a wrong guess only changes how torch allocates)."""
    if "convert" not in argv:
        return False
    for i, tok in enumerate(argv):
        if tok in ("--to", "-t") and i + 1 < len(argv) and argv[i + 1] == "exl2":
            return True
        if tok in ("--to=exl2", "-texl2"):
            return True
    return False


def set_runtime_env(argv: list[str], env=os.environ) -> None:
    """What the exl2fmt command sets in its own environment (``env``) for the command line ``argv`` (without the
    program name), before anything imports torch or runs a parallel Numba kernel.  A library caller's process is
    its own; a benchmark that runs the quantizer in-process calls this to measure what the command runs."""
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    if _quantizes_exl2(argv):
        env.setdefault("THP_MEM_ALLOC_ENABLE", THP_MEM_ALLOC_ENABLE)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``exl2fmt``)."""
    import signal

    set_runtime_env(sys.argv[1:] if argv is None else argv)

    from .errors import EXIT_INTERRUPTED, Interrupted, interrupt_handler

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # leave an ignored SIGINT ignored
        signal.signal(signal.SIGINT, interrupt_handler)
    try:
        # a shell-completion request is typer's (it answers it from the full command tree)
        fast = None if os.environ.get("_EXL2FMT_COMPLETE") else fast_args(sys.argv[1:] if argv is None else argv)
        if fast is not None:
            from . import checks
            from .errors import set_debug

            cmd, debug, kw = fast
            set_debug(debug)  # what typer's root callback does with --debug
            if cmd == "inspect" or not kw["deep"]:
                # header-only work allocates tens of thousands of small objects (entries, rows) and frees them
                # at exit: the cyclic collector would walk them again and again (~10% of inspect's time) and find
                # nothing to collect; reference counting still frees everything that is dropped
                import gc

                gc.disable()
            run = checks.inspect_command if cmd == "inspect" else checks.validate_command
            sys.exit(run(**kw, debug=debug))
        from .commands import app

        app(args=argv, prog_name="exl2fmt")
    except Interrupted:  # before or after a command body (start-up, option parsing)
        sys.stderr.write("error: [INTERRUPTED] interrupted\n")
        sys.exit(EXIT_INTERRUPTED)


def __getattr__(name: str):
    """``app`` and the rest of ``exl2fmt.cli.commands`` (the typer app), imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    from . import commands

    try:
        return getattr(commands, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


if __name__ == "__main__":  # python -m exl2fmt.cli.app
    main()
