"""Transport for the Hub reader: bounded GETs that follow redirects by hand, metadata HEADs, paginated listings,
each request under its own deadline and the command's total deadline, every body byte counted against the
command's byte budget (``EXL2FMT_HUB_TIMEOUT``, ``EXL2FMT_HUB_TOTAL_TIMEOUT``, ``EXL2FMT_HUB_MAX_BYTES``; the
package docstring of ``exl2fmt.hub`` has the rules)."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from ..container import jsonload
from ..errors import ErrorCode, Exl2Error
from .paths import MAX_NAME_BYTES, HubRef, hub_error, show_name, unsafe_name

__all__ = ["READ_CHUNK", "HubClient", "HubStats", "MAX_JSON_BYTES", "MAX_FILE_SIZE", "MAX_REDIRECTS",
           "DEFAULT_MAX_TOTAL_BYTES", "DEFAULT_TOTAL_TIMEOUT", "MAX_LIST_PAGES", "MAX_LIST_ENTRIES"]

MAX_JSON_BYTES = 32 << 20
"""Largest JSON document read from the Hub (config.json, an index, one page of a listing)."""
MAX_FILE_SIZE = 1 << 40
"""Largest declared file size accepted (the Hub itself stores files of at most 50 GB)."""
MAX_REDIRECTS = 5
DEFAULT_MAX_TOTAL_BYTES = 256 << 20
"""Default byte budget of one command (every body byte of every request together; ``EXL2FMT_HUB_MAX_BYTES``
raises or lowers it): real EXL2 models need a few MB (headers, config, q_groups), the largest legal header
(``MAX_HEADER_BYTES``, 100 MB) fits twice."""
DEFAULT_TOTAL_TIMEOUT = 600.0
"""Default wall-clock deadline of one command's Hub reads, in seconds (``EXL2FMT_HUB_TOTAL_TIMEOUT``)."""
MAX_LIST_PAGES = 100
MAX_LIST_ENTRIES = 100_000
READ_CHUNK = 1 << 16


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
            raise hub_error(ErrorCode.HUB_UNREACHABLE, "HF_HUB_OFFLINE is set: the Hub cannot be reached",
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
        from .. import __version__

        self.auth = self._build_headers(library_name="exl2fmt", library_version=__version__)
        self.plain = {k: v for k, v in self.auth.items() if k.lower() != "authorization"}

    # --- errors ---------------------------------------------------------------------------------------
    def _status_error(self, status: int, headers, url: str, what: str) -> Exl2Error:
        xcode = headers.get("X-Error-Code", "") if headers is not None else ""
        xmsg = headers.get("X-Error-Message", "") if headers is not None else ""
        detail = f" ({xmsg[:200]})" if xmsg else ""
        if status in (401, 403) or xcode == "GatedRepo":
            return hub_error(ErrorCode.HUB_ACCESS_DENIED, f"HTTP {status} for {what}{detail}: the repository is "
                            "private or gated; set HF_TOKEN (or run `hf auth login`) with a token that has access",
                            self.ref.uri())
        if status == 404:
            if xcode == "RevisionNotFound":
                return self._revision_missing()
            if xcode == "RepoNotFound":
                return hub_error(ErrorCode.HUB_NOT_FOUND, f"no repository {self.ref.repo_id} on {self.endpoint} "
                                "(or it is private: set HF_TOKEN)", self.ref.uri())
            return hub_error(ErrorCode.HUB_NOT_FOUND, f"HTTP 404 for {what}{detail}", self.ref.uri())
        if status == 429 or status >= 500:
            return hub_error(ErrorCode.HUB_UNREACHABLE, f"HTTP {status} for {what}{detail}: the server is "
                            "unavailable or rate-limiting; try again later", self.ref.uri())
        return hub_error(ErrorCode.HUB_BAD_RESPONSE, f"unexpected HTTP {status} for {what}{detail}", self.ref.uri())

    def _revision_missing(self) -> Exl2Error:
        names = []
        try:
            doc = self.get_json(f"{self.endpoint}/api/models/{self.ref.repo_id}/refs", "the list of branches")
            for kind in ("branches", "tags"):
                for item in doc.get(kind) or [] if isinstance(doc, dict) else []:
                    if isinstance(item, dict) and isinstance(item.get("name"), str):
                        nm = item["name"] if not any(c < " " or c == "\x7f" for c in item["name"]) \
                            and len(item["name"]) <= MAX_NAME_BYTES else show_name(item["name"], 80)
                        names.append(nm if kind == "branches" else f"{nm} (tag)")
        except Exl2Error:
            pass
        have = (f"; it has: {', '.join(names[:50])}" + (" ..." if len(names) > 50 else "")) if names else ""
        return hub_error(ErrorCode.HUB_NOT_FOUND, f"no revision {self.ref.rev!r} in {self.ref.repo_id}{have} "
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
        return hub_error(ErrorCode.HUB_UNREACHABLE, f"{what}: {why}; the server is too slow or holds the "
                        "connection open", where)

    def _over_budget(self, what: str, where: str, n: int) -> Exl2Error:
        return hub_error(ErrorCode.HUB_FETCH_LIMIT, f"{what}: {n} more bytes would take this command past its "
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
                        raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: refusing a redirect to "
                                       f"{show_name(target)} (only http(s), never https -> http)", where)
                    return ("redirect", target)
                if status >= 400:
                    raise self._status_error(status, r.headers, url, what)
                if start is not None:
                    self._check_range(r, status, start, length, expect_size, what, where)
                elif status != 200:
                    raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: expected HTTP 200, found {status}", where)
                body = bytearray()
                for chunk in r.iter_raw(READ_CHUNK):
                    if cancel.is_set():
                        raise hub_error(ErrorCode.HUB_UNREACHABLE, f"{what}: abandoned", where)
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
                            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: the server sent more than the "
                                           f"{length} bytes of the requested range; stopped reading", where)
                        raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: larger than the cap of {cap} "
                                       "bytes; stopped reading", where)
                    if time.monotonic() > deadline:
                        raise self._late(what, where)
                if start is not None and len(body) != length:
                    raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: expected {length} bytes of the range, "
                                   f"found {len(body)} (connection closed early?)", where)
                return ("done", bytes(body), r.headers)

        def guarded(url: str):
            try:
                return hop(url)
            except Exl2Error:
                raise
            except httpx2.TimeoutException:
                raise hub_error(ErrorCode.HUB_UNREACHABLE, f"{what}: timed out after {self.timeout:g} s "
                               "(EXL2FMT_HUB_TIMEOUT)", where) from None
            except (httpx2.HTTPError, httpx2.InvalidURL, OSError, ValueError) as e:
                raise hub_error(ErrorCode.HUB_UNREACHABLE, f"{what}: cannot reach {show_name(_origin(url)[1] or url)}: "
                               f"{type(e).__name__}: {show_name(str(e), 200)}", where) from None

        def late():
            cancel.set()
            return self._late(what, where)

        for _hop in range(MAX_REDIRECTS + 1):
            res = _call_by(deadline, lambda: guarded(url), late)
            if res[0] == "redirect":
                url = res[1]
                continue
            return res[1], res[2]
        raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: more than {MAX_REDIRECTS} redirects", where)

    @staticmethod
    def _check_range(r, status, start, length, expect_size, what, where) -> None:
        if status != 206:
            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: asked for bytes {start}-{start + length - 1}, the "
                           f"server answered HTTP {status} instead of 206 Partial Content (it ignores ranges); "
                           "refusing to download the whole file", where)
        cr = r.headers.get("content-range", "")
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", cr.strip())
        if not m or int(m.group(1)) != start or int(m.group(2)) != start + length - 1 or (
                expect_size is not None and m.group(3) != "*" and int(m.group(3)) != expect_size):
            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: asked for bytes {start}-{start + length - 1} of "
                           f"{expect_size}, the server sent Content-Range {cr[:80]!r}", where)
        cl = r.headers.get("content-length")
        if cl is not None and cl.strip() != str(length):
            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: a {length}-byte range with Content-Length "
                           f"{cl[:30]!r}", where)

    def get_json(self, url: str, what: str, file: str | None = None) -> Any:
        body, _ = self.get(url, what, file=file)
        try:  # the guarded loader: value-count / depth caps, every parser error mapped
            return jsonload.loads_json(body, jsonload.HUB_API, file=file)
        except Exl2Error:
            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{what}: expected JSON from the server", file) from None

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
            raise hub_error(ErrorCode.HUB_NOT_FOUND, f"no repository {self.ref.repo_id} on {self.endpoint} (or it "
                           "is private: set HF_TOKEN)", where) from None
        except hf_errors.EntryNotFoundError:
            raise hub_error(ErrorCode.HUB_NOT_FOUND, f"no file {filename!r} at revision {self.ref.rev!r}", where) \
                from None
        except hf_errors.HfHubHTTPError as e:
            r = getattr(e, "response", None)
            raise self._status_error(getattr(r, "status_code", 0) or 0, getattr(r, "headers", None), url,
                                     filename) from None
        except httpx2.TooManyRedirects:
            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{filename}: too many redirects", where) from None
        except httpx2.TimeoutException:
            raise hub_error(ErrorCode.HUB_UNREACHABLE, f"{filename}: timed out after {self.timeout:g} s", where) \
                from None
        except (httpx2.HTTPError, OSError) as e:
            if type(e).__name__ == "OfflineModeIsEnabled":
                raise hub_error(ErrorCode.HUB_UNREACHABLE, "HF_HUB_OFFLINE is set", where) from None
            raise hub_error(ErrorCode.HUB_UNREACHABLE, f"{filename}: cannot reach {self.endpoint}: "
                           f"{type(e).__name__}: {str(e)[:200]}", where) from None
        if m.size is None or not isinstance(m.size, int) or m.size < 0:
            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{filename}: the server gave no file size "
                           "(X-Linked-Size / Content-Length)", where)
        if isinstance(m.size, bool) or m.size > MAX_FILE_SIZE:
            raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{filename}: declared size {m.size} bytes exceeds the cap of "
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
                raise hub_error(ErrorCode.HUB_BAD_RESPONSE, "the file listing: expected JSON", self.ref.uri()) \
                    from None
            if not isinstance(doc, list):
                raise hub_error(ErrorCode.HUB_BAD_RESPONSE, "the file listing: expected a JSON array", self.ref.uri())
            for e in doc:
                if isinstance(e, dict) and e.get("type") == "file" and isinstance(e.get("path"), str):
                    why = unsafe_name(e["path"])
                    if why:  # never used as a local name, never printed raw
                        raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"the file listing names "
                                       f"{show_name(e['path'])}: {why}; refusing a listing with names no local file "
                                       "can safely hold", self.ref.uri())
                    lfs = e.get("lfs") if isinstance(e.get("lfs"), dict) else {}
                    size = lfs.get("size", e.get("size"))
                    out.append({"path": e["path"], "size": size if isinstance(size, int)
                                and not isinstance(size, bool) else None})
            if len(out) > MAX_LIST_ENTRIES:
                raise hub_error(ErrorCode.HUB_FETCH_LIMIT, f"more than {MAX_LIST_ENTRIES} files in the folder",
                               self.ref.uri())
            nxt = _next_link(headers.get("link", ""))
            if not nxt:
                return out
            url = urljoin(url, nxt)
        raise hub_error(ErrorCode.HUB_FETCH_LIMIT, f"the file listing has more than {MAX_LIST_PAGES} pages",
                       self.ref.uri())


def _next_link(link: str) -> str | None:
    for part in link.split(","):
        m = re.match(r'\s*<([^>]*)>\s*;(.*)', part)
        if m and re.search(r'rel="?next"?', m.group(2)):
            return m.group(1)
    return None
