"""Issue 41, class 5: the Hub reader against a misbehaving server (spec/malformed/hostile3_hub/README.md).

Each case runs ``exl2fmt inspect|validate hf://...`` in a fresh bounded process (``hostile_harness.run_bounded``:
wall time, address space, peak RSS, no traceback) against the local emulation of the Hub (tests/hub_server.py,
in this process, so its own count of the bytes it served is the oracle for "what the client asked for"):

* trickled response headers (one header line every 0.5 s, for a minute) on the listing, the HEAD and the ranged
  GET: ``HUB_UNREACHABLE`` within the per-request timeout; and the command's total deadline;
* hostile names in the listing (NUL, newlines, a workflow command, ``..``, absolute, backslash, bidi override,
  300 bytes): ``HUB_BAD_RESPONSE``, the name escaped, never the temporary directory;
* a byte budget: 8 shards with 95 MB headers stop at the budget (256 MiB), refused before the next range is
  asked for; ``EXL2FMT_HUB_MAX_BYTES`` lowers / raises it;
* an invalid GGUF is refused on its 24-byte preamble: the server sends 24 bytes of a 64 MiB file.
"""

from __future__ import annotations

import json
import os
import struct
import time

import pytest

pytest.importorskip("huggingface_hub")

from hostile_harness import run_bounded  # noqa: E402
from hub_server import HubEmulator  # noqa: E402

from exl2fmt.sample import write_sample  # noqa: E402

URI = "hf://org/m@4.0bpw"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("hub3")
    write_sample(r / "org/m/4.0bpw")
    return r


@pytest.fixture()
def emu(root, monkeypatch, tmp_path):
    with HubEmulator(root) as e:
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        for k in ("EXL2FMT_HUB_TIMEOUT", "EXL2FMT_HUB_TOTAL_TIMEOUT", "EXL2FMT_HUB_MAX_BYTES"):
            monkeypatch.delenv(k, raising=False)
        e.env = {"HF_ENDPOINT": e.endpoint, "HF_HOME": str(tmp_path / "hf-home"), "TMPDIR": str(tmp_path)}
        (tmp_path / "hf-home").mkdir()
        yield e


def _run(emu, *args, timeout=10.0, **env):
    r = run_bounded(*args, "--json", timeout=timeout, env_extra={**emu.env, **env})
    r.check_bounds()
    try:
        err = json.loads(r.stdout).get("error")
    except ValueError:
        err = None
    return r, err


def _no_temp_paths(r, tmp):
    leftovers = [p.name for p in tmp.iterdir() if p.name.startswith("exl2fmt-hub-")]
    assert leftovers == []  # the temporary image is gone ...
    assert "exl2fmt-hub-" not in r.stdout + r.stderr  # ... and never named


# ------------------------------------------------------------------------------------------------ time


@pytest.mark.parametrize("mode", ["trickle_list", "trickle_head", "trickle_get"])
def test_trickled_headers_end_at_the_request_deadline(emu, tmp_path, mode):
    emu.mode = {mode}
    t0 = time.monotonic()
    r, err = _run(emu, "validate", URI, EXL2FMT_HUB_TIMEOUT="2")
    wall = time.monotonic() - t0
    assert r.rc == 3 and err["code"] == "HUB_UNREACHABLE", (r.stdout, r.stderr[-2000:])
    assert err["file"].startswith(URI) and "EXL2FMT_HUB_TIMEOUT" in err["message"]
    assert wall < 2 + 6  # the deadline plus start-up; the server would have trickled for 60 s
    trickled = [q for q in emu.requests if q["method"] in ("GET", "HEAD")]
    assert trickled  # the server was reached and did trickle
    _no_temp_paths(r, tmp_path)


def test_the_command_has_a_total_deadline(emu, tmp_path):
    emu.mode = {"trickle_get"}
    t0 = time.monotonic()
    r, err = _run(emu, "inspect", URI, EXL2FMT_HUB_TIMEOUT="60", EXL2FMT_HUB_TOTAL_TIMEOUT="2")
    assert time.monotonic() - t0 < 2 + 6
    assert r.rc == 3 and err["code"] == "HUB_UNREACHABLE" and "EXL2FMT_HUB_TOTAL_TIMEOUT" in err["message"]
    _no_temp_paths(r, tmp_path)


# ------------------------------------------------------------------------------------------------ names

HOSTILE_NAMES = {
    "nul": "a\x00b.safetensors",
    "newline": "x\n::error title=t::y.safetensors",
    "dotdot": "..",
    "traversal": "../../etc/passwd",
    "absolute": "/etc/passwd.safetensors",
    "backslash": "..\\..\\x.safetensors",
    "bidi": "\u202eelif.safetensors",
    "del": "a\x7fb.json",
    "long": "a" * 300 + ".safetensors",
    "long-path": "/".join(["d" * 200] * 6) + ".safetensors",
    "lone-surrogate": "\ud800.safetensors",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_NAMES))
