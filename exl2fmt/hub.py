"""Models on the Hugging Face Hub, read without downloading them: ``hf://ORG/REPO[@REVISION][/PATH]``.

EXL2 models are published as one branch per bitrate (``4.0bpw``, ``6.5bpw``, ...) of tens of GB each.
``inspect`` and the structural checks of ``validate`` only need the safetensors headers, ``config.json``, the
index and - for the EXL2 group plans - the tiny ``q_groups`` tables, so this module fetches exactly those bytes
with HTTP range requests and nothing else.

How a model is read (``fetch_snapshot``)
----------------------------------------
1. The folder is listed with the Hub's tree API (``GET {endpoint}/api/models/{repo}/tree/{revision}/{path}``,
   the endpoint ``HfApi.list_repo_tree`` calls, paginated by ``Link`` headers).  A revision that does not exist
   is answered with the repository's branches and tags (``GET .../refs``, as ``HfApi.list_repo_refs``).
2. Every file that is read gets one ``HEAD`` through ``huggingface_hub.get_hf_file_metadata`` on the URL of
   ``hf_hub_url``: its size (``X-Linked-Size``), the commit (``X-Repo-Commit``) and where the bytes are (the CDN
   location of a redirect).  The first answer pins the commit: every later file is read at that commit, so a
   branch that moves during the read cannot mix two versions.
3. ``config.json``, ``quantize_config.json`` and ``*.safetensors.index.json`` are read whole (at most
   ``MAX_JSON_BYTES`` each).  Each ``*.safetensors`` file is read with two range requests: bytes ``[0, 8)`` (the
   header length ``n``, checked against ``exl2fmt.container.MAX_HEADER_BYTES`` and the file size before anything
   is allocated) and ``[8, 8 + n)``; the header is then validated by ``exl2fmt.container.parse_header`` (the one
   parser of the project).  EXL2 ``*.q_groups`` tensors (I16, at most ``MAX_GROUPS_BYTES``) are read by range too.
   A ``.gguf`` file (``hf://ORG/REPO/x.gguf``) is read in growing prefixes until the project's GGUF pre-scan
   finds its whole header inside bytes actually fetched (``_fetch_gguf``; GGUF does not state its header length).
4. The bytes land in a *sparse* local image of each file (its real size, holes everywhere else) in a temporary
   directory, which ``exl2fmt.inspect`` / ``exl2fmt.validate`` then open like any local model: the same report, the
   same rules.  Nothing there reads the holes (``validate --deep`` is refused for ``hf://`` paths).  A filesystem
   that cannot hold sparse files is detected (allocated blocks are checked) and refused.

Hardening
---------
* Every response body is streamed and cut at the expected length: a range answered with ``200`` (the whole file),
  a wrong ``Content-Range``, a body longer than the range (an endless body) or a JSON document past its cap is
  ``HUB_BAD_RESPONSE`` after reading at most one chunk beyond the expected length.
* At most ``MAX_BYTES_PER_FILE`` are fetched per file, and at most a byte budget per command
  (``EXL2FMT_HUB_MAX_BYTES``: bytes or e.g. ``512M``, default ``DEFAULT_MAX_TOTAL_BYTES`` = 256 MiB) over all
  requests: a range is counted before it is asked for, other bodies as they arrive (``HUB_FETCH_LIMIT``);
  declared sizes above ``MAX_FILE_SIZE`` are refused.  A ``.gguf`` file's 24-byte preamble (magic, version,
  counts) is checked before anything more of it is asked for.
* Time: each request (listing page, HEAD, ranged GET, each redirect hop) has a wall-clock deadline of
  ``EXL2FMT_HUB_TIMEOUT`` seconds (default 60) that also holds while the response headers trickle in (the HTTP
  library's read timeout restarts at every byte; the request runs in a thread the caller stops waiting for), and
  the command's reads together a deadline of ``EXL2FMT_HUB_TOTAL_TIMEOUT`` seconds (default 600):
  ``HUB_UNREACHABLE`` naming the ``hf://`` file.
* Names from the server are checked before they name a local file (``unsafe_name``: control and format
  characters, backslashes, absolute paths, ``.``/``..``/empty segments, components over 255 bytes): a listing
  with such a name is ``HUB_BAD_RESPONSE``, the name printed escaped; errors about the local image name the
  ``hf://`` path, never the temporary directory.
* Redirects are followed by hand, at most ``MAX_REDIRECTS``, to ``http(s)`` URLs only and never from ``https`` to
  ``http``.  The token (``HF_TOKEN`` or the saved login, through ``huggingface_hub.utils.build_hf_headers``) is
  only sent to the endpoint's own origin (scheme, host, port): a redirect to another host - the Hub's CDN hands
  out signed URLs - is followed without it.  (The metadata ``HEAD`` follows ``get_hf_file_metadata``'s own rule:
  redirects on the same or a known Hub origin only; it stops at the CDN redirect and reads the size from it.)
* ``HF_ENDPOINT`` selects the server (a mirror, or a local emulation in the tests); ``HF_HUB_OFFLINE=1`` refuses
  with ``HUB_UNREACHABLE``.

Stable codes: ``HUB_NOT_FOUND`` (repository, revision or file missing), ``HUB_ACCESS_DENIED`` (401/403, gated),
``HUB_UNREACHABLE`` (network, timeout, 429/5xx, offline), ``HUB_BAD_RESPONSE``, ``HUB_FETCH_LIMIT``, and the
container's own codes (``HEADER_TOO_LARGE`` ...) for a malformed header.  Without ``huggingface_hub``:
``UNSUPPORTED_INPUT`` with ``pip install 'exl2fmt[hub]'`` (exit 3).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urljoin, urlsplit

from .container import jsonload
from .errors import ErrorCode, Exl2Error
from .layout import Exl2Slot

__all__ = ["HUB_SCHEME", "READ_CHUNK", "HubClient", "MAX_JSON_BYTES", "MAX_GROUPS_BYTES", "MAX_BYTES_PER_FILE", "MAX_FILE_SIZE", "MAX_REDIRECTS",
           "HubRef", "HubStats", "HubSnapshot", "is_hub_uri", "parse_hub_uri", "fetch_snapshot", "inspect_hub",
           "validate_hub", "reference_shape_checks", "rewrite_paths", "unsafe_name", "DEFAULT_MAX_TOTAL_BYTES",
           "DEFAULT_TOTAL_TIMEOUT", "MAX_NAME_BYTES", "MAX_PATH_BYTES", "GGUF_PREAMBLE"]

HUB_SCHEME = "hf://"
MAX_JSON_BYTES = 32 << 20
"""Largest JSON document read from the Hub (config.json, an index, one page of a listing)."""
MAX_GROUPS_BYTES = 4 * 32767
"""Largest ``q_groups`` tensor fetched: shape (2G,) I16 is 4 bytes a group, G <= 32767."""
MAX_BYTES_PER_FILE = 8 + 100_000_000 + (16 << 20)
"""Most bytes fetched from one file: the largest header the parser accepts plus the q_groups tables."""
MAX_FILE_SIZE = 1 << 40
"""Largest declared file size accepted (the Hub itself stores files of at most 50 GB)."""
MAX_REDIRECTS = 5
DEFAULT_MAX_TOTAL_BYTES = 256 << 20
"""Default byte budget of one command (every body byte of every request together; ``EXL2FMT_HUB_MAX_BYTES``
raises or lowers it): real EXL2 models need a few MB (headers, config, q_groups), the largest legal header
(``MAX_HEADER_BYTES``, 100 MB) fits twice."""
DEFAULT_TOTAL_TIMEOUT = 600.0
"""Default wall-clock deadline of one command's Hub reads, in seconds (``EXL2FMT_HUB_TOTAL_TIMEOUT``)."""
MAX_NAME_BYTES = 255
"""Longest file name (one path component, UTF-8) taken from a listing: what local file systems hold."""
MAX_PATH_BYTES = 1024
MAX_LIST_PAGES = 100
MAX_LIST_ENTRIES = 100_000
READ_CHUNK = 1 << 16
_JSON_FILES = ("config.json", "quantize_config.json")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _hub_err(code: ErrorCode, message: str, file: str | None = None) -> Exl2Error:
    return Exl2Error(code, message, file=file)


