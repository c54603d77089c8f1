"""hf:// models read by range (exl2fmt/hub/) against a local emulation of the Hub (tests/hub_server.py).

The oracle for "only the headers were read" is the emulator's own byte count of every body it served, compared
with sums computed independently from the local files (8 + n per shard from ``read_header``, the q_groups
tensors' byte ranges, the JSON files' sizes).  Reports are compared with ``inspect`` / ``validate`` of the same
files on disk.  Never the real network: HF_ENDPOINT points at 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("huggingface_hub")

from exl2fmt.cli.app import app  # noqa: E402
from exl2fmt.container import read_header, write_sharded  # noqa: E402
from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.hub import HubRef, fetch_snapshot, inspect_hub, parse_hub_uri  # noqa: E402
from exl2fmt.validate.remote import validate_hub  # noqa: E402
from exl2fmt.inspect import inspect_model  # noqa: E402
from exl2fmt.sample import write_sample  # noqa: E402
from exl2fmt.validate import validate_model  # noqa: E402

from hub_server import HubEmulator, commit_of  # noqa: E402

runner = CliRunner()
TOKEN = "hf_test_secret_token"


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    # org/m-exl2: one branch per bitrate (the sample on "4.0bpw", a sharded copy with an index on "sharded")
    write_sample(root / "org/m-exl2/4.0bpw")
    (root / "org/m-exl2/main").mkdir(parents=True)
    (root / "org/m-exl2/main/README.md").write_text("card")
    from safetensors.numpy import load_file

    tensors = load_file(str(root / "org/m-exl2/4.0bpw/output.safetensors"))
    sh = root / "org/m-exl2/sharded"
    sh.mkdir()
    shutil.copy(root / "org/m-exl2/4.0bpw/config.json", sh / "config.json")
    write_sharded(sh, tensors, max_shard_bytes=600_000)
    # org/m-gguf: a .gguf file whose header (a 3000-token vocabulary) is larger than the first range read
    try:
        import gguf

        (root / "org/m-gguf/main").mkdir(parents=True)
        w = gguf.GGUFWriter(str(root / "org/m-gguf/main/m.gguf"), arch="llama")
        w.add_block_count(1)
        w.add_token_list([f"token-{i:05d}" for i in range(3000)])
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((512, 512), np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    except ImportError:
        pass
    # org/private: the same model behind a token
    shutil.copytree(root / "org/m-exl2/4.0bpw", root / "org/private/main")
    # org/src-fp16: the "FP16 source" of the sample: {key}.weight [N, K] for every layer, the rest as is
    cfg = json.loads((root / "org/m-exl2/4.0bpw/config.json").read_text())
    src = {}
    for name, a in tensors.items():
        if name.endswith(".q_weight"):
            key = name[: -len(".q_weight")]
            K = tensors[f"{key}.q_invperm"].shape[0]
            src[f"{key}.weight"] = np.zeros((a.shape[1], K), np.float16)
        elif not any(name.endswith(s) for s in (".q_scale", ".q_scale_max", ".q_groups", ".q_invperm", ".q_perm")):
            src[name] = a
    narrow = dict(src)
    key = "model.layers.1.mlp.down_proj.weight"
    narrow[key] = np.zeros((src[key].shape[0], src[key].shape[1] - 32), np.float16)
    for branch, c, t in (("main", cfg, src), ("wrong", dict(cfg, hidden_size=cfg["hidden_size"] * 2), src),
                         ("narrow", cfg, narrow)):
        d = root / "org/src-fp16" / branch
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if k != "quantization_config"}))
        write_sharded(d, t, max_shard_bytes=1 << 20)
    return root


@pytest.fixture()
def emu(hub_root, monkeypatch, tmp_path):
    with HubEmulator(hub_root, token=TOKEN, private=("org/private",), page_size=2) as e:
        monkeypatch.setenv("HF_ENDPOINT", e.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login of the machine
        monkeypatch.setenv("EXL2FMT_HUB_TIMEOUT", "10")
        yield e


def _expected_cdn_bytes(files) -> int:
    """Independent oracle: 8 + n per safetensors file plus every I16 *.q_groups tensor's bytes."""
    total = 0
    for f in files:
        h = read_header(f)
        total += 8 + h.header_len
        total += sum(t.nbytes for t in h.tensors.values() if t.name.endswith(".q_groups") and t.dtype == "I16")
    return total


def _strip(rep: dict, local: str, remote: str) -> dict:
    s = json.dumps({k: v for k, v in rep.items() if k not in ("hub", "path", "tool")})
    return json.loads(s.replace(json.dumps(local)[1:-1], remote))


