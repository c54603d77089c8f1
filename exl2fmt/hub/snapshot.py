"""The model reader: ``fetch_snapshot`` lists a Hub folder, pins one commit, reads the JSON files whole and each
safetensors header (and the EXL2 ``q_groups`` tables and the EXL3 codebook markers) by range into a sparse local
image; a ``.gguf`` file's
header is read in growing prefixes (the package docstring of ``exl2fmt.hub`` has the steps)."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..errors import ErrorCode, Exl2Error
from ..layout import Exl2Slot, Exl3Slot
from .client import MAX_JSON_BYTES, HubClient, HubStats
from .paths import HubRef, hub_error

__all__ = ["HubSnapshot", "fetch_snapshot", "MAX_GROUPS_BYTES", "MAX_BYTES_PER_FILE", "GGUF_FIRST_FETCH",
           "GGUF_PREAMBLE"]

MAX_GROUPS_BYTES = 4 * 32767
"""Largest ``q_groups`` tensor fetched: shape (2G,) I16 is 4 bytes a group, G <= 32767."""
MAX_BYTES_PER_FILE = 8 + 100_000_000 + (16 << 20)
"""Most bytes fetched from one file: the largest header the parser accepts plus the q_groups tables."""
_JSON_FILES = ("config.json", "quantize_config.json", "quantization_config.json")
#: JSON side files that are read when they fit under ``MAX_JSON_BYTES`` and left out (their checks skipped, as for a
#: local model without them) when they do not: EXL3's ``quantization_config.json`` (a tensor map of every module)
_OPTIONAL_JSON = ("quantization_config.json",)
_EXL3_MARKERS = (f".{Exl3Slot.MCG}", f".{Exl3Slot.MUL1}")


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
    return hub_error(ErrorCode.IO_ERROR, f"cannot write its local image in the temporary directory (TMPDIR): "
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
        raise hub_error(ErrorCode.IO_ERROR, f"the temporary directory {path.parent.parent} cannot hold sparse files "
                       f"({blocks * 512} bytes allocated for {len(head)} written); set TMPDIR to a filesystem that "
                       "can (ext4, xfs, btrfs, tmpfs, APFS)", where)


def fetch_snapshot(ref: HubRef, *, groups: bool = True) -> HubSnapshot:
    """Read the headers of the safetensors model (or ``.safetensors`` file) at ``ref`` into a sparse local image;
    see the module docstring.  ``groups`` also fetches the EXL2 ``q_groups`` tables and the EXL3 codebook
    markers (I32 scalars whose value validate checks)."""
    from ..container import MAX_HEADER_BYTES, parse_header

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
            raise hub_error(ErrorCode.HUB_NOT_FOUND, f"no file {single!r} at revision {ref.rev!r}", ref.uri())
        shards = [single]
        jsons = [n for n in _JSON_FILES if n in names]
    else:
        shards = sorted(n for n in names if n.endswith(".safetensors"))
        jsons = sorted(n for n in names if n in _JSON_FILES or n.endswith(".safetensors.index.json"))
        if not shards and not any(n.endswith(".index.json") for n in jsons):
            ggufs = sorted(n for n in names if n.endswith(".gguf"))
            hint = f", but {len(ggufs)} .gguf file(s) (e.g. {ggufs[0]})" if ggufs else ""
            raise hub_error(ErrorCode.NO_SAFETENSORS, f"expected at least one .safetensors file, found none{hint}",
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
                raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{n}: served from commit {c}, the other files from "
                               f"{commit}", ref.uri(prefix + n))
            listed = names[n]["size"]
            if listed is not None and listed != size:
                raise hub_error(ErrorCode.HUB_BAD_RESPONSE, f"{n}: the listing says {listed} bytes, the file "
                               f"metadata {size}", ref.uri(prefix + n))
            if commit and f"/resolve/{quote(revision, safe='')}/" in loc and revision != commit:
                loc = loc.replace(f"/resolve/{quote(revision, safe='')}/", f"/resolve/{commit}/", 1)  # pin it
            metas[n] = (size, loc)
            files.append({"path": ref.uri(prefix + n), "size": size})
        for n in jsons:
            size, loc = metas[n]
            if size > MAX_JSON_BYTES and n in _OPTIONAL_JSON:
                continue
            if size > MAX_JSON_BYTES:
                raise hub_error(ErrorCode.HUB_FETCH_LIMIT, f"{n} is {size} bytes, above the cap of {MAX_JSON_BYTES}",
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
                raise hub_error(ErrorCode.HUB_FETCH_LIMIT, f"a {hlen}-byte header", where)
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
                    groups_table = (t.name.endswith(f".{Exl2Slot.Q_GROUPS}") and t.dtype == "I16"
                                    and 0 < t.nbytes <= MAX_GROUPS_BYTES)
                    marker = t.name.endswith(_EXL3_MARKERS) and t.dtype == "I32" and t.nbytes == 4
                    if groups_table or marker:
                        budget -= t.nbytes
                        if budget < 0:
                            raise hub_error(ErrorCode.HUB_FETCH_LIMIT, f"the q_groups tables and markers of {n} exceed "
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
    from ..gguf_scan import GGUF_MAX_KV, GGUF_MAX_TENSORS

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
    from ..inspect import inspect_gguf

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
                        raise hub_error(ErrorCode.HUB_FETCH_LIMIT, f"no complete GGUF header within the first "
                                       f"{have} bytes (the cap): {e.message}", where) from None
                    raise Exl2Error(e.code, e.message.replace(str(image), where), file=where, tensor=e.tensor) \
                        from None
                want = min(limit, have * 2)
                continue
            ds = int(rep["gguf"].get("data_start") or 0)
            if ds <= have:
                break
            if ds > limit:
                raise hub_error(ErrorCode.HUB_FETCH_LIMIT, f"a GGUF header of {ds} bytes exceeds the per-file cap of "
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