# ------------------------------------------------------------------------------------------------ URIs


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
                        f"{_show('/'.join(tail))}: {why}")
    if revision is not None:
        if rev is not None and rev != revision:
            raise Exl2Error(ErrorCode.USAGE, f"--revision {revision} contradicts @{rev} in {uri}")
        rev = revision
    return HubRef(repo_id, rev, "/".join(tail))


# ------------------------------------------------------------------------------------------------ HTTP


@dataclass
class HubStats:
    """What a read cost: body bytes received (all of them, counted as they arrive), requests made."""

    bytes_fetched: int = 0
    requests: int = 0
    per_file: dict = field(default_factory=dict)


def _import_hub():
    try:
        import huggingface_hub  # noqa: F401  (optional extra)
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session
    except ImportError:
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, "this is a Hugging Face Hub path; reading it needs the optional "
                        "huggingface_hub package: pip install 'exl2fmt[hub]'") from None
    return constants, get_hf_file_metadata, hf_hub_url, build_hf_headers, get_session


def _origin(url: str) -> tuple[str, str, int]:
    p = urlsplit(url)
    default = {"http": 80, "https": 443}.get(p.scheme, 0)
    try:
        port = p.port or default
    except ValueError:
        port = -1
    return p.scheme, (p.hostname or "").lower(), port


def _timeout() -> float:
    try:
        return max(0.1, float(os.environ.get("EXL2FMT_HUB_TIMEOUT", "60")))
    except ValueError:
        return 60.0


def _total_timeout() -> float:
    try:
        v = float(os.environ.get("EXL2FMT_HUB_TOTAL_TIMEOUT", str(DEFAULT_TOTAL_TIMEOUT)))
    except ValueError:
        return DEFAULT_TOTAL_TIMEOUT
    return max(0.1, v) if v == v else DEFAULT_TOTAL_TIMEOUT