# ------------------------------------------------------------------------------------------------ URIs


def test_parse_hub_uri():
    assert parse_hub_uri("hf://org/repo") == HubRef("org/repo", None, "")
    assert parse_hub_uri("hf://org/repo@4.0bpw") == HubRef("org/repo", "4.0bpw", "")
    assert parse_hub_uri("hf://org/repo@refs/pr/3/sub/x.safetensors") == HubRef("org/repo", "refs/pr/3",
                                                                                 "sub/x.safetensors")
    assert parse_hub_uri("hf://org/repo@a%2Fb/sub") == HubRef("org/repo", "a/b", "sub")
    assert parse_hub_uri("hf://org/repo", revision="6.5bpw").rev == "6.5bpw"
    for bad in ("hf://org", "hf://org/re po", "hf://org/repo/../x", "hf://org/repo@", "hf://../x"):
        with pytest.raises(Exl2Error) as ei:
            parse_hub_uri(bad)
        assert ei.value.code is ErrorCode.USAGE
    with pytest.raises(Exl2Error) as ei:
        parse_hub_uri("hf://org/repo@a", revision="b")
    assert ei.value.code is ErrorCode.USAGE


# ------------------------------------------------------------------------------------------------ inspect


def test_inspect_reads_only_headers_and_groups(emu, hub_root):
    local = hub_root / "org/m-exl2/4.0bpw"
    rep = inspect_hub("hf://org/m-exl2@4.0bpw")
    # the same report as for the directory on disk (paths aside)
    want = inspect_model(local)
    assert _strip(rep, str(local), "hf://org/m-exl2@4.0bpw") == _strip(want, str(local), "hf://org/m-exl2@4.0bpw")
    assert rep["path"] == "hf://org/m-exl2@4.0bpw"
    assert rep["files"][0]["path"] == "hf://org/m-exl2@4.0bpw/output.safetensors"
    assert any(r["plan"] for r in rep["layers"])  # the group plans need q_groups: they are there
    # ranged reads only: every CDN request carried a Range, the bytes served are the headers + q_groups
    cdn = [r for r in emu.requests if r["server"] == "cdn"]
    assert cdn and all(r["range"] for r in cdn)
    expect = _expected_cdn_bytes([local / "output.safetensors"])
    assert emu.bytes_served["cdn"] == expect
    size = (local / "output.safetensors").stat().st_size
    assert expect < size / 100
    h = rep["hub"]
    assert h["commit"] == commit_of("4.0bpw") and h["revision"] == "4.0bpw"
    assert h["model_bytes"] == size + (local / "config.json").stat().st_size
    listing = sum(r["bytes"] for r in emu.requests if "/api/models/" in r["path"])
    assert 0 < listing < 4096
    assert h["bytes_fetched"] == expect + (local / "config.json").stat().st_size + listing


def test_inspect_sharded_with_index_pins_the_commit(emu, hub_root):
    local = hub_root / "org/m-exl2/sharded"
    shards = sorted(local.glob("*.safetensors"))
    assert len(shards) >= 3
    rep = inspect_hub("hf://org/m-exl2", revision="sharded")
    want = inspect_model(local)
    assert _strip(rep, str(local), "hf://org/m-exl2@sharded") == _strip(want, str(local), "hf://org/m-exl2@sharded")
    assert rep["index"] == "hf://org/m-exl2@sharded/model.safetensors.index.json"
    assert emu.bytes_served["cdn"] == _expected_cdn_bytes(shards)
    # the listing was paginated (page_size=2) and followed; every file after the first was read at the commit
    assert sum(1 for r in emu.requests if "/tree/" in r["path"]) >= 3
    heads = [r["path"] for r in emu.requests if r["method"] == "HEAD"]
    assert all(f"/resolve/{commit_of('sharded')}/" in p for p in heads[1:])


def test_validate_hub_matches_local(emu, hub_root):
    local = hub_root / "org/m-exl2/sharded"
    doc, code = validate_hub("hf://org/m-exl2@sharded")
    want = validate_model(local).as_dict()
    assert code == 0 == want["exit_code"]
    assert [(c["check"], c["status"], c["code"]) for c in doc["checks"]] == \
        [(c["check"], c["status"], c["code"]) for c in want["checks"]]
    assert doc["hub"]["bytes_fetched"] < doc["hub"]["model_bytes"] / 50


