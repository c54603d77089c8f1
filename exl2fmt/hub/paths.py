"""``hf://ORG/REPO[@REVISION][/PATH]`` references, and the check on names from the server before they name a
local file (``unsafe_name``; the package docstring of ``exl2fmt.hub`` has the whole story)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..errors import ErrorCode, Exl2Error

__all__ = ["HUB_SCHEME", "MAX_NAME_BYTES", "MAX_PATH_BYTES", "HubRef", "is_hub_uri", "parse_hub_uri", "unsafe_name",
           "show_name", "hub_error"]

HUB_SCHEME = "hf://"
MAX_NAME_BYTES = 255
"""Longest file name (one path component, UTF-8) taken from a listing: what local file systems hold."""
MAX_PATH_BYTES = 1024
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_error(code: ErrorCode, message: str, file: str | None = None) -> Exl2Error:
    return Exl2Error(code, message, file=file)


@dataclass(frozen=True)
class HubRef:
    """``hf://repo_id[@revision][/path]``: ``revision`` None means the default branch (main); ``path`` is a folder
    or a file inside the repository ("" = its root)."""

    repo_id: str
    revision: str | None = None
    path: str = ""

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def uri(self, name: str | None = None) -> str:
        """The display form, e.g. ``hf://org/repo@4.0bpw/model.safetensors``."""
        at = f"@{self.revision}" if self.revision else ""
        parts = [p for p in (self.path, name) if p]
        if name and self.path and name.startswith(self.path.rstrip("/") + "/"):
            parts = [name]
        tail = "/".join(parts)
        return f"{HUB_SCHEME}{self.repo_id}{at}" + (f"/{tail}" if tail else "")


def is_hub_uri(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(HUB_SCHEME)


def parse_hub_uri(uri: str, revision: str | None = None) -> HubRef:
    """Parse ``hf://ORG/REPO[@REVISION][/PATH]`` (``%2F`` in a revision is a ``/``; ``@refs/pr/N`` and
    ``@refs/convert/X`` are recognised whole).  ``revision`` (``--revision``) fills in or must agree."""
    if not is_hub_uri(uri):
        raise Exl2Error(ErrorCode.USAGE, f"expected hf://ORG/REPO[@REVISION], found {uri!r}")
    rest = uri[len(HUB_SCHEME):].strip("/")
    segs = rest.split("/")
    if len(segs) < 2:
        raise Exl2Error(ErrorCode.USAGE, f"expected hf://ORG/REPO[@REVISION][/PATH], found {uri!r}")
    org, repo_rev, tail = segs[0], segs[1], segs[2:]
    rev = None
    if "@" in repo_rev:
        repo, rev = repo_rev.split("@", 1)
        if rev in ("refs",) and len(tail) >= 2 and tail[0] in ("pr", "convert"):
            rev, tail = f"refs/{tail[0]}/{tail[1]}", tail[2:]
        rev = unquote(rev)
        if not rev:
            raise Exl2Error(ErrorCode.USAGE, f"empty revision after '@' in {uri!r}")
    else:
        repo = repo_rev
    repo_id = f"{org}/{repo}"
    if not _REPO_RE.match(repo_id) or ".." in repo_id:
        raise Exl2Error(ErrorCode.USAGE, f"expected a repository id ORG/NAME (letters, digits, '.', '_', '-'), "
                        f"found {repo_id!r}")
    if any(p in ("", ".", "..") for p in tail):
        raise Exl2Error(ErrorCode.USAGE, f"expected a plain path inside the repository, found {'/'.join(tail)!r}")
    why = unsafe_name("/".join(tail)) if tail else None
    if why:
        raise Exl2Error(ErrorCode.USAGE, f"expected a plain path inside the repository, found "
                        f"{show_name('/'.join(tail))}: {why}")
    if revision is not None:
        if rev is not None and rev != revision:
            raise Exl2Error(ErrorCode.USAGE, f"--revision {revision} contradicts @{rev} in {uri}")
        rev = revision
    return HubRef(repo_id, rev, "/".join(tail))


def show_name(name: str, limit: int = 120) -> str:
    """A name from the server, safe to print: escaped (``ascii``) and cut."""
    a = ascii(name)
    return a if len(a) <= limit else a[:limit] + "...'"


def unsafe_name(path: str) -> str | None:
    """Why a repository path (from a listing, or the user's ``hf://`` path) cannot name a local image file, or
    None: control / format characters (NUL, newlines, bidi overrides ...), a backslash, an absolute path, an
    empty, ``.`` or ``..`` segment, a component over ``MAX_NAME_BYTES`` or a path over ``MAX_PATH_BYTES``."""
    import unicodedata

    if not isinstance(path, str) or not path:
        return "an empty name"
    for ch in path:
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp") or ch == "\\":
            return f"the character U+{ord(ch):04X} (a control, format or separator character)"
    if len(path.encode("utf-8")) > MAX_PATH_BYTES:
        return f"a path longer than {MAX_PATH_BYTES} bytes"
    if path.startswith("/"):
        return "an absolute path"
    for seg in path.split("/"):
        if seg in ("", ".", ".."):
            return "an empty, '.' or '..' path segment"
        if len(seg.encode("utf-8")) > MAX_NAME_BYTES:
            return f"a file name longer than {MAX_NAME_BYTES} bytes"
    return None