def _byte_budget() -> int:
    """``EXL2FMT_HUB_MAX_BYTES``: bytes, or with a K / M / G suffix (powers of 1024); a usage error otherwise."""
    raw = os.environ.get("EXL2FMT_HUB_MAX_BYTES", "").strip()
    if not raw:
        return DEFAULT_MAX_TOTAL_BYTES
    m = re.fullmatch(r"([0-9]{1,15})\s*([KkMmGg]?)[iI]?[bB]?", raw)
    if not m or int(m.group(1)) <= 0:
        raise Exl2Error(ErrorCode.USAGE, f"EXL2FMT_HUB_MAX_BYTES must be a positive number of bytes (e.g. "
                        f"512M or 1G), found {raw[:40]!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def _show(name: str, limit: int = 120) -> str:
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


def _call_by(deadline: float, fn, on_timeout):
    """``fn()`` in a daemon thread, its result or its exception; ``on_timeout()`` is raised at ``deadline``
    (time.monotonic) if it has not returned - the only way to bound a call that blocks inside the HTTP library
    while a server trickles its response headers (its read timeout restarts at every byte).  The abandoned
    thread ends with its connection (it holds nothing of the caller's)."""
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["e"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="exl2fmt-hub-request", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise on_timeout()
    if "e" in box:
        raise box["e"]
    return box["r"]


class HubClient:
    """Bounded GETs (``get``, ``get_json``), metadata HEADs (``metadata``) and listings (``list_folder``) for one
    read of one repository; ``stats`` counts every body byte as it arrives (thread-safe)."""

    def __init__(self, ref: HubRef):
        (self.constants, self._get_meta, self._hub_url, self._build_headers, get_session) = _import_hub()
        env_offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        if env_offline or self.constants.is_offline_mode():
            raise _hub_err(ErrorCode.HUB_UNREACHABLE, "HF_HUB_OFFLINE is set: the Hub cannot be reached",
                           ref.uri())
        self.ref = ref
        self.endpoint = (os.environ.get("HF_ENDPOINT") or self.constants.ENDPOINT).rstrip("/")
        self.session = get_session()
        # the HTTP library huggingface_hub is built on (httpx for 1.x, its httpx2 fork later): its exceptions
        import importlib

        self.http = importlib.import_module(type(self.session).__module__.split(".")[0])
        self.timeout = _timeout()
        self.total_timeout = _total_timeout()
        self.total_deadline = time.monotonic() + self.total_timeout
        self.budget = _byte_budget()
        self._committed = 0  # bytes of ranges asked for + bytes of other bodies received, against the budget
        self.stats = HubStats()
        self._lock = threading.Lock()
        from . import __version__

        self.auth = self._build_headers(library_name="exl2fmt", library_version=__version__)
        self.plain = {k: v for k, v in self.auth.items() if k.lower() != "authorization"}

    # --- errors ---------------------------------------------------------------------------------------
    def _status_error(self, status: int, headers, url: str, what: str) -> Exl2Error:
        xcode = headers.get("X-Error-Code", "") if headers is not None else ""
        xmsg = headers.get("X-Error-Message", "") if headers is not None else ""
        detail = f" ({xmsg[:200]})" if xmsg else ""
        if status in (401, 403) or xcode == "GatedRepo":
            return _hub_err(ErrorCode.HUB_ACCESS_DENIED, f"HTTP {status} for {what}{detail}: the repository is "
                            "private or gated; set HF_TOKEN (or run `hf auth login`) with a token that has access",
                            self.ref.uri())
        if status == 404:
            if xcode == "RevisionNotFound":
                return self._revision_missing()
            if xcode == "RepoNotFound":
                return _hub_err(ErrorCode.HUB_NOT_FOUND, f"no repository {self.ref.repo_id} on {self.endpoint} "
                                "(or it is private: set HF_TOKEN)", self.ref.uri())
            return _hub_err(ErrorCode.HUB_NOT_FOUND, f"HTTP 404 for {what}{detail}", self.ref.uri())
        if status == 429 or status >= 500:
            return _hub_err(ErrorCode.HUB_UNREACHABLE, f"HTTP {status} for {what}{detail}: the server is "
                            "unavailable or rate-limiting; try again later", self.ref.uri())
        return _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"unexpected HTTP {status} for {what}{detail}", self.ref.uri())

    def _revision_missing(self) -> Exl2Error:
        names = []
        try:
            doc = self.get_json(f"{self.endpoint}/api/models/{self.ref.repo_id}/refs", "the list of branches")
            for kind in ("branches", "tags"):
                for item in doc.get(kind) or [] if isinstance(doc, dict) else []:
                    if isinstance(item, dict) and isinstance(item.get("name"), str):
                        nm = item["name"] if not any(c < " " or c == "\x7f" for c in item["name"]) \
                            and len(item["name"]) <= MAX_NAME_BYTES else _show(item["name"], 80)
                        names.append(nm if kind == "branches" else f"{nm} (tag)")
        except Exl2Error:
            pass
        have = (f"; it has: {', '.join(names[:50])}" + (" ..." if len(names) > 50 else "")) if names else ""
        return _hub_err(ErrorCode.HUB_NOT_FOUND, f"no revision {self.ref.rev!r} in {self.ref.repo_id}{have} "
                        "(EXL2 publishers use one branch per bitrate: pick one with @BRANCH or --revision)",
                        self.ref.uri())

    # --- deadlines and the byte budget -------------------------------------------------------------------
    def _deadline(self) -> float:
        """One request's wall-clock deadline: ``timeout`` from now, or the command's total deadline if sooner."""
        return min(time.monotonic() + self.timeout, self.total_deadline)

    def _late(self, what: str, where: str) -> Exl2Error:
        if time.monotonic() >= self.total_deadline - 1e-3:
            why = f"the Hub reads of this command ran past their total deadline of {self.total_timeout:g} s " \
                  "(EXL2FMT_HUB_TOTAL_TIMEOUT)"
        else:
            why = f"no complete answer within {self.timeout:g} s (EXL2FMT_HUB_TIMEOUT)"
        return _hub_err(ErrorCode.HUB_UNREACHABLE, f"{what}: {why}; the server is too slow or holds the "
                        "connection open", where)

    def _over_budget(self, what: str, where: str, n: int) -> Exl2Error:
        return _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"{what}: {n} more bytes would take this command past its "
                        f"budget of {self.budget} bytes fetched (EXL2FMT_HUB_MAX_BYTES; the headers, config and "
                        "q_groups of real models take a few MB)", where)

    def reserve(self, n: int, what: str, where: str) -> None:
        """Count ``n`` bytes about to be asked for against the budget; refuse before asking when they do not fit."""
        with self._lock:
            if self._committed + n > self.budget:
                raise self._over_budget(what, where, n)
            self._committed += n

    # --- one bounded GET ------------------------------------------------------------------------------
    def get(self, url: str, what: str, *, start: int | None = None, length: int | None = None,
            cap: int = MAX_JSON_BYTES, file: str | None = None, expect_size: int | None = None) -> tuple[bytes, Any]:
        """GET ``url`` (bytes ``[start, start + length)`` when ``start`` is given), following at most
        ``MAX_REDIRECTS`` redirects by hand; returns (body, headers).  The body is cut at ``length`` (or ``cap``)."""
        httpx2 = self.http

        want = length if start is not None else cap
        deadline = self._deadline()
        t = httpx2.Timeout(self.timeout, connect=min(self.timeout, 10.0))
        where = file or self.ref.uri()
        if start is not None:
            self.reserve(length, what, where)
        cancel = threading.Event()  # set when the caller gave up on this request (its deadline passed)

        def hop(url: str):
            """One request: ("redirect", target) or ("done", body, headers)."""
            same = _origin(url) == _origin(self.endpoint)
            headers = dict(self.auth if same else self.plain)
            headers["Accept-Encoding"] = "identity"
            if start is not None:
                headers["Range"] = f"bytes={start}-{start + length - 1}"
            with self._lock:
                self.stats.requests += 1
            with self.session.stream("GET", url, headers=headers, follow_redirects=False, timeout=t) as r:
                status = r.status_code
                if 300 <= status < 400 and "location" in r.headers:
                    target = urljoin(url, r.headers["location"])
                    scheme = urlsplit(target).scheme
                    if scheme not in ("http", "https") or (urlsplit(url).scheme == "https" and scheme == "http"):
                        raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: refusing a redirect to "
                                       f"{_show(target)} (only http(s), never https -> http)", where)
                    return ("redirect", target)
                if status >= 400:
                    raise self._status_error(status, r.headers, url, what)
                if start is not None:
                    self._check_range(r, status, start, length, expect_size, what, where)
                elif status != 200:
                    raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: expected HTTP 200, found {status}", where)
                body = bytearray()
                for chunk in r.iter_raw(READ_CHUNK):
                    if cancel.is_set():
                        raise _hub_err(ErrorCode.HUB_UNREACHABLE, f"{what}: abandoned", where)
                    body += chunk
                    with self._lock:
                        self.stats.bytes_fetched += len(chunk)
                        if file is not None:
                            self.stats.per_file[file] = self.stats.per_file.get(file, 0) + len(chunk)
                        if start is None:
                            self._committed += len(chunk)
                            if self._committed > self.budget:
                                raise self._over_budget(what, where, len(chunk))
                    if len(body) > want:
                        if start is not None:
                            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: the server sent more than the "
                                           f"{length} bytes of the requested range; stopped reading", where)
                        raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: larger than the cap of {cap} "
                                       "bytes; stopped reading", where)
                    if time.monotonic() > deadline:
                        raise self._late(what, where)
                if start is not None and len(body) != length:
                    raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: expected {length} bytes of the range, "
                                   f"found {len(body)} (connection closed early?)", where)
                return ("done", bytes(body), r.headers)

        def guarded(url: str):
            try:
                return hop(url)
            except Exl2Error:
                raise
            except httpx2.TimeoutException:
                raise _hub_err(ErrorCode.HUB_UNREACHABLE, f"{what}: timed out after {self.timeout:g} s "
                               "(EXL2FMT_HUB_TIMEOUT)", where) from None
            except (httpx2.HTTPError, httpx2.InvalidURL, OSError, ValueError) as e:
                raise _hub_err(ErrorCode.HUB_UNREACHABLE, f"{what}: cannot reach {_show(_origin(url)[1] or url)}: "
                               f"{type(e).__name__}: {_show(str(e), 200)}", where) from None

        def late():
            cancel.set()
            return self._late(what, where)

        for _hop in range(MAX_REDIRECTS + 1):
            res = _call_by(deadline, lambda: guarded(url), late)
            if res[0] == "redirect":
                url = res[1]
                continue
            return res[1], res[2]
        raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: more than {MAX_REDIRECTS} redirects", where)

    @staticmethod
    def _check_range(r, status, start, length, expect_size, what, where) -> None:
        if status != 206:
            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: asked for bytes {start}-{start + length - 1}, the "
                           f"server answered HTTP {status} instead of 206 Partial Content (it ignores ranges); "
                           "refusing to download the whole file", where)
        cr = r.headers.get("content-range", "")
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", cr.strip())
        if not m or int(m.group(1)) != start or int(m.group(2)) != start + length - 1 or (
                expect_size is not None and m.group(3) != "*" and int(m.group(3)) != expect_size):
            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: asked for bytes {start}-{start + length - 1} of "
                           f"{expect_size}, the server sent Content-Range {cr[:80]!r}", where)
        cl = r.headers.get("content-length")
        if cl is not None and cl.strip() != str(length):
            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: a {length}-byte range with Content-Length "
                           f"{cl[:30]!r}", where)

    def get_json(self, url: str, what: str, file: str | None = None) -> Any:
        body, _ = self.get(url, what, file=file)
        try:  # the guarded loader: value-count / depth caps, every parser error mapped
            return jsonload.loads_json(body, jsonload.HUB_API, file=file)
        except Exl2Error:
            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{what}: expected JSON from the server", file) from None

    # --- HEAD through huggingface_hub -------------------------------------------------------------------
    def metadata(self, filename: str, revision: str):
        """(size, commit, location) of one file, from ``get_hf_file_metadata``."""
        from huggingface_hub import errors as hf_errors

        httpx2 = self.http

        url = self._hub_url(self.ref.repo_id, filename, revision=revision, endpoint=self.endpoint)
        with self._lock:
            self.stats.requests += 1
        where = self.ref.uri(filename)
        try:
            # huggingface_hub's HEAD, under this command's deadline (its own timeout restarts at every byte)
            m = _call_by(self._deadline(), lambda: self._get_meta(url, timeout=self.timeout, library_name="exl2fmt"),
                         lambda: self._late(f"{filename} (HEAD)", where))
        except hf_errors.RevisionNotFoundError:
            raise self._revision_missing() from None
        except hf_errors.GatedRepoError:
            raise self._status_error(403, None, url, filename) from None
        except hf_errors.RepositoryNotFoundError as e:
            st = getattr(getattr(e, "response", None), "status_code", 404)
            if st in (401, 403):
                raise self._status_error(st, None, url, filename) from None
            raise _hub_err(ErrorCode.HUB_NOT_FOUND, f"no repository {self.ref.repo_id} on {self.endpoint} (or it "
                           "is private: set HF_TOKEN)", where) from None
        except hf_errors.EntryNotFoundError:
            raise _hub_err(ErrorCode.HUB_NOT_FOUND, f"no file {filename!r} at revision {self.ref.rev!r}", where) \
                from None
        except hf_errors.HfHubHTTPError as e:
            r = getattr(e, "response", None)
            raise self._status_error(getattr(r, "status_code", 0) or 0, getattr(r, "headers", None), url,
                                     filename) from None
        except httpx2.TooManyRedirects:
            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{filename}: too many redirects", where) from None
        except httpx2.TimeoutException:
            raise _hub_err(ErrorCode.HUB_UNREACHABLE, f"{filename}: timed out after {self.timeout:g} s", where) \
                from None
        except (httpx2.HTTPError, OSError) as e:
            if type(e).__name__ == "OfflineModeIsEnabled":
                raise _hub_err(ErrorCode.HUB_UNREACHABLE, "HF_HUB_OFFLINE is set", where) from None
            raise _hub_err(ErrorCode.HUB_UNREACHABLE, f"{filename}: cannot reach {self.endpoint}: "
                           f"{type(e).__name__}: {str(e)[:200]}", where) from None
        if m.size is None or not isinstance(m.size, int) or m.size < 0:
            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{filename}: the server gave no file size "
                           "(X-Linked-Size / Content-Length)", where)
        if isinstance(m.size, bool) or m.size > MAX_FILE_SIZE:
            raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{filename}: declared size {m.size} bytes exceeds the cap of "
                           f"{MAX_FILE_SIZE}", where)
        return m.size, m.commit_hash, urljoin(url, m.location) if m.location else url

    # --- listings ---------------------------------------------------------------------------------------
    def list_folder(self, path: str, revision: str) -> list[dict]:
        """The files (not folders) directly inside ``path``: [{"path", "size"}]."""
        url = (f"{self.endpoint}/api/models/{self.ref.repo_id}/tree/{quote(revision, safe='')}"
               + (f"/{quote(path, safe='')}" if path else ""))
        out: list[dict] = []
        for _page in range(MAX_LIST_PAGES):
            body, headers = self.get(url, "the file listing")
            try:
                doc = jsonload.loads_json(body, jsonload.HUB_API, file=self.ref.uri())
            except Exl2Error:
                raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, "the file listing: expected JSON", self.ref.uri()) \
                    from None
            if not isinstance(doc, list):
                raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, "the file listing: expected a JSON array", self.ref.uri())
            for e in doc:
                if isinstance(e, dict) and e.get("type") == "file" and isinstance(e.get("path"), str):
                    why = unsafe_name(e["path"])
                    if why:  # never used as a local name, never printed raw
                        raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"the file listing names "
                                       f"{_show(e['path'])}: {why}; refusing a listing with names no local file "
                                       "can safely hold", self.ref.uri())
                    lfs = e.get("lfs") if isinstance(e.get("lfs"), dict) else {}
                    size = lfs.get("size", e.get("size"))
                    out.append({"path": e["path"], "size": size if isinstance(size, int)
                                and not isinstance(size, bool) else None})
            if len(out) > MAX_LIST_ENTRIES:
                raise _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"more than {MAX_LIST_ENTRIES} files in the folder",
                               self.ref.uri())
            nxt = _next_link(headers.get("link", ""))
            if not nxt:
                return out
            url = urljoin(url, nxt)
        raise _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"the file listing has more than {MAX_LIST_PAGES} pages",
                       self.ref.uri())


