"""The verify pass of ``gguf_write``: the written GGUF file re-read through the bounded pre-scan, its key
metadata read back (``scalar_kvs``), every tensor's bytes against the digest (``Digest``: CRC-32 and length) of
what was produced, and with ``verify="full"`` a decode of every tensor compared with the source."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..errors import ErrorCode, Exl2Error
from .base import LayerReport, error_stats
from .gguf_io import decode

__all__ = ["Digest", "digest_of_file_range", "scalar_kvs", "type_name", "verify_gguf"]

def type_name(type_id: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(int(type_id)).name
    except ValueError:
        return f"type {type_id}"


class Digest:
    """CRC-32 and length of a byte stream fed in pieces (zlib: several GB/s, no JIT to load).  It guards the
    copy from memory to disk of bytes this process produced (a torn or misplaced write), not against an adversary."""

    __slots__ = ("crc", "n")

    def __init__(self):
        self.crc, self.n = 0, 0

    def update(self, data) -> "Digest":
        import zlib

        self.crc = zlib.crc32(data, self.crc)
        self.n += memoryview(data).nbytes
        return self

    def digest(self) -> tuple[int, int]:
        return self.crc, self.n


def digest_of_file_range(path: str, offset: int, length: int, window: int = 16 << 20) -> bytes:
    """``Digest`` of ``length`` bytes of ``path`` at ``offset``, read ``window`` bytes at a time (pread)."""
    d = Digest()
    buf = bytearray(min(window, max(length, 1)))
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos, end = offset, offset + length
        while pos < end:
            n = os.preadv(fd, [mv[: min(len(buf), end - pos)]], pos)
            if n <= 0:
                raise Exl2Error(ErrorCode.TRUNCATED, "the written file is shorter than its tensor table", file=path)
            d.update(mv[:n])
            pos += n
    finally:
        os.close(fd)
    return d.digest()


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def scalar_kvs(path, keys: set[str]) -> dict:
    """The values of the scalar (and string) metadata ``keys`` of a little-endian GGUF file that has passed the
    bounded pre-scan (so every length read here is known to lie inside the file)."""
    import mmap
    import struct

    out: dict = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        n_kv = struct.unpack_from("<Q", mm, 16)[0]
        pos = 24

        def string(p):
            n = struct.unpack_from("<Q", mm, p)[0]
            return bytes(mm[p + 8:p + 8 + n]).decode("utf-8", "replace"), p + 8 + n

        def skip(t, p):
            if t in _GGUF_SCALARS:
                return p + struct.calcsize("<" + _GGUF_SCALARS[t])
            if t == 8:
                return string(p)[1]
            et, cnt = struct.unpack_from("<IQ", mm, p)
            p += 12
            if et in _GGUF_SCALARS:
                return p + cnt * struct.calcsize("<" + _GGUF_SCALARS[et])
            for _ in range(cnt):
                p = skip(et, p)
            return p

        for _ in range(n_kv):
            key, pos = string(pos)
            t = struct.unpack_from("<I", mm, pos)[0]
            pos += 4
            if key in keys and t in _GGUF_SCALARS:
                out[key] = struct.unpack_from("<" + _GGUF_SCALARS[t], mm, pos)[0]
            elif key in keys and t == 8:
                out[key] = string(pos)[0]
            pos = skip(t, pos)
    return out

def verify_gguf(path: Path, items, hp, arch, report, progress, total, mode) -> None:
    """Re-read the written file: the bounded pre-scan's tensor table (names, ggml types, shapes, offsets), the
    key hyper-parameters (``scalar_kvs``), every tensor's bytes against the digest of what was produced; with
    ``mode == "full"`` also ``gguf.GGUFReader`` and a decode of every tensor.  (``GGUFReader`` builds a Python
    object per vocabulary string, seconds for a 32k vocabulary, so the default pass does without it.)"""
    from .gguf_io import open_gguf, prescan_gguf

    reader = None
    if mode == "full":
        reader, scan = open_gguf(path)
    else:
        scan = prescan_gguf(path)
    try:
        have = {t[0]: t for t in scan["tensors"]}
        planned = {it.gguf_name for it in items}
        if set(have) != planned:
            raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the written GGUF's tensors differ from the plan "
                            f"(missing {sorted(planned - set(have))[:3]}, unexpected {sorted(set(have) - planned)[:3]})",
                            file=str(path))
        want = {f"{arch}.block_count": hp["n_layer"], f"{arch}.embedding_length": hp["n_embd"],
                f"{arch}.attention.head_count": hp["n_head"]}
        kv = scalar_kvs(path, set(want))
        for k, v in want.items():
            if kv.get(k) != v:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"metadata {k} reads back as {kv.get(k)}, written {v}",
                                file=str(path))
        rtensors = {t.name: t for t in reader.tensors} if reader is not None else {}
        done = total
        for it in items:
            name, ne, gtype_id, off, _numel, nbytes = have[it.gguf_name]
            shape = tuple(int(x) for x in reversed(ne))
            tname = type_name(gtype_id)
            if tname != it.gtype or shape != it.shape or nbytes != it.nbytes:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"reads back as {tname} {list(shape)}, "
                                f"planned {it.gtype} {list(it.shape)}", tensor=it.gguf_name, file=str(path))
            if digest_of_file_range(str(path), scan["data_start"] + off, nbytes) != it.sum:
                raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "the bytes on disk differ from the bytes produced "
                                "(digest)", tensor=it.gguf_name, file=str(path))
            if mode == "full" and it.redecode is not None:
                t = rtensors[it.gguf_name]
                got = decode(np.array(t.data), it.gtype).reshape(it.shape)
                want_w = it.redecode()
                if isinstance(it.report, LayerReport) and it.report.exact:
                    ok = np.array_equal(got.astype(np.float16).view(np.uint16),
                                        want_w.astype(np.float16).view(np.uint16))
                elif isinstance(it.report, LayerReport):
                    s = error_stats(got, want_w)
                    ok = math.isclose(s["rel_error"], it.report.rel_error, rel_tol=1e-6, abs_tol=1e-12)
                else:
                    d = np.abs(got - want_w)
                    ok = bool((d[np.isfinite(d)].max() if d.size else 0.0) <= it.report.max_abs_error)
                if not ok:
                    raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, "decoding the written tensor again does not give "
                                    "what was reported", tensor=it.gguf_name, file=str(path))
            if it.report is not None:
                it.report.verified = True
            for part in it.parts:
                part.verified = True
            done += it.nbytes
            if progress is not None:
                progress(done, 2 * total, f"verify {it.gguf_name}")
    finally:
        reader = None
    report.validation = {"result": "PASS", "counts": {"tensors": len(items)}, "problems": []}
    report.verified = True
    report.verify_mode = ("re-read through the bounded GGUF pre-scan; key metadata read back; every tensor's bytes "
                          "checked (CRC-32 and length)" + ("; gguf.GGUFReader and every tensor decoded again and compared "
                                                  "with the source" if mode == "full" else ""))
