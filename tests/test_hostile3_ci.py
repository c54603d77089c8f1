"""Issue 41, classes 4, 9 and 10 (and the layer-list part of 14): ``spec/malformed/hostile3_ci/``.

* **CI output injection** (class 4).  ``runner_commands`` implements the GitHub Actions runner's own parsing of a
  log line (``ActionCommand.TryParseV2`` / ``TryParse`` of actions/runner): a line that, after trimming leading
  whitespace, starts with ``::`` is a workflow command; ``##[`` anywhere in a line is a legacy one.  Every ``ci_``
  case goes through every command and output format in a fresh process (``hostile_harness.run_bounded``), and
  both streams are parsed: no line may be a workflow command except those ``validate --format github`` writes
  itself on stdout, whose properties and message must be escaped as GitHub specifies (``%``, CR, LF; in
  properties also ``:`` and ``,``) so that the file's text stays inside them.  The payload must still be visible
  (escaped) in the output: the test fails if exl2fmt merely stopped printing the names.  Also: the pre-commit
  hook, ``hf://`` listings (the test hub), shard names with ``:`` (written at test time).
* **Empty layers** (class 9): 0 rows / 0 columns in every format, through every command; and every catalogue
  folder of ``spec/malformed`` must be exercised by tests that CI runs (not only ``slow`` ones).
* **--debug everywhere** (class 10), and natural layer order / GGUF embeddings (class 14).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hostile_harness import ROOT, run_bounded

CAT = ROOT / "spec" / "malformed" / "hostile3_ci"
ENTRIES = json.loads((CAT / "index.json").read_text(encoding="utf-8"))
CI = [e for e in ENTRIES if e["class"] == 4]
ZERO = [e for e in ENTRIES if e["class"] == 9]


def _generator():
    sys.path.insert(0, str(ROOT / "spec" / "malformed"))
    spec = importlib.util.spec_from_file_location("make_hostile3_ci", ROOT / "spec" / "malformed" /
                                                  "make_hostile3_ci.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------ the runner's rules

#: what .NET's String.TrimStart() removes (char.IsWhiteSpace), and the line breaks of StreamReader.ReadLine
_WS = "".join(chr(c) for c in (*range(9, 14), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                               0x202F, 0x205F, 0x3000))
_LINES = re.compile(r"\r\n|\r|\n")
OUR_COMMANDS = {"error", "warning", "notice"}
OUR_PROPERTIES = {"file", "title"}


def runner_commands(text: str) -> list[tuple[str, str]]:
    """(kind, line) for every line of ``text`` the Actions runner would take for a workflow command: ``v2`` (starts
    with ``::`` after leading whitespace and has a second ``::``: ``::name props::data``; a leading ``::`` alone
    is reported as ``v2?``) or ``legacy`` (``##[`` anywhere in the line)."""
    found = []
    for line in _LINES.split(text):
        body = line.lstrip(_WS)
        if body.startswith("::"):
            found.append(("v2" if body.find("::", 2) >= 0 else "v2?", line))
        if "##[" in line:
            found.append(("legacy", line))
    return found


def _gh_unescape(s: str, prop: bool) -> str:
    s = s.replace("%0D", "\r").replace("%0A", "\n")
    if prop:
        s = s.replace("%3A", ":").replace("%2C", ",")
    return s.replace("%25", "%")


def parse_our_command(line: str) -> tuple[str, dict, str]:
    """A command exl2fmt writes (``--format github``), parsed as the runner parses it; asserts its shape."""
    body = line.lstrip(_WS)
    end = body.index("::", 2)
    info, data = body[2:end], body[end + 2:]
    name, _, props = info.partition(" ")
    assert name in OUR_COMMANDS, line
    out = {}
    for p in props.split(",") if props else []:
        k, eq, v = p.partition("=")
        assert eq and k in OUR_PROPERTIES and k not in out, (k, line)
        out[k] = _gh_unescape(v, True)
    assert "\r" not in data and "\n" not in data
    return name, out, _gh_unescape(data, False)


def assert_no_injected_commands(stdout: str, stderr: str, *, github: bool = False) -> list[tuple[str, dict, str]]:
    """No workflow command in either stream, except (with ``github``) exl2fmt's own on stdout, parsed."""
    ours = []
    for stream, text in (("stdout", stdout), ("stderr", stderr)):
        for kind, line in runner_commands(text):
            if kind == "v2" and github and stream == "stdout" and "##[" not in line:
                ours.append(parse_our_command(line))
                continue
            raise AssertionError(f"{stream} line is a workflow command ({kind}): {line!r}")
    return ours


def test_the_runner_rules_catch_every_payload_raw():
    """The oracle itself: each payload of the catalogue, printed raw at a line start or inside a line, is found."""
    gen = _generator()
    for p in gen.P.values():
        assert runner_commands(f"{p}x.weight  64 x 32") or runner_commands(f"row {p}"), p
    assert [k for k, _ in runner_commands("\t ::error title=a::b")] == ["v2"]
    assert [k for k, _ in runner_commands("ok\r::add-mask::s")] == ["v2"]
    assert [k for k, _ in runner_commands("ok\n  ::endgroup")] == ["v2?"]
    assert [k for k, _ in runner_commands("x ##[group]y")] == ["legacy"]
    assert runner_commands("a::b ::c\nPASS X  ::error::y") == []
    with pytest.raises(AssertionError):
        assert_no_injected_commands("::error::x\n", "", github=False)
    with pytest.raises(AssertionError):
        assert_no_injected_commands("", "::error::x\n", github=True)      # ours are on stdout only
    with pytest.raises(AssertionError):  # a property a name broke out of
        assert_no_injected_commands("::error file=a,title=x,line=3::m\n", "", github=True)


def test_escape_name_never_leaves_a_command():
    """escape_name (every human / markdown / junit / github rendering) and the GitHub escapes, on strings built
    from the payloads, spaces and line breaks: no output is a command by the runner's rules, and JSON keeps the
    value exact."""
    import itertools
    import random

    from exl2fmt.cli.ci_formats import gh_data, gh_property, xml_text
    from exl2fmt.cli.output import md_escape
    from exl2fmt.errors import escape_name, json_ci_defuse

    parts = ["::", ":", "#", "##[", "[", "error", " ", "\t", "\n", "\u2003", "%", ",", "x", "add-mask::", "\r"]
    rng = random.Random(41)
    samples = ["".join(rng.choice(parts) for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    samples += ["".join(t) for t in itertools.product(["", " ", "  "], ["::", "##[", "#", ":"], ["error", "::x"])]
    for s in samples:
        for f in (escape_name, md_escape, xml_text, gh_data, gh_property):
            out = f(s)
            assert "\n" not in out and "\r" not in out
            assert not runner_commands(out), (f.__name__, s, out)
            # next to text of ours that ends a line: still one line, still no command
            assert not runner_commands("PASS CODE " + out), (f.__name__, s)
        doc = json.dumps({"k": s})
        assert json.loads(json_ci_defuse(doc)) == {"k": s} and "##[" not in json_ci_defuse(doc)
    assert escape_name("::error::x") == "\\u003a\\u003aerror::x"
    assert escape_name("a ##[error] b") == "a \\u0023#[error] b"
    assert escape_name("a::b") == "a::b"  # only a leading "::" is a command


# ------------------------------------------------------------------------------------------------ class 4: every command


def _ci_commands(entry, tmp_path):
    p = str(CAT / entry["path"])
    out = str(tmp_path / "out")
    gen = _generator()
    cmds = [["inspect", p], ["inspect", "--markdown", p], ["inspect", "--json", p], ["inspect", "--no-layers", p],
            ["inspect", p, "--debug"],
            ["validate", p], ["validate", "--markdown", p], ["validate", "--format", "github", p],
            ["validate", "--format", "junit", p], ["validate", "--json", p], ["validate", "--deep", p],
            ["validate", "--deep", "--strict", "--format", "github", p], ["validate", "--format=junit", "--deep", p],
            ["convert", p, out, "--to", "fp16"], ["convert", p, out + "-j", "--to", "fp16", "--json"],
            ["convert", p, out + "-g", "--to", "gptq", "--bits", "4"]]
    if entry["path"] == "ci_names.safetensors":
        cmds += [["dequantize", p, gen.EXL2_KEY], ["dequantize", p, gen.GPTQ_KEY, "--json"],
                 ["dequantize", p, gen.GPTQ_KEY.replace("up_proj", "up_prj")],     # did you mean: <file's names>
                 ["dequantize", p, gen.EXL2_KEY.replace("down_proj", "down_prj")]]
    if entry["path"] == "ci_dense_names":
        cmds += [["dequantize", p, k] for k in gen.DENSE_KEYS]
    return cmds


def _check_run(args, markers, *, want_marker: bool):
    # convert/dequantize may be the fresh clone's first use of a Numba kernel (a cold compile: ~20 s at load 5,
    # where a warm run takes 6 s); the bound is there to catch a hang, not to time the JIT
    timeout = 60.0 if args[0] in ("convert", "dequantize") else 10.0
    r = run_bounded(*args, timeout=timeout)
    r.check_bounds()
    assert r.rc in (0, 1, 2, 3), (args, r.rc, r.stderr[-2000:])
    assert "INTERNAL" not in r.stdout + r.stderr, (args, r.stderr[-2000:])
    github = "github" in " ".join(args)
    ours = assert_no_injected_commands(r.stdout, r.stderr, github=github)
    json_out = "--json" in args
    if json_out and r.stdout.strip():
        json.loads(r.stdout)
    shown = r.stdout + r.stderr + "".join(f"{d} {' '.join(p.values())}" for _, p, d in ours)
    if want_marker and markers:
        assert any(m in shown for m in markers), (args, shown[-3000:])
    return r, ours


def _shows_names(entry, args) -> bool:
    """Runs that must print the file's strings (escaped): inspect's layer table (and, for a fatal error, every
    command's error message); other runs may have nothing of the file to say."""
    if entry["path"].startswith("ci_fatal"):
        return "--json" not in args
    return args[0] == "inspect" and "--json" not in args and "--no-layers" not in args


@pytest.mark.parametrize("entry", CI, ids=[e["path"] for e in CI])
def test_ci_case_every_command_and_format(entry, tmp_path):
    markers = entry["markers"]
    for run in entry["runs"]:  # the catalogue's own expectations (code, exit)
        args = [a.replace("{case}", str(CAT / entry["path"])).replace("{out}", str(tmp_path / "o0")) for a in
                run["args"]]
        r, _ = _check_run(args, markers, want_marker=_shows_names(entry, args))
        assert r.rc in run["exit"], (args, r.rc, r.stdout[-1500:], r.stderr[-1500:])
        if run["code"]:
            assert run["code"] in r.stdout + r.stderr, (args, r.stderr[-1500:])
    for args in _ci_commands(entry, tmp_path):
        r, ours = _check_run(args, markers, want_marker=_shows_names(entry, args))
        if "github" in " ".join(args) and r.rc in (0, 1):
            assert ours and ours[-1][0] == "notice", r.stdout[-2000:]  # the verdict is always the last command


def test_json_output_keeps_names_exact():
    """--json is the exception: names exact (a ``##[`` is written ``\\u0023#[``, the same JSON value)."""
    gen = _generator()
    r = run_bounded("inspect", "--json", CAT / "ci_names.safetensors")
    assert "##[" not in r.stdout
    keys = {row["key"] for row in json.loads(r.stdout)["layers"]}
    assert {gen.EXL2_KEY, gen.GPTQ_KEY, *gen.DENSE_KEYS} <= keys


def test_shard_names_with_colons(tmp_path):
    """Shard files and index entries named ``::error ...::`` (not storable in a Windows checkout: made here)."""
    (d,) = _generator().runtime_cases(tmp_path)
    for args in (["inspect", d], ["validate", d], ["validate", "--format", "github", d],
                 ["validate", "--format", "junit", d], ["inspect", "--markdown", d]):
        r, _ = _check_run([str(a) for a in args], ["pwned1", "pwned2", "pwned3"], want_marker=True)
        assert r.rc in (0, 1)


def test_pre_commit_hook_output(tmp_path):
    """The hook runs human ``validate`` per model directory (and passes ``--format github`` through)."""
    files = [str(CAT / "ci_config_values" / "config.json"), str(CAT / "ci_shard_names" / "config.json"),
             str(CAT / "ci_index_entries" / "model.safetensors.index.json"), str(CAT / "ci_dense_names" /
                                                                                 "model.safetensors")]
    for extra in ([], ["--format", "github"], ["--format", "junit"]):
        r = subprocess.run([sys.executable, "-m", "exl2fmt.cli.precommit", *extra, *files], capture_output=True,
                           text=True, timeout=120, cwd=str(ROOT))
        assert r.returncode == 1, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
        assert_no_injected_commands(r.stdout, r.stderr, github=bool(extra) and extra[1] == "github")
        assert "pwned" in r.stdout + r.stderr


def test_hub_listing_names(tmp_path):
    """hf://: names from the Hub's listing (and the files they point at) are file-derived too."""
    pytest.importorskip("huggingface_hub")
    from hub_server import HubEmulator

    gen = _generator()
    repo = tmp_path / "hub" / "org" / "evil" / "main"
    repo.mkdir(parents=True)
    (repo / "model.safetensors").write_bytes((CAT / "ci_names.safetensors").read_bytes())
    (repo / "config.json").write_text(json.dumps({"architectures": ["##[error]pwned4"], "model_type": "llama"}))
    bad = tmp_path / "hub" / "org" / "shards" / "main"
    bad.mkdir(parents=True)
    for fn in (CAT / "ci_shard_names").iterdir():
        (bad / fn.name).write_bytes(fn.read_bytes())
    with HubEmulator(tmp_path / "hub") as emu:
        env = {"HF_ENDPOINT": emu.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(tmp_path / "hf")}
        for args in (["inspect", "hf://org/evil"], ["inspect", "--markdown", "hf://org/evil"]):
            r = run_bounded(*args, timeout=30.0, env_extra=env)   # the layer table, read by range
            assert r.rc == 0 and "pwned1" in r.stdout, (args, r.rc, r.stderr[-2000:])
            assert_no_injected_commands(r.stdout, r.stderr)
        # hostile names in the listing itself (no file behind them): the error names them, escaped
        emu.extra_listing = [{"type": "file", "path": gen.P["error"] + "x.safetensors", "size": 10},
                             {"type": "file", "path": "##[error]pwned4.safetensors", "size": 10}]
        for args in (["inspect", "hf://org/evil"], ["validate", "hf://org/evil"],
                     ["validate", "--format", "github", "hf://org/evil"], ["validate", "--format", "junit",
                                                                          "hf://org/evil"],
                     ["inspect", "hf://org/shards"], ["validate", "--format", "github", "hf://org/shards"],
                     ["inspect", "hf://org/evil@##[error]pwned4"], ["inspect", "hf://org/evil/::error::pwned1.st"]):
            r = run_bounded(*args, timeout=30.0, env_extra=env)
            assert r.rc in (0, 1, 2, 3), (args, r.rc, r.stderr[-2000:])
            assert "INTERNAL" not in r.stdout + r.stderr and not r.traceback, (args, r.stderr[-2000:])
            assert_no_injected_commands(r.stdout, r.stderr, github="github" in args)
            assert "pwned" in r.stdout + r.stderr, (args, r.stderr[-2000:])


# ------------------------------------------------------------------------------------------------ class 9


def _zero_runs():
    return [pytest.param(e, i, id=f"{e['path']}-{i}-{'-'.join(a for a in r['args'] if not a.startswith('{'))}")
            for e in ZERO for i, r in enumerate(e["runs"])]


@pytest.fixture(scope="module")
def warm_numba():
    run_bounded("validate", "--deep", ROOT / "spec" / "malformed" / "hostile" / "c4_exl2_decodes_to_inf", timeout=600)


@pytest.mark.parametrize("entry,i", _zero_runs())
def test_empty_layer_case(entry, i, tmp_path, warm_numba):
    run = entry["runs"][i]
    out = tmp_path / "out"
    args = [a.replace("{case}", str(CAT / entry["path"])).replace("{out}", str(out)) for a in run["args"]]
    r = run_bounded(*args, timeout=30.0 if args[0] == "convert" else 10.0)
    r.check_bounds()
    both = r.stdout + r.stderr
    assert r.rc in run["exit"], (args, r.rc, both[-2000:])
    assert "INTERNAL" not in both and "ZeroDivision" not in both, both[-2000:]
    if run["code"]:
        assert run["code"] in both, (args, both[-2000:])
    if args[0] == "convert" and r.rc:
        assert not out.exists()
    if args[:2] == ["inspect", "--json"]:
        doc = json.loads(r.stdout)
        assert all(row["bpw"] is None for row in doc["layers"] if not row["params"])


def test_bpw_of_a_layer_without_weights_is_none():
    from exl2fmt.layout import Exl2Geometry, Format, bpw

    assert bpw(Format.EXL2, Exl2Geometry(K=128, N_pad=0, G=3, Q=0), {"q_weight": "I32"}) is None
    assert bpw(Format.EXL2, Exl2Geometry(K=0, N_pad=32, G=0, Q=0), {"q_weight": "I32"}) is None


# ------------------------------------------------------------------------------------------------ every catalogue in CI


def _catalogue_cases() -> dict[str, list[str]]:
    """catalogue folder -> its cases: ``spec/malformed`` itself and every folder under it holding an index.json;
    a case is any file or folder of the catalogue other than its README, index, generators and sub-catalogues."""
    mal = ROOT / "spec" / "malformed"
    cats = [mal] + sorted(p for p in mal.iterdir() if p.is_dir() and (p.name.startswith("hostile")
                                                                       or (p / "index.json").exists()))
    out = {}
    for c in cats:
        out[str(c.relative_to(ROOT))] = sorted(
            p.name for p in c.iterdir()
            if p.name not in ("README.md", "index.json") and not p.name.startswith((".", "make_"))
            and p not in cats and p.name != "__pycache__")
    return out


def test_every_catalogue_case_runs_in_ci():
    """Every case of every catalogue (spec/malformed, hostile/, hostile_io/, hostile3_*/ ...) is run by at least one
    test that CI runs (collected with -m "not slow"; the case's name is part of the test's id): a regression of
    any earlier case must fail CI, not only the slow suite (issue 41 class 9: a fixed crash came back unseen)."""
    cases = _catalogue_cases()
    tests = sorted(str(p) for p in (ROOT / "tests").glob("test_*.py")
                   if "malformed" in p.read_text(encoding="utf-8", errors="replace"))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "-p", "no:xdist",
                        "-p", "no:cacheprovider", *tests], capture_output=True, text=True, cwd=str(ROOT),
                       timeout=600)
    ids = [l for l in r.stdout.splitlines() if "::" in l]
    assert len(ids) > 100, r.stdout[-3000:] + r.stderr[-3000:]
    missing = []
    for cat, names in cases.items():
        for n in names:
            stem = n.split(".", 1)[0] or n   # ids may name a case without its extension
            if not any(stem in i.partition("[")[2] for i in ids):
                missing.append(f"{cat}/{n}: no non-slow test runs it (no collected test id names it)")
    assert not missing, "\n".join(missing)


# ------------------------------------------------------------------------------------------------ class 10: --debug


def _commands():
    from typer.main import get_command

    from exl2fmt.cli.commands import app

    return get_command(app).commands


def test_every_command_takes_debug_after_the_command():
    for name, cmd in _commands().items():
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert "--debug" in opts, name


@pytest.mark.parametrize("argv", [
    ["inspect", "{missing}", "--debug"], ["validate", "{missing}", "--debug"], ["validate", "--debug", "{missing}",
                                                                                "--format", "github"],
    ["dequantize", "{missing}", "k", "--debug"], ["convert", "{missing}", "{tmp}/o", "--to", "fp16", "--debug"],
    ["sample", "{tmp}/s", "--debug"], ["demo", "--dir", "{tmp}/s", "--debug"], ["--debug", "inspect", "{missing}"],
    ["inspect", "--debug", "{missing}", "--json"],
])
def test_debug_is_accepted_on_every_command(argv, tmp_path):
    if argv[0] == "demo":
        from exl2fmt.sample import write_sample

        write_sample(tmp_path / "s")  # demo then refuses the existing sample at once (OUTPUT_EXISTS, exit 2)
    args = [a.replace("{missing}", str(tmp_path / "none")).replace("{tmp}", str(tmp_path)) for a in argv]
    r = run_bounded(*args, timeout=60.0)
    assert "No such option" not in r.stderr and "no such option" not in r.stderr.lower(), r.stderr
    want = {"sample": 0, "demo": 2}.get(argv[0], 3)
    assert r.rc == want, (args, r.rc, r.stderr[-2000:])


def test_debug_after_the_command_shows_the_traceback(monkeypatch, capsys, tmp_path):
    """An internal error: the hint without --debug, the traceback with it - on the fast route and through typer."""
    from typer.testing import CliRunner

    import exl2fmt.inspect as insp
    from exl2fmt.cli import app as app_mod
    from exl2fmt.cli.commands import app
    from exl2fmt.cli.errors import set_debug

    def boom(*a, **k):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(insp, "inspect_model", boom)
    monkeypatch.delenv("EXL2FMT_DEBUG", raising=False)
    p = str(tmp_path / "m.safetensors")
    try:
        for argv, tb in ((["inspect", p], False), (["inspect", p, "--debug"], True)):
            set_debug(False)
            with pytest.raises(SystemExit) as ex:
                app_mod.main(argv)
            err = capsys.readouterr().err
            assert ex.value.code == 4 and "planted" in err
            assert ("Traceback" in err) is tb and ("run with --debug" in err) is (not tb), err
            set_debug(False)
            r = CliRunner().invoke(app, argv + ["--markdown"])
            assert r.exit_code == 4 and ("Traceback" in r.output) is tb, r.output
    finally:
        set_debug(False)


# ------------------------------------------------------------------------------------------------ class 14 (part)


def test_gguf_embeddings_are_not_linear_layers_and_blocks_are_in_natural_order(tmp_path):
    pytest.importorskip("gguf")
    import numpy as np

    from exl2fmt.inspect import inspect_model

    gen = _generator()
    mh = sys.modules["make_hostile"]
    t = [("token_embd.weight", [32, 4], 0, np.zeros((4, 32), np.float32).tobytes()),
         ("output_norm.weight", [32], 0, b"\0" * 128)]
    for b in (0, 1, 2, 10, 11):
        t.append((f"blk.{b}.attn_q.weight", [32, 32], 0, np.zeros((32, 32), np.float32).tobytes()))
    f = tmp_path / "m.gguf"
    f.write_bytes(mh.gguf_bytes(mh.gguf_llama_kvs(12), t))
    assert gen is not None
    rep = inspect_model(f)
    keys = [r["key"] for r in rep["layers"]]
    assert keys == [f"blk.{b}.attn_q.weight" for b in (0, 1, 2, 10, 11)]
    assert rep["summary"]["linear_layers"] == 5
    assert rep["summary"]["bpw"]["embeddings"] == 32.0
    r = run_bounded("inspect", f)
    rows = [l.split()[0] for l in r.stdout.splitlines() if l.startswith("blk.") and ".weight" in l]
    assert rows == keys


def test_convert_report_lists_layers_in_natural_order(capsys):
    from types import SimpleNamespace as NS

    from exl2fmt.cli.output import Output
    from exl2fmt.cli.convert import _render

    keys = [f"model.layers.{i}.mlp.down_proj" for i in (0, 1, 10, 11, 2, 3)]
    layers = [NS(key=k, shape=(4, 4), source_plan="a", target_plan="b", exact=True, rel_error=0, max_abs_error=0,
                 verified=True) for k in keys]
    rep = NS(source_format="exl2", target="gptq", layers=layers, warnings=[], tensors=[], config_changes=[],
             compatibility=None, files_copied=[], destination="d", files_written=[], summary_lines=lambda: [])
    _render(Output("human"), rep)
    out = capsys.readouterr().out
    shown = [l.split()[0] for l in out.splitlines() if l.startswith("model.layers.")]
    assert shown == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1, 2, 3, 10, 11)]
    qrep = NS(target="exl2", warnings=[], options={}, compatibility=None,
              layers=[NS(key=k, plan="p", bpw=4.0, error=0.1, weight_error=None) for k in keys],
              summary_lines=lambda: [], files_copied=[], files_left_out=[], destination="/nonexistent")
    _render(Output("human"), qrep)
    out = capsys.readouterr().out
    shown = [l.split()[0] for l in out.splitlines() if l.startswith("model.layers.")]
    assert shown == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1, 2, 3, 10, 11)]


def test_generator_reproduces_the_catalogue(tmp_path):
    _generator().generate(tmp_path / "h")
    want = {str(p.relative_to(CAT)): p.read_bytes() for p in sorted(CAT.rglob("*")) if p.is_file()}
    got = {str(p.relative_to(tmp_path / "h")): p.read_bytes() for p in sorted((tmp_path / "h").rglob("*"))
           if p.is_file()}
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name
    assert sum(map(len, want.values())) < 1 << 20