def _next_link(link: str) -> str | None:
    for part in link.split(","):
        m = re.match(r'\s*<([^>]*)>\s*;(.*)', part)
        if m and re.search(r'rel="?next"?', m.group(2)):
            return m.group(1)
    return None


# ------------------------------------------------------------------------------------------------ snapshot


@dataclass
class HubSnapshot:
    """A local, sparse image of the headers (and q_groups) of one Hub folder; remove with ``close``."""

    ref: HubRef
    root: Path
    target: Path
    commit: str | None
    endpoint: str
    files: list[dict]
    stats: HubStats

    @property
    def model_bytes(self) -> int:
        return sum(f["size"] for f in self.files)

    def as_dict(self) -> dict:
        return {"repo": self.ref.repo_id, "revision": self.ref.rev, "commit": self.commit,
                "endpoint": self.endpoint, "files_read": len(self.files), "model_bytes": self.model_bytes,
                "bytes_fetched": self.stats.bytes_fetched, "requests": self.stats.requests,
                "fraction_fetched": round(self.stats.bytes_fetched / self.model_bytes, 9) if self.model_bytes
                else None}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "HubSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _image_error(e: OSError, where: str) -> Exl2Error:
    """A local image that cannot be written: named by its ``hf://`` path (the temporary directory is removed)."""
    return _hub_err(ErrorCode.IO_ERROR, f"cannot write its local image in the temporary directory (TMPDIR): "
                    f"{e.strerror or type(e).__name__}", where)