def test_hostile_listed_names_are_refused_escaped(emu, tmp_path, case):
    name = HOSTILE_NAMES[case]
    emu.extra_listing = [{"type": "file", "path": name, "oid": "0" * 40, "size": 10}]
    for cmd in ("inspect", "validate"):
        r, err = _run(emu, cmd, URI)
        assert r.rc == 3 and err["code"] == "HUB_BAD_RESPONSE", (case, r.stdout[-1000:], r.stderr[-1000:])
        assert err["file"] == URI and "file listing" in err["message"]
        for c in "\x00\n\x7f\u202e":
            if c in name:
                assert c not in err["message"]
        assert "\\x00" in err["message"] if "\x00" in name else True
        _no_temp_paths(r, tmp_path)
    # the human error line: no raw control character reaches the terminal either
    r = run_bounded("inspect", URI, env_extra=emu.env)
    r.check_bounds()
    assert r.rc == 3 and "HUB_BAD_RESPONSE" in r.stderr
    assert not any(c in r.stderr for c in "\x00\x7f\u202e")


def test_a_legal_but_odd_name_is_an_ordinary_file(emu, tmp_path):
    """``##[error]x.safetensors`` is a valid file name: listed without a file behind it, it is a missing file
    (its rendering in CI is the output layer's business: the JSON escapes ``##[``)."""
    emu.extra_listing = [{"type": "file", "path": "##[error]x.safetensors", "oid": "0" * 40, "size": 10}]
    r, err = _run(emu, "validate", URI)
    assert r.rc == 3 and err["code"] == "HUB_NOT_FOUND" and err["file"].endswith("x.safetensors")
    _no_temp_paths(r, tmp_path)


def test_a_hostile_user_path_is_a_usage_error(emu, tmp_path):
    for path in ("a" * 300 + ".safetensors", "x\x07.safetensors", "a\\b.gguf"):
        r, err = _run(emu, "inspect", f"hf://org/m@4.0bpw/{path}")
        assert r.rc == 2 and err["code"] == "USAGE", (path, r.stdout[-800:])
        _no_temp_paths(r, tmp_path)
    assert emu.requests == []  # refused before any request


def test_ordinary_unicode_names_are_fine(emu, root, tmp_path):
    emu.extra_listing = [{"type": "file", "path": "模型说明 (v2) – notes.md", "oid": "0" * 40, "size": 10}]
    r, err = _run(emu, "validate", URI)
    assert r.rc == 0 and err is None, r.stdout[-1500:]


# ------------------------------------------------------------------------------------------------ bytes

BIG = 95_000_000


@pytest.fixture(scope="module")
def huge_repo(root):
    """org/huge@main: 8 shards whose headers are 95 MB each (one file, seven links to it: the server serves
    the same bytes under 8 names)."""
    d = root / "org/huge/main"
    d.mkdir(parents=True)
    head = json.dumps({"w": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    head += b" " * (BIG - len(head))  # trailing spaces: the padding writers use
    first = d / "model-00001-of-00008.safetensors"
    with open(first, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.write(b"\0" * 32)
    for i in range(2, 9):
        os.symlink(first.name, d / f"model-0000{i}-of-00008.safetensors")
    return d


def test_many_huge_headers_stop_at_the_byte_budget(emu, huge_repo, tmp_path):
    r, err = _run(emu, "inspect", "hf://org/huge", timeout=60.0)
    assert r.rc == 3 and err["code"] == "HUB_FETCH_LIMIT", (r.stdout[-1500:], r.stderr[-1500:])
    assert "EXL2FMT_HUB_MAX_BYTES" in err["message"] and err["file"].startswith("hf://org/huge/model-0000")
    served = emu.bytes_served["cdn"]
    assert 2 * BIG <= served <= 256 << 20  # two headers fit the default budget; the third is never asked for
    ranges = [q for q in emu.requests if q["server"] == "cdn" and q["range"] and q["range"] != "bytes=0-7"]
    assert len(ranges) == 2
    _no_temp_paths(r, tmp_path)


def test_the_budget_variable_lowers_and_raises_it(emu, tmp_path):
    r, err = _run(emu, "inspect", URI, EXL2FMT_HUB_MAX_BYTES="4K")
    assert r.rc == 3 and err["code"] == "HUB_FETCH_LIMIT" and "4096" in err["message"]
    assert emu.total_served <= 4096 + 2 * 65536  # within one chunk of each unranged body at most
    r, err = _run(emu, "inspect", URI, EXL2FMT_HUB_MAX_BYTES="1M")
    assert r.rc == 0 and err is None
    r, err = _run(emu, "inspect", URI, EXL2FMT_HUB_MAX_BYTES="lots")
    assert r.rc == 2 and err["code"] == "USAGE" and "EXL2FMT_HUB_MAX_BYTES" in err["message"]


GGUF_SIZE = 64 << 20


@pytest.mark.parametrize("case, preamble", [
    ("magic", b"GGUX" + struct.pack("<IQQ", 3, 1, 1)),
    ("version", b"GGUF" + struct.pack("<IQQ", 7, 1, 1)),
    ("kv-count", b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40)),
    ("tensor-count", b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1)),
])
def test_an_invalid_gguf_is_refused_on_its_preamble(emu, root, tmp_path, case, preamble):
    d = root / "org/gg" / case
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "m.gguf", "wb") as f:
        f.write(preamble)
        f.truncate(GGUF_SIZE)
    r, err = _run(emu, "inspect", f"hf://org/gg@{case}/m.gguf")
    assert r.rc == 1 and err["code"] == "GGUF_INVALID", (r.stdout[-1500:], r.stderr[-1500:])
    assert err["file"] == f"hf://org/gg@{case}/m.gguf"
    assert emu.bytes_served["cdn"] == 24  # the preamble, nothing more of the 64 MiB
    _no_temp_paths(r, tmp_path)