def test_cli_inspect_and_validate(emu):
    r = runner.invoke(app, ["inspect", "hf://org/m-exl2@4.0bpw", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    from test_cli import SCHEMA, check_schema

    check_schema(doc, SCHEMA["$defs"]["inspect"])
    r = runner.invoke(app, ["inspect", "hf://org/m-exl2@4.0bpw", "--no-layers"])
    assert r.exit_code == 0 and "hub" in r.stdout and "requests" in r.stdout
    r = runner.invoke(app, ["validate", "hf://org/m-exl2", "--revision", "4.0bpw", "--json"])
    assert r.exit_code == 0, r.output
    check_schema(json.loads(r.stdout), SCHEMA["$defs"]["validate"])
    r = runner.invoke(app, ["validate", "hf://org/m-exl2@4.0bpw", "--deep"])
    assert r.exit_code == 2
    r = runner.invoke(app, ["inspect", "./model", "--revision", "x"])
    assert r.exit_code == 2


def test_missing_revision_lists_branches(emu):
    r = runner.invoke(app, ["inspect", "hf://org/m-exl2@5.0bpw", "--json"])
    assert r.exit_code == 3
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "HUB_NOT_FOUND"
    assert "4.0bpw" in err["message"] and "sharded" in err["message"] and "main" in err["message"]
    r = runner.invoke(app, ["inspect", "hf://org/nothing", "--json"])
    assert r.exit_code == 3 and json.loads(r.stdout)["error"]["code"] == "HUB_NOT_FOUND"
    r = runner.invoke(app, ["inspect", "hf://org/m-exl2", "--json"])  # main holds no model
    assert r.exit_code == 3 and json.loads(r.stdout)["error"]["code"] == "NO_SAFETENSORS"


def test_token_goes_to_the_hub_only(emu, monkeypatch):
    with pytest.raises(Exl2Error) as ei:
        inspect_hub("hf://org/private")
    assert ei.value.code is ErrorCode.HUB_ACCESS_DENIED and "HF_TOKEN" in ei.value.message
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    emu.reset()
    rep = inspect_hub("hf://org/private")
    assert rep["summary"]["linear_layers"] == 15
    hub = [r for r in emu.requests if r["server"] == "hub" and "/org/private" in r["path"]]
    cdn = [r for r in emu.requests if r["server"] == "cdn"]
    assert hub and all(r["authorization"] == f"Bearer {TOKEN}" for r in hub)
    assert cdn and all(r["authorization"] is None for r in cdn)  # the redirect went to another origin


@pytest.mark.parametrize("mode, code", [
    ("huge_length", ErrorCode.HEADER_TOO_LARGE),
    ("ignore_range", ErrorCode.HUB_BAD_RESPONSE),
    ("endless", ErrorCode.HUB_BAD_RESPONSE),
    ("wrong_range", ErrorCode.HUB_BAD_RESPONSE),
    ("redirect_loop", ErrorCode.HUB_BAD_RESPONSE),
    ("redirect_scheme", ErrorCode.HUB_BAD_RESPONSE),
    ("huge_size", ErrorCode.HUB_BAD_RESPONSE),
])
def test_hostile_servers(emu, mode, code):
    emu.mode = {mode}
    t0 = time.monotonic()
    with pytest.raises(Exl2Error) as ei:
        inspect_hub("hf://org/m-exl2@4.0bpw")
    assert ei.value.code is code, ei.value
    assert "hf://org/m-exl2@4.0bpw" in (ei.value.file or "")
    assert time.monotonic() - t0 < 8
    # the client stopped reading: far less than the file (the endless body is 64 MiB, the file 1.5 MB)
    assert emu.bytes_served["cdn"] < 8 << 20


@pytest.mark.parametrize("mode", ["ignore_range", "endless"])
def test_client_stops_reading(emu, mode):
    """A 200 with the whole file is refused before its body is read; an endless 206 body is cut one chunk past
    the range (client-side byte count)."""
    from exl2fmt.hub import READ_CHUNK, HubClient

    emu.mode = {mode}
    cl = HubClient(parse_hub_uri("hf://org/m-exl2@4.0bpw"))
    url = f"{emu.cdn_url}/cdn/org/m-exl2/{commit_of('4.0bpw')}/output.safetensors"
    with pytest.raises(Exl2Error) as ei:
        cl.get(url, "probe", start=0, length=1000, file="f")
    assert ei.value.code is ErrorCode.HUB_BAD_RESPONSE
    if mode == "ignore_range":
        assert cl.stats.bytes_fetched == 0
    else:  # it did read past the range (that is how it knows), and stopped within one chunk
        assert 1000 < cl.stats.bytes_fetched <= 1000 + READ_CHUNK


def test_hostile_cli_exit_code(emu):
    emu.mode = {"endless"}
    r = runner.invoke(app, ["validate", "hf://org/m-exl2@4.0bpw", "--json"])
    assert r.exit_code == 3
    assert json.loads(r.stdout)["error"]["code"] == "HUB_BAD_RESPONSE"


def test_offline_and_unreachable(emu, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Exl2Error) as ei:
        inspect_hub("hf://org/m-exl2@4.0bpw")
    assert ei.value.code is ErrorCode.HUB_UNREACHABLE
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(Exl2Error) as ei:
        inspect_hub("hf://org/m-exl2@4.0bpw")
    assert ei.value.code is ErrorCode.HUB_UNREACHABLE


def test_snapshot_is_sparse_and_removed(emu, hub_root):
    ref = parse_hub_uri("hf://org/m-exl2@4.0bpw")
    with fetch_snapshot(ref) as snap:
        f = snap.target / "output.safetensors"
        size = (hub_root / "org/m-exl2/4.0bpw/output.safetensors").stat().st_size
        assert f.stat().st_size == size
        if hasattr(os.stat_result, "st_blocks"):
            assert f.stat().st_blocks * 512 < size  # holes, not data
        root = snap.root
    assert not root.exists()


def test_inspect_gguf_reads_the_header_in_growing_ranges(emu, hub_root, monkeypatch):
    pytest.importorskip("gguf")
    import exl2fmt.hub.snapshot as hub

    local = hub_root / "org/m-gguf/main/m.gguf"
    monkeypatch.setattr(hub, "GGUF_FIRST_FETCH", 4096)  # smaller than the header: forces further reads
    rep = inspect_hub("hf://org/m-gguf/m.gguf")
    want = inspect_model(local)
    assert rep["input"] == "gguf"
    assert rep["summary"] == want["summary"] and rep["gguf"] == want["gguf"]
    ds = want["gguf"]["data_start"]
    assert 4096 < ds < local.stat().st_size / 4
    served = emu.bytes_served["cdn"]
    assert ds <= served <= 2 * ds  # the header (at most twice over), never the tensor data
    assert all(r["range"] for r in emu.requests if r["server"] == "cdn")
    assert rep["files"][0]["path"] == "hf://org/m-gguf/m.gguf"
    r = runner.invoke(app, ["validate", "hf://org/m-gguf/m.gguf", "--json"])
    assert r.exit_code == 3 and json.loads(r.stdout)["error"]["code"] == "UNSUPPORTED_INPUT"


# ------------------------------------------------------------------------------------------------ --reference hf://


def test_reference_on_the_hub_by_shapes(emu, hub_root):
    local = hub_root / "org/m-exl2/4.0bpw"
    r = runner.invoke(app, ["validate", str(local), "--reference", "hf://org/src-fp16", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    ref = [c for c in doc["checks"] if c["check"] == "reference"]
    assert [c["code"] for c in ref] == ["REFERENCE_OK"] and ref[0]["count"] > 15
    assert doc["reference"] == "hf://org/src-fp16" and doc["deep"] is False
    # headers only: the source's data was never asked for
    src = sorted((hub_root / "org/src-fp16/main").glob("*.safetensors"))
    assert emu.bytes_served["cdn"] == sum(8 + read_header(f).header_len for f in src)
    # a source whose config disagrees fails the gate
    r = runner.invoke(app, ["validate", str(local), "--reference", "hf://org/src-fp16@wrong", "--json"])
    assert r.exit_code == 1
    bad = [c for c in json.loads(r.stdout)["checks"] if c["status"] == "FAIL"]
    assert bad and all(c["code"] == "REFERENCE_MISMATCH" for c in bad)
    assert any("hidden_size" in c["message"] for c in bad)
    # a layer whose source weight has another shape is named
    r = runner.invoke(app, ["validate", str(local), "--reference", "hf://org/src-fp16", "--revision", "narrow",
                            "--format", "github"])
    assert r.exit_code == 1
    errs = [l for l in r.stdout.splitlines() if l.startswith("::error ")]
    assert len(errs) == 1 and "REFERENCE_MISMATCH" in errs[0] and "model.layers.1.mlp.down_proj" in errs[0]


# ------------------------------------------------------------------------------------------------ the extra


def test_missing_extra_says_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import huggingface_hub -> ImportError
    r = runner.invoke(app, ["inspect", "hf://org/repo"])
    assert r.exit_code == 3, r.output
    assert "pip install 'exl2fmt[hub]'" in r.stderr and "UNSUPPORTED_INPUT" in r.stderr