def _write_at(path: Path, offset: int, data: bytes, where: str) -> None:
    try:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)
    except OSError as e:
        raise _image_error(e, where) from None


def _sparse_image(path: Path, size: int, head: bytes, where: str) -> None:
    try:
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(size)
            st = os.fstat(f.fileno())
    except OSError as e:
        raise _image_error(e, where) from None
    blocks = getattr(st, "st_blocks", None)
    if blocks is not None and blocks * 512 > len(head) + (8 << 20) and size > len(head) + (8 << 20):
        path.unlink(missing_ok=True)
        raise _hub_err(ErrorCode.IO_ERROR, f"the temporary directory {path.parent.parent} cannot hold sparse files "
                       f"({blocks * 512} bytes allocated for {len(head)} written); set TMPDIR to a filesystem that "
                       "can (ext4, xfs, btrfs, tmpfs, APFS)", where)


def fetch_snapshot(ref: HubRef, *, groups: bool = True) -> HubSnapshot:
    """Read the headers of the safetensors model (or ``.safetensors`` file) at ``ref`` into a sparse local image;
    see the module docstring.  ``groups`` also fetches the EXL2 ``q_groups`` tables."""
    from .container import MAX_HEADER_BYTES, parse_header

    cl = HubClient(ref)
    base = ref.path
    single = None
    if base.endswith(".safetensors"):
        base, _, single = base.rpartition("/")
    elif base.endswith(".gguf"):
        return _fetch_gguf(cl, ref)
    listing = cl.list_folder(base, ref.rev)
    prefix = f"{base}/" if base else ""
    names = {e["path"][len(prefix):]: e for e in listing if e["path"].startswith(prefix)
             and "/" not in e["path"][len(prefix):]}
    if single is not None:
        if single not in names:
            raise _hub_err(ErrorCode.HUB_NOT_FOUND, f"no file {single!r} at revision {ref.rev!r}", ref.uri())
        shards = [single]
        jsons = [n for n in _JSON_FILES if n in names]
    else:
        shards = sorted(n for n in names if n.endswith(".safetensors"))
        jsons = sorted(n for n in names if n in _JSON_FILES or n.endswith(".safetensors.index.json"))
        if not shards and not any(n.endswith(".index.json") for n in jsons):
            ggufs = sorted(n for n in names if n.endswith(".gguf"))
            hint = f", but {len(ggufs)} .gguf file(s) (e.g. {ggufs[0]})" if ggufs else ""
            raise _hub_err(ErrorCode.NO_SAFETENSORS, f"expected at least one .safetensors file, found none{hint}",
                           ref.uri())
    root = Path(tempfile.mkdtemp(prefix="exl2fmt-hub-"))
    try:
        mirror = root / "model"
        mirror.mkdir()
        revision = ref.rev
        commit = None
        files: list[dict] = []
        metas: dict[str, tuple[int, str]] = {}
        for n in jsons + shards:
            size, c, loc = cl.metadata(prefix + n, revision if commit is None else commit)
            if commit is None and c:
                commit = c
            elif c and commit and c != commit:
                raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{n}: served from commit {c}, the other files from "
                               f"{commit}", ref.uri(prefix + n))
            listed = names[n]["size"]
            if listed is not None and listed != size:
                raise _hub_err(ErrorCode.HUB_BAD_RESPONSE, f"{n}: the listing says {listed} bytes, the file "
                               f"metadata {size}", ref.uri(prefix + n))
            if commit and f"/resolve/{quote(revision, safe='')}/" in loc and revision != commit:
                loc = loc.replace(f"/resolve/{quote(revision, safe='')}/", f"/resolve/{commit}/", 1)  # pin it
            metas[n] = (size, loc)
            files.append({"path": ref.uri(prefix + n), "size": size})
        for n in jsons:
            size, loc = metas[n]
            if size > MAX_JSON_BYTES:
                raise _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"{n} is {size} bytes, above the cap of {MAX_JSON_BYTES}",
                               ref.uri(prefix + n))
            body, _ = cl.get(loc, n, cap=MAX_JSON_BYTES, file=ref.uri(prefix + n))
            try:
                (mirror / n).write_bytes(body)
            except OSError as e:
                raise _image_error(e, ref.uri(prefix + n)) from None
        headers = {}
        for n in shards:
            size, loc = metas[n]
            where = ref.uri(prefix + n)
            if size < 8:
                raise Exl2Error(ErrorCode.HEADER_TOO_SMALL, f"expected at least 8 bytes (the header length), found a "
                                f"file of {size} bytes", file=where)
            first, _ = cl.get(loc, f"{n} header length", start=0, length=8, file=where, expect_size=size)
            (hlen,) = struct.unpack("<Q", first)
            if hlen > MAX_HEADER_BYTES:  # before anything of that size is asked for or allocated
                raise Exl2Error(ErrorCode.HEADER_TOO_LARGE, f"declared header length {hlen} bytes exceeds the cap of "
                                f"{MAX_HEADER_BYTES} bytes", file=where)
            if 8 + hlen > size:
                raise Exl2Error(ErrorCode.HEADER_PAST_EOF, f"declared header length {hlen} bytes needs a file of at "
                                f"least {8 + hlen} bytes, found {size}", file=where)
            if 8 + hlen > MAX_BYTES_PER_FILE:  # pragma: no cover - MAX_HEADER_BYTES is below the per-file cap
                raise _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"a {hlen}-byte header", where)
            hb = b""
            if hlen:
                hb, _ = cl.get(loc, f"{n} header", start=8, length=hlen, file=where, expect_size=size)
            hdr = parse_header(first + hb, file_size=size, path=where)  # the project's one parser
            headers[n] = hdr
            _sparse_image(mirror / n, size, first + hb, where)
        if groups:
            jobs = []
            for n, hdr in headers.items():
                budget = MAX_BYTES_PER_FILE - 8 - hdr.header_len
                for t in hdr.tensors.values():
                    if (t.name.endswith(f".{Exl2Slot.Q_GROUPS}") and t.dtype == "I16"
                            and 0 < t.nbytes <= MAX_GROUPS_BYTES):
                        budget -= t.nbytes
                        if budget < 0:
                            raise _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"the q_groups tables of {n} exceed the "
                                           f"per-file cap of {MAX_BYTES_PER_FILE} bytes", ref.uri(prefix + n))
                        jobs.append((n, t))
            _fetch_ranges(cl, jobs, metas, mirror, ref, prefix)
        target = mirror / single if single is not None else mirror
        return HubSnapshot(ref, root, target, commit, cl.endpoint, files, cl.stats)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


