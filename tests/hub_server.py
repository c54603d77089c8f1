"""A local emulation of the Hugging Face Hub's file endpoints, for the hf:// tests (never the real network).

``HubEmulator(root)`` serves ``root/ORG/REPO/BRANCH/...`` (one folder per branch, as EXL2 publishers use one
branch per bitrate) on 127.0.0.1 with two ``ThreadingHTTPServer`` threads:

* the *hub* (``HF_ENDPOINT``):
  ``HEAD|GET /ORG/REPO/resolve/REV/PATH`` - small files answered directly (200 / 206 for a ``Range``) with
  ``X-Repo-Commit`` and ``ETag``; ``*.safetensors`` / ``*.gguf`` ("LFS") files answered ``302`` to the CDN with
  ``X-Linked-Size``, ``X-Linked-Etag`` and ``X-Repo-Commit`` on the redirect, as the real Hub does; 404 with
  ``X-Error-Code: RepoNotFound / RevisionNotFound / EntryNotFound``; 401 for a private repo without the token.
  ``GET /api/models/ORG/REPO/tree/REV[/PATH]`` (paginated with a ``Link: <...>; rel="next"`` header every
  ``page_size`` entries) and ``GET /api/models/ORG/REPO/refs``.
* the *CDN* (another port = another origin): ``GET /cdn/ORG/REPO/COMMIT/PATH`` with ranges.

A revision is a branch name or its commit (sha1 of the branch name).  Every request is recorded
(``requests``: method, server, path, range, authorization, body bytes), and every body byte written is counted
(``bytes_served``).  ``mode`` switches on hostile behaviour for the CDN: ``ignore_range`` (200 and the whole
file), ``endless`` (206, no length, a body that does not stop - bounded at 64 MiB so a broken client cannot hang
the suite), ``wrong_range`` (the range one byte later), ``redirect_loop``, ``redirect_scheme`` (to file://),
``huge_length`` (a declared header length of 2**40 in bytes 0-7), ``huge_size`` (``X-Linked-Size`` 2**62).

Round 3 (spec/malformed/hostile3_hub/README.md): ``trickle_list`` / ``trickle_head`` / ``trickle_get`` answer the
listing, the hub's HEAD or the CDN's ranged GET with a status line and then one header line every
``trickle_s`` seconds (at most ``trickle_lines``, then the connection closes): a client whose timeout is a
per-read timeout never gives up.  ``extra_listing`` entries are appended to every listing page (hostile names:
a NUL, newlines, ``..``, absolute paths, 300-byte names) without any file behind them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf")


class _Server(ThreadingHTTPServer):
    """A client that stops reading (the point of the hostile modes: a bounded reader drops an endless body)
    resets the connection; that is the expected outcome, not an error to print over the test output."""

    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


def commit_of(branch: str) -> str:
    return hashlib.sha1(branch.encode()).hexdigest()


class HubEmulator:
    def __init__(self, root: str | os.PathLike, *, token: str | None = None, private: tuple[str, ...] = (),
                 page_size: int = 1000):
        self.root = Path(root)
        self.token = token
        self.private = set(private)
        self.page_size = page_size
        self.mode: set[str] = set()
        self.trickle_s = 0.5
        self.trickle_lines = 120
        self.extra_listing: list[dict] = []
        self.requests: list[dict] = []
        self.bytes_served = {"hub": 0, "cdn": 0}
        self._lock = threading.Lock()
        self.hub = _Server(("127.0.0.1", 0), _handler(self, "hub"))
        self.cdn = _Server(("127.0.0.1", 0), _handler(self, "cdn"))
        for s in (self.hub, self.cdn):
            s.daemon_threads = True
        self._threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
                         for s in (self.hub, self.cdn)]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def __enter__(self) -> "HubEmulator":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_served = {"hub": 0, "cdn": 0}

    @property
    def total_served(self) -> int:
        return sum(self.bytes_served.values())

    # --- repository model ------------------------------------------------------------------------------
    def branches(self, repo: str) -> list[str]:
        d = self.root / repo
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def resolve_rev(self, repo: str, rev: str) -> str | None:
        for b in self.branches(repo):
            if rev in (b, commit_of(b)):
                return b
        return None


def _handler(emu: HubEmulator, role: str):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        # --- plumbing ---------------------------------------------------------------------------------
        def _record(self):
            self._rec = {"server": role, "method": self.command, "path": self.path, "bytes": 0,
                         "range": self.headers.get("Range"), "authorization": self.headers.get("Authorization")}
            with emu._lock:
                emu.requests.append(self._rec)

        def _body(self, data: bytes):
            if self.command == "HEAD":
                return
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                return
            with emu._lock:
                emu.bytes_served[role] += len(data)
                self._rec["bytes"] += len(data)

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, ctype="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self._body(body)

        def _err(self, status: int, code: str | None = None):
            h = {"X-Error-Code": code} if code else {}
            self._send(status, json.dumps({"error": code or status}).encode(), h)

        def do_HEAD(self):
            self.do_GET()

        def _trickle(self) -> bool:
            """The trickle modes: True when this request was answered by trickling its headers."""
            listing = role == "hub" and "/tree/" in self.path
            head = role == "hub" and self.command == "HEAD"
            get = role == "cdn" and self.command == "GET" and self.headers.get("Range") is not None
            if not (("trickle_list" in emu.mode and listing) or ("trickle_head" in emu.mode and head)
                    or ("trickle_get" in emu.mode and get)):
                return False
            import time

            self.close_connection = True
            try:
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                self.wfile.flush()
                for i in range(emu.trickle_lines):
                    time.sleep(emu.trickle_s)
                    self.wfile.write(f"X-Trickle-{i}: x\r\n".encode())
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
            return True

        def do_GET(self):
            self._record()
            try:
                if self._trickle():
                    return
                if role == "cdn":
                    return self._cdn()
                return self._hub()
            except (BrokenPipeError, ConnectionResetError):
                return

        # --- the hub ----------------------------------------------------------------------------------
        def _auth_ok(self, repo: str) -> bool:
            if repo not in emu.private:
                return True
            return self.headers.get("Authorization") == f"Bearer {emu.token}"

        def _repo_rev(self, repo: str, rev: str):
            if not (emu.root / repo).is_dir():
                self._err(404, "RepoNotFound")
                return None
            if not self._auth_ok(repo):
                self._err(401, "RepoNotFound")
                return None
            b = emu.resolve_rev(repo, rev)
            if b is None:
                self._err(404, "RevisionNotFound")
            return b

        def _hub(self):
            url = urlsplit(self.path)
            p = url.path
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/refs", p)
            if m:
                repo = m.group(1)
                if not (emu.root / repo).is_dir() or not self._auth_ok(repo):
                    return self._err(404, "RepoNotFound")
                doc = {"branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": commit_of(b)}
                                    for b in emu.branches(repo)], "tags": [], "converts": []}
                return self._send(200, json.dumps(doc).encode())
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", p)
            if m:
                repo, rev, sub = m.group(1), unquote(m.group(2)), unquote(m.group(3) or "")
                b = self._repo_rev(repo, rev)
                if b is None:
                    return
                d = emu.root / repo / b / sub
                if not d.is_dir():
                    return self._err(404, "EntryNotFound")
                entries = []
                for q in sorted(d.iterdir()):
                    rel = f"{sub}/{q.name}" if sub else q.name
                    if q.is_dir():
                        entries.append({"type": "directory", "path": rel, "oid": "0" * 40, "size": 0})
                    else:
                        e = {"type": "file", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest(),
                             "size": q.stat().st_size}
                        if q.name.endswith(LFS_SUFFIXES):
                            e["lfs"] = {"oid": "f" * 64, "size": q.stat().st_size, "pointerSize": 134}
                            e["size"] = 134
                        entries.append(e)
                start = int(parse_qs(url.query).get("cursor", ["0"])[0])
                page = entries[start:start + emu.page_size] + list(emu.extra_listing)
                headers = {}
                if start + emu.page_size < len(entries):
                    nxt = f"{emu.endpoint}{url.path}?cursor={start + emu.page_size}"
                    headers["Link"] = f'<{nxt}>; rel="next"'
                return self._send(200, json.dumps(page).encode(), headers)
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", p)
            if m:
                repo, rev, path = m.group(1), unquote(m.group(2)), unquote(m.group(3))
                b = self._repo_rev(repo, rev)
                if b is None:
                    return
                f = emu.root / repo / b / path
                if not f.is_file():
                    return self._err(404, "EntryNotFound")
                commit = commit_of(b)
                size = f.stat().st_size
                st = f.stat()  # from size and mtime: never read a (possibly sparse, huge) file whole
                etag = f'"{hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()}"'
                if path.endswith(LFS_SUFFIXES):
                    loc = f"{emu.cdn_url}/cdn/{repo}/{commit}/{quote(path)}"
                    if "huge_size" in emu.mode:
                        size = 1 << 62
                    return self._send(302, b"", {"Location": loc, "X-Repo-Commit": commit, "X-Linked-Size": str(size),
                                                 "X-Linked-Etag": etag, "ETag": etag})
                return self._range_reply(f, {"X-Repo-Commit": commit, "ETag": etag})
            return self._err(404)

        # --- ranges (hub small files and the CDN) ------------------------------------------------------
        def _range_reply(self, f: Path, headers: dict):
            data_len = f.stat().st_size
            rng = self.headers.get("Range")
            if rng is None or "ignore_range" in emu.mode and role == "cdn":
                body = f.read_bytes() if self.command == "GET" else b""
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(data_len))
                self.end_headers()
                return self._body(body)
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng)
            if not m:
                return self._err(416)
            a, b = int(m.group(1)), min(int(m.group(2)), data_len - 1)
            if a >= data_len:
                return self._err(416)
            if "wrong_range" in emu.mode and role == "cdn":
                a, b = a + 1, min(b + 1, data_len - 1)
            if "endless" in emu.mode and role == "cdn":
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {a}-{b}/{data_len}")
                self.send_header("Connection", "close")
                self.end_headers()
                chunk = b"\0" * 65536
                for _ in range(1024):  # 64 MiB at most: bounded even for a client that never stops reading
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        break
                    with emu._lock:
                        emu.bytes_served[role] += len(chunk)
                        self._rec["bytes"] += len(chunk)
                self.close_connection = True
                return
            with open(f, "rb") as fh:
                fh.seek(a)
                body = fh.read(b - a + 1)
            if "huge_length" in emu.mode and role == "cdn" and a == 0:
                body = struct.pack("<Q", 1 << 40)[: len(body)] + body[8:]
            self.send_response(206)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Range", f"bytes {a}-{b}/{data_len}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self._body(body)

        def _cdn(self):
            p = urlsplit(self.path).path
            if "redirect_loop" in emu.mode:
                return self._send(302, b"", {"Location": self.path})
            if "redirect_scheme" in emu.mode:
                return self._send(302, b"", {"Location": "file:///etc/passwd"})
            m = re.fullmatch(r"/cdn/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)", p)
            if not m:
                return self._err(404)
            repo, commit, path = m.group(1), m.group(2), unquote(m.group(3))
            b = emu.resolve_rev(repo, commit)
            f = emu.root / repo / (b or "") / path
            if b is None or not f.is_file():
                return self._err(404)
            return self._range_reply(f, {"ETag": f'"cdn-{commit[:12]}"'})

    return H
