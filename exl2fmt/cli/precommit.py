"""``exl2fmt-pre-commit``: the entry of the ``exl2fmt-validate`` pre-commit hook (``.pre-commit-hooks.yaml``).

pre-commit passes the changed files that match the hook's ``files`` pattern (``*.safetensors``, safetensors
indexes, ``config.json``, ``quantize_config.json``).  They are mapped to their model directories - the folder
that holds the file, counted once however many of its files changed, and only if it holds a ``*.safetensors``
file or an index (a lone ``config.json`` elsewhere in the repository is not a model) - and ``exl2fmt validate``
runs once per directory, in a child process so that every directory gets the CLI's own output and exit code.

    exl2fmt-pre-commit [validate options ...] [--] FILE ...

Options before the files (``args:`` in the user's ``.pre-commit-config.yaml``, e.g. ``[--strict]`` or
``[--format, github]``) are passed to every ``validate``.  Exit code: the highest of the runs (0 when no model
directory changed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["model_dirs", "main"]

_MODEL_FILES = (".safetensors", ".safetensors.index.json")
_VALUE_OPTIONS = {"--format", "--reference", "--revision", "--device", "--kernel-m", "--prompt-ids"}


def _is_model_dir(d: Path) -> bool:
    try:
        return any(p.is_file() and p.name.endswith(_MODEL_FILES) for p in d.iterdir())
    except OSError:
        return False


def model_dirs(files: list[str]) -> list[str]:
    """The model directories of the changed ``files``, in first-seen order (files that are gone are skipped:
    a deletion is not a model to validate)."""
    out: list[str] = []
    seen: set[str] = set()
    for f in files:
        d = Path(f).parent if Path(f).parent != Path("") else Path(".")
        key = os.path.normpath(str(d))
        if key in seen:
            continue
        seen.add(key)
        if _is_model_dir(d):
            out.append(str(d))
    return out


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    opts, files = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            files += argv[i + 1:]
            break
        if a.startswith("-"):
            opts.append(a)
            if a in _VALUE_OPTIONS and i + 1 < len(argv):
                opts.append(argv[i + 1])
                i += 1
        else:
            files.append(a)
        i += 1
    return opts, files


def main(argv: list[str] | None = None) -> int:
    opts, files = _split(list(sys.argv[1:] if argv is None else argv))
    dirs = model_dirs(files)
    worst = 0
    for d in dirs:
        r = subprocess.run([sys.executable, "-m", "exl2fmt.cli.app", "validate", d, *opts])
        worst = max(worst, r.returncode)
    return worst


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