GGUF_FIRST_FETCH = 1 << 20
"""Bytes of a ``.gguf`` file read first; the header is then read further as far as it turns out to reach."""


GGUF_PREAMBLE = 24
"""magic (4 bytes), version (4), tensor count (8), key/value count (8)."""


def _check_gguf_preamble(pre: bytes, size: int, where: str) -> None:
    """The checks the GGUF pre-scan (``exl2fmt.gguf_scan``) makes first, on the preamble alone: magic, version 2
    or 3 (either byte order), counts within the caps and the file's size."""
    from .gguf_scan import GGUF_MAX_KV, GGUF_MAX_TENSORS

    def bad(msg):
        raise Exl2Error(ErrorCode.GGUF_INVALID, msg + " (read from the first 24 bytes; nothing more was fetched)",
                        file=where)

    if pre[:4] != b"GGUF":
        bad(f"expected the magic b'GGUF', found {pre[:4]!r}")
    bo = "<"
    (version,) = struct.unpack_from("<I", pre, 4)
    if version not in (2, 3):
        (v_be,) = struct.unpack_from(">I", pre, 4)
        if v_be not in (2, 3):
            bad(f"expected GGUF version 2 or 3, found {version}")
        bo = ">"
    n_tensors, n_kv = struct.unpack_from(bo + "QQ", pre, 8)
    if n_kv > GGUF_MAX_KV or n_kv * 12 > size - GGUF_PREAMBLE:
        bad(f"{n_kv} key/value pairs cannot fit in the file (cap {GGUF_MAX_KV})")
    if n_tensors > GGUF_MAX_TENSORS or n_tensors * 24 > size - GGUF_PREAMBLE:
        bad(f"{n_tensors} tensors cannot fit in the file (cap {GGUF_MAX_TENSORS})")


