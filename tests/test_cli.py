"""Tests of the exl2fmt command line: exit codes, JSON schema, escaping, --fix-index, --reference, demo, imports,
and the malformed-input catalogue (spec/malformed/index.json).

JSON output is checked against spec/inspect.schema.json with the small JSON-Schema subset checker below (no
third-party dependency).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from exl2fmt.cli.app import app
from exl2fmt.container import INDEX_NAME, write_safetensors, write_sharded
from exl2fmt.errors import ErrorCode
from exl2fmt.sample import SAMPLE_CONFIG, sample_dense_tensors, write_sample

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "spec" / "inspect.schema.json").read_text())
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    write_sample(d)
    return d


@pytest.fixture(scope="module")
def sample_tensors(sample_dir):
    from safetensors.numpy import load_file

    return load_file(str(sample_dir / "output.safetensors"))


# ------------------------------------------------------------------------------------------------ schema checker


class SchemaError(AssertionError):
    pass


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _type_ok(v, t) -> bool:
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, _TYPES[t])


def check_schema(v, s, root=SCHEMA, path="$"):
    """The JSON-Schema subset spec/inspect.schema.json uses: $ref, type, enum, const, properties, required,
    additionalProperties, propertyNames.pattern, items, oneOf, anyOf, minimum, maximum, pattern."""
    if "$ref" in s:
        node = root
        for part in s["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return check_schema(v, node, root, path)
    if "oneOf" in s:
        ok = [i for i, sub in enumerate(s["oneOf"]) if _valid(v, sub, root, path)]
        if len(ok) != 1:
            raise SchemaError(f"{path}: matches {len(ok)} of oneOf")
    if "anyOf" in s and not any(_valid(v, sub, root, path) for sub in s["anyOf"]):
        raise SchemaError(f"{path}: matches none of anyOf")
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_type_ok(v, t) for t in types):
            raise SchemaError(f"{path}: {v!r} is not {types}")
    if "const" in s and v != s["const"]:
        raise SchemaError(f"{path}: {v!r} != {s['const']!r}")
    if "enum" in s and v not in s["enum"]:
        raise SchemaError(f"{path}: {v!r} not in {s['enum']}")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"]:
            raise SchemaError(f"{path}: {v} < {s['minimum']}")
        if "maximum" in s and v > s["maximum"]:
            raise SchemaError(f"{path}: {v} > {s['maximum']}")
    if isinstance(v, str) and "pattern" in s and not re.search(s["pattern"], v):
        raise SchemaError(f"{path}: {v!r} !~ {s['pattern']}")
    if isinstance(v, dict):
        for r in s.get("required", []):
            if r not in v:
                raise SchemaError(f"{path}: missing {r}")
        props = s.get("properties", {})
        for k, x in v.items():
            if "propertyNames" in s:
                check_schema(k, s["propertyNames"], root, f"{path}.<key {k}>")
            if k in props:
                check_schema(x, props[k], root, f"{path}.{k}")
            else:
                ap = s.get("additionalProperties", True)
                if ap is False:
                    raise SchemaError(f"{path}: unexpected property {k!r}")
                if isinstance(ap, dict):
                    check_schema(x, ap, root, f"{path}.{k}")
    if isinstance(v, list) and "items" in s:
        for i, x in enumerate(v):
            check_schema(x, s["items"], root, f"{path}[{i}]")


def _valid(v, s, root, path) -> bool:
    try:
        check_schema(v, s, root, path)
        return True
    except SchemaError:
        return False


def test_schema_checker_rejects():
    good = {"report": "error", "schema_version": "1", "tool": {"name": "exl2fmt", "version": "0"},
            "error": {"code": "X", "category": None, "message": "m", "file": None, "tensor": None}, "exit_code": 3}
    check_schema(good, SCHEMA)
    for bad in ({**good, "exit_code": 0}, {**good, "extra": 1}, {k: v for k, v in good.items() if k != "error"},
                {**good, "tool": {"name": "other", "version": "0"}}):
        with pytest.raises(SchemaError):
            check_schema(bad, SCHEMA)


# ------------------------------------------------------------------------------------------------ exit codes


def test_help_has_examples_and_exit_codes():
    for cmd in ("inspect", "validate", "sample", "dequantize", "demo"):
        r = run(cmd, "--help")
        assert r.exit_code == 0 and "Examples" in r.stdout, cmd
    text = re.sub(r"\s+", " ", run("validate", "--help").stdout)
    assert all(s in text for s in ("0 every check passed", "1 a check failed", "2 usage error", "3 unreadable"))
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("exl2fmt ")


def test_good_input_exits_0(sample_dir):
    r = run("inspect", sample_dir)
    assert r.exit_code == 0 and "model.layers.0.mlp.down_proj" in r.stdout and "0.091:8b_32g" in r.stdout
    r = run("validate", sample_dir)
    assert r.exit_code == 0 and "PASS LAYERS_OK" in r.stdout and "Traceback" not in r.output


def test_invalid_input_exits_1(tmp_path, sample_tensors):
    t = dict(sample_tensors)
    qg = t["lm_head.q_groups"].copy()
    qg[0] = 7
    t["lm_head.q_groups"] = qg
    write_safetensors(tmp_path / "m.safetensors", t)
    r = run("validate", tmp_path / "m.safetensors")
    assert r.exit_code == 1
    line = next(l for l in r.stdout.splitlines() if l.startswith("FAIL"))
    assert "GROUPS_BITS" in line and "m.safetensors" in line and "lm_head.q_groups" in line
    # a malformed header is exit 1 for inspect too (no report possible), with code and file on stderr
    (tmp_path / "t.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    r = run("inspect", tmp_path / "t.safetensors")
    assert r.exit_code == 1 and "[HEADER_PAST_EOF]" in r.stderr and "t.safetensors" in r.stderr


def test_usage_errors_exit_2(sample_dir):
    assert run("inspect", sample_dir, "--json", "--markdown").exit_code == 2
    assert run("validate").exit_code == 2
    assert run("validate", sample_dir, "--bogus").exit_code == 2
    assert run("validate", sample_dir / "output.safetensors", "--fix-index").exit_code == 2


def test_unreadable_exits_3(tmp_path):
    r = run("inspect", tmp_path / "missing")
    assert r.exit_code == 3 and "[PATH_NOT_FOUND]" in r.stderr
    (tmp_path / "w.bin").write_bytes(b"\0" * 64)
    r = run("validate", tmp_path / "w.bin")
    assert r.exit_code == 3 and "[UNSUPPORTED_INPUT]" in r.stderr
    (tmp_path / "empty").mkdir()
    assert run("validate", tmp_path / "empty").exit_code == 3


def test_oserror_exits_3_without_traceback(monkeypatch, sample_dir):
    import exl2fmt.inspect as ins

    def boom(*a, **k):
        raise PermissionError(13, "Permission denied", str(sample_dir))

    monkeypatch.setattr(ins, "inspect_model", boom)
    r = run("inspect", sample_dir)
    assert r.exit_code == 3 and "IO_ERROR" in r.stderr and "Traceback" not in r.output


def test_broken_pipe_is_quiet(monkeypatch, sample_dir):
    import exl2fmt.inspect as ins

    def closed(*a, **k):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(ins, "inspect_model", closed)
    r = run("inspect", sample_dir)
    assert r.exit_code == 141 and r.output == ""


def test_internal_error_exits_4(monkeypatch, sample_dir):
    import exl2fmt.inspect as ins

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(ins, "inspect_model", boom)
    monkeypatch.delenv("EXL2FMT_DEBUG", raising=False)
    r = run("inspect", sample_dir)
    assert r.exit_code == 4 and "internal error: RuntimeError: kaboom" in r.stderr
    assert "Traceback" not in r.output and "--debug" in r.stderr
    r = run("--debug", "inspect", sample_dir)
    assert r.exit_code == 4 and "Traceback" in r.stderr
    monkeypatch.setenv("EXL2FMT_DEBUG", "1")
    r = run("inspect", sample_dir)
    assert r.exit_code == 4 and "Traceback" in r.stderr
    r = run("inspect", sample_dir, "--json")
    doc = json.loads(r.stdout)
    check_schema(doc, SCHEMA)
    assert doc["error"]["code"] == "INTERNAL" and doc["exit_code"] == 4


def test_strict_turns_warnings_into_exit_1(tmp_path, sample_dir):
    cfg = json.loads((sample_dir / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 1.0
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(sample_dir / "output.safetensors", d / "output.safetensors")
    (d / "config.json").write_text(json.dumps(cfg))
    assert run("validate", d).exit_code == 0
    r = run("validate", d, "--strict")
    assert r.exit_code == 1 and "FAIL BITS_MISMATCH" in r.stdout and "escalated" in r.stdout


# ------------------------------------------------------------------------------------------------ JSON


def test_inspect_json_matches_schema(sample_dir):
    r = run("inspect", sample_dir, "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    check_schema(doc, SCHEMA)
    check_schema(doc, SCHEMA["$defs"]["inspect"])
    assert len(doc["layers"]) == 15 and r.stderr == ""
    doc = json.loads(run("inspect", sample_dir, "--json", "--no-layers").stdout)
    check_schema(doc, SCHEMA)
    assert doc["layers"] == []


def test_validate_json_matches_schema(sample_dir, tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    write_safetensors(ref / "model.safetensors", sample_dense_tensors())
    for args in ([], ["--deep"], ["--reference", ref], ["--strict"]):
        r = run("validate", sample_dir, "--json", *args)
        doc = json.loads(r.stdout)
        check_schema(doc, SCHEMA["$defs"]["validate"])
        assert r.exit_code == doc["exit_code"]
        assert r.stderr == ""  # no progress bar, no chatter: stdout is one JSON document
        for c in doc["checks"]:
            if c["status"] != "PASS":
                assert ErrorCode(c["code"])  # every failure code is a real ErrorCode
    assert all(l["reference"]["rel_fro"] <= l["reference"]["threshold"] for l in doc["layers"] if l["reference"])


def test_error_json_matches_schema(tmp_path):
    r = run("validate", tmp_path / "nope", "--json")
    doc = json.loads(r.stdout)
    check_schema(doc, SCHEMA)
    assert doc["error"]["code"] == "PATH_NOT_FOUND" and doc["exit_code"] == r.exit_code == 3


def test_gptq_and_gguf_json(tmp_path):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), arch="llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run("inspect", tmp_path / "t.gguf", "--json")
    check_schema(json.loads(r.stdout), SCHEMA)
    r = run("inspect", tmp_path / "t.gguf")
    assert r.exit_code == 0 and "GGUF" in r.stdout
    assert run("validate", tmp_path / "t.gguf").exit_code == 3


# ------------------------------------------------------------------------------------------------ escaping


EVIL = "model.layers.0.mlp.\x1b[2J\x1b]52;c;AAAA\x07up_proj\nFAIL fake.weight"


@pytest.fixture
def evil_model(tmp_path):
    d = tmp_path / "evil"
    d.mkdir()
    write_safetensors(d / "model.safetensors", {EVIL: np.zeros((32, 32), np.float16),
                                                "model.layers.0.mlp.up_proj.weight": np.zeros((32, 32), np.float16)})
    return d


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--markdown"], ["validate"], ["validate", "--markdown"]])
def test_names_are_escaped(evil_model, args):
    r = run(args[0], evil_model, *args[1:])
    out = r.output
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b" in out and "\\x0a" in out and "\\x07" in out
    # the embedded newline cannot forge an output line
    assert not any(l.startswith("FAIL fake.weight") for l in out.splitlines())
    if args[0] == "validate":
        assert r.exit_code == 1 and "NAME_CONTROL_CHARS" in out


def test_json_keeps_exact_names(evil_model):
    r = run("inspect", evil_model, "--json")
    assert "\x1b" not in r.stdout  # JSON escapes it
    doc = json.loads(r.stdout)
    assert any(i["tensor"] == EVIL for i in doc["issues"])
    assert EVIL.rsplit(".", 1)[0] in {l["key"] for l in doc["layers"]}


# ------------------------------------------------------------------------------------------------ --fix-index


def test_fix_index_round_trip(tmp_path, sample_tensors):
    d = tmp_path / "sh"
    write_sharded(d, sample_tensors, max_shard_bytes=400_000, prefix="model")
    (d / "config.json").write_text(json.dumps(dict(SAMPLE_CONFIG)))
    idx = json.loads((d / INDEX_NAME).read_text())
    idx["weight_map"]["lm_head.q_weight"] = "model-00009-of-00009.safetensors"
    (d / INDEX_NAME).write_text(json.dumps(idx))
    r = run("validate", d)
    assert r.exit_code == 1 and "INDEX_MISSING_SHARD" in r.stdout
    r = run("validate", d, "--fix-index", "--json")
    doc = json.loads(r.stdout)
    check_schema(doc, SCHEMA)
    assert r.exit_code == 0 and doc["index_written"]["replaced"] is True
    assert doc["index_written"]["tensors"] == len(sample_tensors)
    assert run("validate", d).exit_code == 0


# ------------------------------------------------------------------------------------------------ --reference


def test_reference_pass_and_fail(tmp_path, sample_dir):
    dense = sample_dense_tensors()
    good = tmp_path / "good"
    good.mkdir()
    write_safetensors(good / "model.safetensors", dense)
    r = run("validate", sample_dir, "--reference", good)
    assert r.exit_code == 0 and "REFERENCE_OK" in r.stdout and "rel err" in r.stdout
    bad = tmp_path / "bad"
    bad.mkdir()
    dense["model.layers.1.self_attn.k_proj.weight"] = (-dense["model.layers.1.self_attn.k_proj.weight"]).copy()
    write_safetensors(bad / "model.safetensors", dense)
    r = run("validate", sample_dir, "--reference", bad)
    assert r.exit_code == 1
    [line] = [l for l in r.stdout.splitlines() if l.startswith("FAIL ")]
    assert "REFERENCE_MISMATCH" in line and "model.layers.1.self_attn.k_proj" in line


# ------------------------------------------------------------------------------------------------ other commands


def test_sample_command(tmp_path):
    d = tmp_path / "s"
    r = run("sample", d)
    assert r.exit_code == 0 and (d / "config.json").exists() and (d / "output.safetensors").exists()
    r = run("sample", d)
    assert r.exit_code == 2 and "OUTPUT_EXISTS" in r.stderr
    assert run("sample", d, "--force").exit_code == 0


def test_dequantize_command(tmp_path, sample_dir):
    from exl2fmt import dequantize_layer

    out = tmp_path / "w.npy"
    r = run("dequantize", sample_dir, "model.layers.0.mlp.down_proj", "-o", out)
    assert r.exit_code == 0 and "256, 704" in r.stdout
    w = np.load(out)
    assert w.dtype == np.float16 and w.shape == (256, 704)
    assert np.array_equal(w.view(np.uint16), dequantize_layer(sample_dir, "model.layers.0.mlp.down_proj").view(np.uint16))
    assert run("dequantize", sample_dir, "model.layers.0.mlp.down_proj", "-o", out).exit_code == 2
    r = run("dequantize", sample_dir, "model.layers.9.mlp.down_proj")
    assert r.exit_code == 1 and "LAYER_NOT_FOUND" in r.stderr
    doc = json.loads(run("dequantize", sample_dir, "lm_head", "--json").stdout)
    assert doc["shape"] == [1000, 256] and doc["nonfinite"] == 0


def test_demo_exits_0(tmp_path):
    r = run("demo", "--dir", tmp_path / "demo")
    assert r.exit_code == 0, r.output
    assert "demo PASS" in r.stdout and "15/15 layers bit-exact" in r.stdout
    assert run("demo", "--dir", tmp_path / "demo").exit_code == 2  # refuses to overwrite without --force


# ------------------------------------------------------------------------------------------------ imports


@pytest.mark.parametrize("args", [["--help"], ["inspect", "{sample}", "--json"], ["validate", "{sample}"]])
def test_cli_imports_no_torch_triton_numba(sample_dir, args):
    args = [a.replace("{sample}", str(sample_dir)) for a in args]
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "exl2fmt.cli.app", *args], capture_output=True,
                       text=True, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    mods = {m.group(1).split(".")[0] for m in re.finditer(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", p.stderr)}
    assert "exl2fmt" in mods  # the parser actually recorded imports
    assert not mods & {"torch", "triton", "numba"}
    if args[0] == "inspect":  # header-only: q_groups are read as bytes; typer's pydantic adapters never built
        assert not mods & {"numpy", "pydantic"}
    if args[0] != "--help":  # a plain inspect / validate command line never loads typer (exl2fmt.cli.app.FAST)
        assert "typer" not in mods and "exl2fmt.cli.commands" not in {m.group(1) for m in re.finditer(
            r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", p.stderr)}


# ------------------------------------------------------------------------------------------------ JSON writer
# Output.json writes through dumps_json: json.dumps(indent=2, ensure_ascii=True, allow_nan=False) byte for byte.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ODD_LEAVES = st.sampled_from([float("nan"), float("inf"), -float("inf"), (1, 2), ErrorCode.USAGE, np.int64(3),
                               np.float32(0.5), 10 ** 5000, b"x", {1: 2}, {None: 1}, {1.5: "a"}, {True: 0}])
_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(), st.sampled_from([-0.0, 1e300, 5e-324]))


def _json_or_exc(fn, doc):
    try:
        return fn(doc)
    except Exception as e:  # noqa: BLE001 - the exception is the value compared
        return (type(e), str(e))


@settings(max_examples=300, deadline=None)
@given(st.recursive(_LEAVES, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=30),
       st.one_of(st.none(), _ODD_LEAVES))
def test_json_writer_is_json_dumps(doc, odd):
    from exl2fmt.cli.output import _json_default, dumps_json

    def ref(d):
        return json.dumps(d, indent=2, ensure_ascii=True, allow_nan=False, default=_json_default)

    for d in (doc, [doc, odd], {"a": {"b": [odd, doc]}}):
        assert _json_or_exc(dumps_json, d) == _json_or_exc(ref, d)


def test_json_writer_on_reports(sample_dir):
    from exl2fmt.cli.output import _json_default, dumps_json
    from exl2fmt.inspect import inspect_model
    from exl2fmt.validate import validate_model

    for doc in (inspect_model(sample_dir), validate_model(sample_dir).as_dict()):
        assert dumps_json(doc) == json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False, default=_json_default)
    deep = []
    for _ in range(5000):
        deep = [deep]
    assert _json_or_exc(dumps_json, deep)[0] is RecursionError
    loop = []
    loop.append(loop)
    assert _json_or_exc(dumps_json, loop) == (ValueError, "Circular reference detected")


# ------------------------------------------------------------------------------------------------ plain writer
# Human output to a non-terminal goes around rich where rich would write the text unchanged (Output._emit).

_PRINTABLE = st.lists(st.sampled_from(list(" abcXYZ019-_.:/|[]()*#%=\\`'\"~") + ["\n", " " * 7, "x" * 60]),
                      max_size=60).map("".join)
_ANY_TEXT = st.one_of(_PRINTABLE, st.text(max_size=60), st.sampled_from(["x" * 250, "y" * 201 + " ", "\t", "a\rb",
                                                                         "\u4e2d\u6587" * 40, "\x1b[1m", ""]))


def _rich_reference(segments, soft_wrap):
    """What Output printed before the plain writer: rich, with the console settings of a non-terminal stdout."""
    import io

    from rich.console import Console
    from rich.text import Text

    f = io.StringIO()
    con = Console(file=f, highlight=False, emoji=False, markup=False, width=200, no_color=True)
    if len(segments) == 1:
        out = Text(segments[0][0], style=segments[0][1] or "")
    else:
        out = Text()
        for t, style in segments:
            out.append(t, style=style)
    con.print(out, soft_wrap=soft_wrap)
    return f.getvalue()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_ANY_TEXT, st.sampled_from([None, "", "bold", "bold red"])), min_size=1, max_size=4),
       st.booleans())
def test_plain_writer_prints_what_rich_prints(segments, soft_wrap):
    import io

    from exl2fmt.cli.output import Output

    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stdout", buf)
        for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
            mp.delenv(var, raising=False)
        Output("human")._emit(segments, soft_wrap=soft_wrap)
    assert buf.getvalue() == _rich_reference(segments, soft_wrap)


def test_plain_writer_on_reports_and_only_off_terminals(sample_dir, tmp_path, monkeypatch):
    """Whole human reports (inspect, validate with failures) through the plain writer equal rich's; a forced
    terminal (FORCE_COLOR) goes through rich."""
    import io

    from exl2fmt.cli.output import Output
    from exl2fmt.inspect import inspect_model
    from exl2fmt.validate import validate_model

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((sample_dir / "config.json").read_text())
    from safetensors.numpy import load_file

    t = load_file(str(sample_dir / "output.safetensors"))
    t["model.layers.0.mlp.up_proj.q_groups"] = t["model.layers.0.mlp.up_proj.q_groups"][::-1].copy()
    write_safetensors(bad / "model.safetensors", t)

    def render(fn, plain):
        buf = io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "stdout", buf)
            out = Output("human")
            mp.setattr(out, "_plain_stdout", lambda: plain)
            fn(out)
        return buf.getvalue()

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    for d in (sample_dir, bad):
        rep, vrep = inspect_model(d), validate_model(d).as_dict()
        for fn in (lambda o: o.inspect_report(rep, show_layers=True), lambda o: o.validate_report(vrep)):
            assert render(fn, True) == render(fn, False)
    assert Output("human")._plain_stdout() is not sys.stdout.isatty()
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert Output("human")._plain_stdout() is False


# ------------------------------------------------------------------------------------------------ typer-free route
# exl2fmt.cli.app.main runs the command lines of FAST without typer.  Both parsers get every combination of the
# fast flags and of every option the typer commands declare: where the fast parser takes a command line, typer must
# call the same checks function with the same values; everything else the fast parser leaves to typer.


def _typer_params(name):
    from typer.main import get_command

    return get_command(app).commands[name].params


def _token_pool(name):
    """Every option spelling of the typer command (flags alone; value options with a value, both ways) plus
    tokens no command takes."""
    pool = [["--help"], ["-h"], ["--"], ["-"], ["-x"], ["--debug"], ["--version"], ["--json=1"], ["--layers=no"]]
    for p in _typer_params(name):
        if p.param_type_name != "option":
            continue
        for opt in [*p.opts, *p.secondary_opts]:
            if p.is_flag:
                pool.append([opt])
            else:
                for v in ("junit", "json", "x", "-v", ""):
                    pool += [[opt, v], [f"{opt}={v}"]]
                pool.append([opt])  # value missing (last token)
    return pool


def _fast_vs_typer_cases(n=400, seed=0):
    import random

    from exl2fmt.cli.app import FAST

    rng = random.Random(seed)
    pools = {c: _token_pool(c) for c in FAST}
    fast_tokens = {c: [[t] for t in FAST[c][0]] + [[o, v] for o in FAST[c][1] for v in ("junit", "github", "json")]
                   for c in FAST}
    for i in range(n):
        cmd = rng.choice(["inspect", "inspect", "inspect", "validate", "validate", "validate", "dequantize"])
        pool = pools.get(cmd, [["--force"], ["--help"], ["-o", "x.npy"]])
        toks = []
        for _ in range(rng.randint(0, 4)):  # mostly the fast flags, so that many cases take the fast route
            toks.append(rng.choice(fast_tokens.get(cmd, pool) if rng.random() < 0.85 else pool))
        for _ in range(rng.choice([0, 1, 1, 1, 1, 1, 1, 1, 2])):
            toks.insert(rng.randint(0, len(toks)), [rng.choice(["m", "m", "dir/model.safetensors", "hf://o/r", "",
                                                                "-p"])])
        root = rng.choice([[], [], [], [], ["--debug"], ["--debug", "--debug"], ["--version"]])
        yield root + [cmd] + [t for tok in toks for t in tok]


@pytest.mark.slow  # CI time (a wide sweep of command lines)
def test_fast_route_parses_like_typer(monkeypatch, tmp_path):
    from exl2fmt.cli import checks
    from exl2fmt.cli.app import FAST, fast_args
    from exl2fmt.cli.errors import set_debug

    calls = []

    def recorder(cmd):
        def record(path, **kw):
            calls.append((cmd, dict(kw, path=path)))
            return 0
        return record

    monkeypatch.chdir(tmp_path)  # the command lines name relative paths; nothing may land in the checkout
    monkeypatch.setattr(checks, "inspect_command", recorder("inspect"))
    monkeypatch.setattr(checks, "validate_command", recorder("validate"))
    taken = {c: set() for c in FAST}
    n_fast = 0
    try:
        for argv in _fast_vs_typer_cases():
            calls.clear()
            r = runner.invoke(app, argv)
            fast = fast_args(argv)
            if fast is None:
                continue
            n_fast += 1
            cmd, debug, kw = fast
            assert r.exit_code == 0 and calls == [(cmd, dict(kw, debug=debug))], (argv, r.output, calls, fast)
            taken[cmd].update(t.partition("=")[0] for t in argv if t.startswith("--"))
    finally:
        set_debug(False)
    assert n_fast >= 100  # the comparison ran on many command lines the fast route takes
    for cmd, (flags, valued, _) in FAST.items():  # ... with each of its options
        assert set(flags) | set(valued) <= taken[cmd], (cmd, taken[cmd])


def test_fast_route_defaults_are_typers():
    """Every parameter of the typer command has its default in FAST (a new option gets one, or the fast route
    would call the checks function without it)."""
    from exl2fmt.cli.app import FAST

    for cmd, (_, _, defaults) in FAST.items():
        names = {p.name for p in _typer_params(cmd)} - {"path"}
        assert names == set(defaults), cmd


_TYPER_ONLY = ("import sys; from exl2fmt.cli.commands import app; app(prog_name='exl2fmt')")


def _norm_timing(text: str) -> str:
    return re.sub(r'("seconds": |time=")[0-9.]+|timestamp="[^"]+"', r"\1X", text)


@pytest.mark.parametrize("args,code", [
    (["inspect", "{sample}", "--json"], 0), (["inspect", "{sample}"], 0), (["inspect", "{sample}", "--markdown",
     "--no-layers"], 0), (["--debug", "inspect", "{sample}/output.safetensors"], 0),
    (["inspect", "{sample}", "--json", "--markdown"], 2), (["inspect", "{missing}"], 3),
    (["inspect", "{missing}", "--json"], 3), (["validate", "{sample}"], 0), (["validate", "{sample}", "--json"], 0),
    (["validate", "{sample}", "--format", "junit"], 0), (["validate", "{sample}", "--format=github", "--strict"], 0),
    (["validate", "{sample}", "--format", "xml"], 2), (["validate", "{sample}", "--json", "--format", "markdown"], 2),
    (["validate", "{missing}", "--markdown"], 3),
])
def test_fast_route_prints_what_typer_prints(sample_dir, tmp_path, args, code):
    from exl2fmt.cli.app import fast_args

    args = [a.replace("{sample}", str(sample_dir)).replace("{missing}", str(tmp_path / "none")) for a in args]
    assert fast_args(args) is not None
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    fast = subprocess.run([sys.executable, "-m", "exl2fmt.cli.app", *args], capture_output=True, text=True, env=env)
    slow = subprocess.run([sys.executable, "-c", _TYPER_ONLY, *args], capture_output=True, text=True, env=env)
    assert fast.returncode == slow.returncode == code, (fast.stderr, slow.stderr)
    assert _norm_timing(fast.stdout) == _norm_timing(slow.stdout) and fast.stderr == slow.stderr
    assert fast.stdout or fast.stderr


def test_console_script_entry_point():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="console_scripts") if e.name == "exl2fmt"]
    assert eps and eps[0].value == "exl2fmt.cli.app:main"


# ------------------------------------------------------------------------------------------------ catalogue

CATALOGUE = ROOT / "spec" / "malformed" / "index.json"


def _catalogue():
    if not CATALOGUE.exists():
        return []
    return json.loads(CATALOGUE.read_text())


@pytest.mark.skipif(not CATALOGUE.exists(), reason="spec/malformed/index.json not built yet")
@pytest.mark.parametrize("entry", _catalogue(), ids=lambda e: e.get("path", "?"))
def test_malformed_catalogue(entry):
    """Every catalogued bad input: its code in the output, the catalogued exit code, no traceback, the file
    named in the message."""
    path = CATALOGUE.parent / entry["path"]
    r = run("validate", "--deep", path)
    out = r.output
    assert "Traceback" not in out
    assert entry["code"] in out, out[-2000:]
    if re.search(rf"^WARN {entry['code']}\b", r.stdout, re.M) and not re.search(rf"^FAIL {entry['code']}\b", r.stdout, re.M):
        # the core rates this finding a warning (e.g. q_scale_max = 0, a wrong total_size): exit 0 unless --strict
        assert r.exit_code == 0, out[-2000:]
        r = run("validate", "--deep", "--strict", path)
        out = r.output
        assert re.search(rf"^FAIL {entry['code']}\b", r.stdout, re.M), out[-2000:]
    assert r.exit_code == entry["exit"], out[-2000:]
    # the line carrying the code names the file (the entry itself, or a file inside the entry's directory)
    lines = [l for l in out.splitlines() if entry["code"] in l]
    names = {path.name} | ({p.name for p in path.iterdir()} if path.is_dir() else set())
    assert any(n in l for l in lines for n in names), lines


def test_the_cli_sets_its_runtime_environment_unless_the_user_chose():
    """The entry point sets libgomp's spin count (every command) and torch's huge-page allocations (convert --to
    exl2 only) before torch or Numba load, and leaves a user's own GOMP_SPINCOUNT / OMP_WAIT_POLICY /
    THP_MEM_ALLOC_ENABLE alone.  Oracle: the environment the CLI process ends up with."""
    from exl2fmt.cli import app as app_mod

    exl2 = ["convert", "src", "dst", "--to", "exl2"]
    cases = ((exl2, True), (["convert", "s", "d", "--to=exl2"], True), (["convert", "s", "d", "-t", "exl2"], True),
             (["convert", "s", "d", "--to", "gptq"], False), (["inspect", "exl2"], False),
             (["validate", "--to", "exl2"], False))
    for argv, thp in cases:
        env: dict = {}
        app_mod.set_runtime_env(argv, env)
        want = {"GOMP_SPINCOUNT": app_mod.GOMP_SPINCOUNT}
        if thp:
            want["THP_MEM_ALLOC_ENABLE"] = app_mod.THP_MEM_ALLOC_ENABLE
        assert env == want, argv
    for user in ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(user, THP_MEM_ALLOC_ENABLE="0")
        app_mod.set_runtime_env(exl2, env)
        assert env == dict(user, THP_MEM_ALLOC_ENABLE="0")
    code = ("import os, sys; from exl2fmt.cli.app import main\n"
            "try: main(sys.argv[1:])\nexcept SystemExit: pass\n"
            "print('ENV', os.environ.get('GOMP_SPINCOUNT'), os.environ.get('THP_MEM_ALLOC_ENABLE'))")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")}
    out = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True, env=clean).stdout
    assert f"ENV {app_mod.GOMP_SPINCOUNT} None" in out
    out = subprocess.run([sys.executable, "-c", code, "convert", "--help", "--to", "exl2"], capture_output=True,
                         text=True, env=clean).stdout
    assert f"ENV {app_mod.GOMP_SPINCOUNT} {app_mod.THP_MEM_ALLOC_ENABLE}" in out
    out = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True,
                         env=dict(clean, OMP_WAIT_POLICY="PASSIVE", THP_MEM_ALLOC_ENABLE="0")).stdout
    assert "ENV None 0" in out


def test_progress_in_a_log_is_plain_heartbeat_lines(tmp_path, monkeypatch):
    """stderr that is no terminal (a CI log, a pipe) gets plain lines: at the start, at most one per interval, at the
    end (issue 41: `validate --run` ran 13.5 minutes in a log without a line); file-derived items are escaped."""
    import io

    from exl2fmt.cli import progress

    clock = iter([0.0, 0.0, 5.0, 31.0, 32.0, 70.0, 71.0, 72.0])
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    buf = io.StringIO()
    cb = progress.plain_progress("validate --run", stream=buf, interval=30.0)
    for done, what in [(0, ""), (1, "model.layers.0"), (2, "model.layers.1"), (3, "::error::x"), (4, "a"),
                       (10, "lm_head"), (10, "lm_head")]:
        cb(done, 10, what)
    lines = buf.getvalue().splitlines()
    assert lines == ["validate --run: 0 %, 0:00 elapsed", "validate --run: 20 % (model.layers.1), 0:31 elapsed",
                     "validate --run: 40 % (a), 1:10 elapsed", "validate --run: 100 % (lm_head), 1:11 elapsed"], lines
    # an item from a file never starts a workflow command (the line starts with the description)
    clock = iter([0.0, 1.0])
    buf = io.StringIO()
    progress.plain_progress("x", stream=buf, interval=0.0)(1, 2, "::error title=t::m")
    assert buf.getvalue().startswith("x: 50 % (\\u003a\\u003aerror"), buf.getvalue()


def test_validate_deep_in_a_pipe_says_it_runs(tmp_path):
    write_sample(tmp_path / "s")
    p = subprocess.run([sys.executable, "-m", "exl2fmt.cli.app", "validate", str(tmp_path / "s"), "--deep"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.startswith("validate --deep: ")]
    assert lines[0].startswith("validate --deep: 0 %") and lines[-1].startswith("validate --deep: 100 %"), p.stderr
    # plain validation does no long work and prints no progress; --json keeps stderr clean
    p = subprocess.run([sys.executable, "-m", "exl2fmt.cli.app", "validate", str(tmp_path / "s"), "--deep", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert "elapsed" not in p.stderr
