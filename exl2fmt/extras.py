"""Optional extras: which command needs which package, checked before any work is done.

The core (inspect / validate / dequantize / the exact converters) needs only numpy, numba, safetensors, rich and
typer.  Other paths need an *extra* (``pyproject.toml`` ``[project.optional-dependencies]``):

===========  =========================================  ===============================================
extra        packages                                   needed by
===========  =========================================  ===============================================
quant        torch, tokenizers                          ``convert FP16_DIR DST --to exl2|gptq`` (the quantizer)
gguf         gguf                                       ``convert ... --to gguf``, a ``.gguf`` SRC, ``inspect x.gguf``
kernels      torch, triton                              ``validate --kernel`` / ``--run``
distributed  ray                                        ``convert ... --to exl2|gptq --workers N`` / ``--ray-address``
===========  =========================================  ===============================================

``require(extra, what)`` imports the extra's modules and raises ``Exl2Error(UNSUPPORTED_INPUT)`` (exit 3) naming
the missing package and the ``pip install 'exl2fmt[extra]'`` command, the way ``inspect x.gguf`` answers without
the gguf package.  The package list is read from the installed distribution's metadata (so it follows
``pyproject.toml``), with the table above as the fallback.  ``missing_extra(exc)`` maps an ``ImportError`` raised
later (a path the pre-check did not foresee) to the same message, for the CLI's exception boundary.
"""

from __future__ import annotations

import importlib
import re

from .errors import ErrorCode, Exl2Error

__all__ = ["require", "missing_extra", "EXTRA_PACKAGES"]

#: The fallback when the distribution's metadata cannot be read (a source checkout on sys.path).
EXTRA_PACKAGES: dict[str, tuple[str, ...]] = {
    "quant": ("torch", "tokenizers"),
    "gguf": ("gguf",),
    "kernels": ("torch", "triton"),
    "distributed": ("ray",),
}

#: distribution name -> import name, where they differ
_IMPORT_NAME = {"auto-gptq": "auto_gptq", "pyyaml": "yaml"}
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def packages_of(extra: str) -> tuple[str, ...]:
    """The import names of the packages ``extra`` installs, in the metadata's order."""
    try:
        from importlib.metadata import requires

        reqs = requires("exl2fmt") or []
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or broken metadata: use the table
        reqs = []
    found = []
    for r in reqs:
        m, e = _REQ.match(r), _EXTRA.search(r)
        if m and e and e.group(1) == extra:
            name = m.group(1).lower()
            name = _IMPORT_NAME.get(name, name.replace("-", "_"))
            if name not in found:
                found.append(name)
    return tuple(found) or EXTRA_PACKAGES.get(extra, ())


def _message(what: str, missing: list[str], extra: str) -> str:
    pk = " and ".join(missing)
    return (f"{what} needs the optional package{'s' if len(missing) > 1 else ''} {pk}, which "
            f"{'are' if len(missing) > 1 else 'is'} not installed: pip install 'exl2fmt[{extra}]'")


def require(extra: str, what: str, *, file: str | None = None) -> None:
    """Import every package of ``extra``; ``Exl2Error(UNSUPPORTED_INPUT)`` naming the missing ones and the pip
    command when one cannot be imported.  ``what`` says what needs them ("converting to GGUF")."""
    missing = []
    for mod in packages_of(extra):
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, _message(what, missing, extra), file=file)


def missing_extra(exc: BaseException) -> Exl2Error | None:
    """The extras message for an ``ImportError`` of a package that belongs to an extra (None otherwise)."""
    if not isinstance(exc, ImportError):
        return None
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if not name:
        m = re.search(r"(?:named|module)\s+'?([A-Za-z0-9_]+)", str(exc))
        name = m.group(1) if m else ""
    for extra in ("quant", "gguf", "kernels"):
        if name and name in packages_of(extra):
            return Exl2Error(ErrorCode.UNSUPPORTED_INPUT, _message("this command", [name], extra))
    return None