def _fetch_gguf(cl: HubClient, ref: HubRef) -> HubSnapshot:
    """A ``.gguf`` file: its header, read in growing prefixes.  GGUF does not say its header's length up front,
    so the prefix read so far is put in a sparse image and ``exl2fmt.inspect.inspect_gguf`` (bounds-checking
    pre-scan, then the ``gguf`` package) runs on it: when it succeeds with its ``data_start`` inside the prefix,
    everything it read was real bytes; when ``data_start`` lies beyond, the rest of the header is read; when it
    fails, the prefix is doubled, up to the whole file or ``MAX_BYTES_PER_FILE`` - only then is the failure the
    file's.  At most twice the header (plus the first read) is fetched."""
    from .inspect import inspect_gguf

    name = ref.path.rpartition("/")[2]
    where = ref.uri()
    size, commit, loc = cl.metadata(ref.path, ref.rev)
    root = Path(tempfile.mkdtemp(prefix="exl2fmt-hub-"))
    try:
        (root / "model").mkdir()
        image = root / "model" / name
        # the fixed preamble first: a file that is no GGUF is refused on its first 24 bytes, before more is asked
        if size < GGUF_PREAMBLE:
            raise Exl2Error(ErrorCode.GGUF_INVALID, f"a file of {size} bytes is shorter than the "
                            f"{GGUF_PREAMBLE}-byte GGUF preamble (magic, version, counts)", file=where)
        pre, _ = cl.get(loc, f"{name} preamble", start=0, length=GGUF_PREAMBLE, file=where, expect_size=size)
        _check_gguf_preamble(pre, size, where)
        _sparse_image(image, size, pre, where)
        limit = min(size, MAX_BYTES_PER_FILE)
        have, want = GGUF_PREAMBLE, min(limit, GGUF_FIRST_FETCH)
        while True:
            if want > have:
                body, _ = cl.get(loc, f"{name} header", start=have, length=want - have, file=where, expect_size=size)
                _write_at(image, have, body, where)
                have = want
            try:
                rep = inspect_gguf(image, layers=False)
            except Exl2Error as e:
                if e.code is not ErrorCode.GGUF_INVALID or have >= limit:
                    if e.code is ErrorCode.GGUF_INVALID and have < size:
                        raise _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"no complete GGUF header within the first "
                                       f"{have} bytes (the cap): {e.message}", where) from None
                    raise Exl2Error(e.code, e.message.replace(str(image), where), file=where, tensor=e.tensor) \
                        from None
                want = min(limit, have * 2)
                continue
            ds = int(rep["gguf"].get("data_start") or 0)
            if ds <= have:
                break
            if ds > limit:
                raise _hub_err(ErrorCode.HUB_FETCH_LIMIT, f"a GGUF header of {ds} bytes exceeds the per-file cap of "
                               f"{MAX_BYTES_PER_FILE}", where)
            want = max(ds, min(limit, have * 2))  # ds read over holes underestimates: grow geometrically too
        files = [{"path": where, "size": size}]
        return HubSnapshot(ref, root, image, commit, cl.endpoint, files, cl.stats)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _fetch_ranges(cl: HubClient, jobs, metas, mirror: Path, ref: HubRef, prefix: str) -> None:
    """Fetch each (file, tensor) data range into its place in the sparse image (8 requests in flight)."""
    if not jobs:
        return
    locks = {n: threading.Lock() for n, _ in jobs}

    def one(job):
        n, t = job
        size, loc = metas[n]
        body, _ = cl.get(loc, f"{n} {t.name}", start=t.abs_begin, length=t.nbytes, file=ref.uri(prefix + n),
                         expect_size=size)
        with locks[n]:
            _write_at(mirror / n, t.abs_begin, body, ref.uri(prefix + n))

    with ThreadPoolExecutor(max_workers=min(8, len(jobs))) as ex:
        for _ in ex.map(one, jobs):
            pass


# ------------------------------------------------------------------------------------------------ reports


def rewrite_paths(doc: Any, local: str, remote: str) -> Any:
    """Replace the temporary image's path ``local`` by the ``hf://`` form in every string of a report."""
    if isinstance(doc, dict):
        return {k: rewrite_paths(v, local, remote) for k, v in doc.items()}
    if isinstance(doc, list):
        return [rewrite_paths(v, local, remote) for v in doc]
    if isinstance(doc, str) and local in doc:
        return doc.replace(local, remote)
    return doc


def inspect_hub(uri: str, *, revision: str | None = None, layers: bool = True) -> dict:
    """``exl2fmt inspect hf://...``: the local inspect report of the headers, paths in ``hf://`` form, plus
    ``hub`` (repo, revision, commit, bytes fetched vs model size, requests)."""
    from .inspect import inspect_model

    ref = parse_hub_uri(uri, revision)
    with fetch_snapshot(ref) as snap:
        with _remote_errors(snap, ref):
            rep = inspect_model(snap.target, layers=layers)
        rep = _to_remote(rep, snap, ref)
        if rep.get("input") == "gguf":
            rep["files"] = [{"path": ref.uri(), "bytes": snap.files[0]["size"], "tensors": rep["summary"]["tensors"]}]
        rep["hub"] = snap.as_dict()
    return rep


class _remote_errors:
    """Re-raise an ``Exl2Error`` about the local image with the ``hf://`` paths."""

    def __init__(self, snap: HubSnapshot, ref: HubRef):
        self.local = str(snap.target if snap.target.is_dir() else snap.target.parent)
        self.remote = HubRef(ref.repo_id, ref.revision, ref.path.rpartition("/")[0]
                             if ref.path.endswith((".safetensors", ".gguf")) else ref.path).uri()

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if isinstance(e, Exl2Error) and (self.local in (e.file or "") or self.local in e.message):
            raise Exl2Error(e.code, e.message.replace(self.local, self.remote),
                            file=(e.file or "").replace(self.local, self.remote) or None, tensor=e.tensor) from None
        return False


def _to_remote(doc: dict, snap: HubSnapshot, ref: HubRef) -> dict:
    mirror = str(snap.target if snap.target.is_dir() else snap.target.parent)
    base = HubRef(ref.repo_id, ref.revision, ref.path.rpartition("/")[0]
                  if ref.path.endswith((".safetensors", ".gguf")) else ref.path).uri()
    doc = rewrite_paths(doc, mirror, base)
    doc["path"] = ref.uri()
    return doc


def validate_hub(uri: str, *, revision: str | None = None, strict: bool = False):
    """``exl2fmt validate hf://...``: the structural checks (headers, index, config, names, layers, bits) on the
    fetched headers.  Returns (report dict, exit code)."""
    from .validate import validate_model

    ref = parse_hub_uri(uri, revision)
    if ref.path.endswith(".gguf"):
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, "validate checks safetensors models; this is a GGUF file "
                        "(exl2fmt inspect summarises it)", file=ref.uri())
    with fetch_snapshot(ref) as snap:
        with _remote_errors(snap, ref):
            rep = validate_model(snap.target, strict=strict)
        doc = _to_remote(rep.as_dict(), snap, ref)
        doc["hub"] = snap.as_dict()
    return doc, rep.exit_code


# ------------------------------------------------------------------------------------------------ --reference hf://

_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


def reference_shape_checks(rep, path: str | os.PathLike, uri: str, *, revision: str | None = None) -> dict:
    """``validate --reference hf://...``: compare the local quantized model at ``path`` with its FP16/BF16 source
    on the Hub from headers alone: every linear layer's (out, in) against the source's ``{key}.weight`` (EXL2:
    out padded to 32), every other tensor's shape, and the architecture fields of config.json.  Adds
    ``reference`` checks to the validate ``Report`` ``rep``; returns the snapshot's ``hub`` dict."""
    from .container import open_model
    from .detect import detect_model
    from .layout import Format
    from .layout import pad32
    from .validate import CheckId, PassCode, Status

    ref = parse_hub_uri(uri, revision)
    with fetch_snapshot(ref, groups=False) as snap:
        src = open_model(snap.target)
        try:
            model = open_model(path)
        except Exl2Error:
            src.close()
            return snap.as_dict()  # validate has already reported why the local model does not open
        try:
            try:
                cfg = model.config or {}
            except Exl2Error:
                cfg = {}
            det = detect_model(model.tensors, cfg or None, root=model.root)
            try:
                scfg = src.config or {}
            except Exl2Error as e:
                rep.add(CheckId.REFERENCE, Status.FAIL, e.code, e.message, file=uri)
                scfg = {}
            base = _to_remote({"p": str(snap.target)}, snap, ref)["p"]
            sfile = lambda t: str(t.file).replace(str(snap.target), base)  # noqa: E731
            n_ok, bad = 0, 0
            covered: set[str] = set()
            for key, info in sorted(det.layers.items()):
                covered.update(t.name for t in info.slots.values())
                w = src.tensors.get(f"{key}.weight")
                if w is None:
                    rep.add(CheckId.REFERENCE, Status.WARN, ErrorCode.LAYER_NOT_FOUND, f"the reference {uri} has no "
                            f"{key}.weight; layer not compared", tensor=key)
                    continue
                K, N = info.in_features, info.out_features
                if len(w.shape) != 2 or K is None or N is None:
                    continue
                rn, rk = w.shape
                ok = rk == K and (rn == N or (info.format is Format.EXL2 and pad32(rn) == N))
                if ok:
                    n_ok += 1
                else:
                    bad += 1
                    rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"{info.format.value} "
                            f"layer is {N} x {K} (out x in{', out padded to 32' if info.format is Format.EXL2 else ''}"
                            f") but the reference's {key}.weight is {rn} x {rk} ({sfile(w)})", tensor=key,
                            file=str(next(iter(info.slots.values())).file))
            for name, t in model.tensors.items():
                if name in covered:
                    continue
                s = src.tensors.get(name)
                if s is None:
                    continue
                if tuple(s.shape) == tuple(t.shape):
                    n_ok += 1
                else:
                    bad += 1
                    rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"shape {list(t.shape)} but "
                            f"the reference has {list(s.shape)} ({sfile(s)})", tensor=name, file=str(t.file))
            if isinstance(cfg, dict) and isinstance(scfg, dict):
                tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
                ts = scfg.get("text_config") if isinstance(scfg.get("text_config"), dict) else scfg
                for k in _CONFIG_KEYS:
                    if k in tc and k in ts:
                        if tc[k] == ts[k]:
                            n_ok += 1
                        else:
                            bad += 1
                            rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"config.json {k} = "
                                    f"{json.dumps(tc[k])[:60]} but the reference's is {json.dumps(ts[k])[:60]}",
                                    file=str(model.config_path))
            if not bad and n_ok:
                rep.ok(CheckId.REFERENCE, PassCode.REFERENCE_OK, f"shapes and config match the reference {uri} "
                       f"({n_ok} comparisons from headers alone; a local --reference DIR also compares the weights)",
                       count=n_ok)
            elif not bad:
                rep.add(CheckId.REFERENCE, Status.WARN, ErrorCode.LAYER_NOT_FOUND, f"nothing in common with the "
                        f"reference {uri} to compare")
        finally:
            src.close()
            model.close()
        return snap.as_dict()
