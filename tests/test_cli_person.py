"""The command line as a person meets it (issue 12): every case runs ``exl2fmt`` as a subprocess.

Missing extras (blocked by a shadow module on PYTHONPATH that raises ImportError), the global --debug, what
--force may replace, DST names, options checked before DST, messages, --help, counts and exit codes, the overall
progress bar (drawn on a pseudo-terminal 80 columns wide), --status-lines, interrupt and --resume messages,
the model card of a quantized output, and the one-time "compiling kernels" note.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_cli

from exl2fmt.sample import write_sample

_runner = None


def cli(*args):
    """In-process (typer's CliRunner), for the cases beyond each point's subprocess run."""
    global _runner
    from typer.testing import CliRunner

    from exl2fmt.cli.app import app

    _runner = _runner or CliRunner()
    return _runner.invoke(app, [str(a) for a in args])

FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"


def shim(tmp_path: Path, module: str, body: str | None = None) -> str:
    d = tmp_path / f"shim-{module}"
    d.mkdir(exist_ok=True)
    (d / f"{module}.py").write_text(body or f'raise ImportError("No module named {module!r} (test shim)")\n')
    return str(d)


def no_traceback(p) -> bool:
    return "Traceback" not in p.stdout + p.stderr


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample") / "s"
    write_sample(d)
    return d


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """A 2-layer Llama (hidden 64) with random fp16 weights, a source card with front matter, a training log, and
    calibration token ids: small enough that GPTQ quantizes it in seconds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("mini")
    d = root / "mini"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(d, safe_serialization=True)
    (d / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# mini\n\nThe source card text.\n")
    (d / "train_log.json").write_text('{"loss": [1, 0.5]}\n')
    ids = root / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, (2, 32)))
    return d, ids


# ------------------------------------------------------------------------------------------------ 1 extras


def test_missing_gguf_is_exit_3_with_the_pip_command_before_any_work(sample, tmp_path):
    pytest.importorskip("gguf")
    from exl2fmt.converters import convert

    g = tmp_path / "m.gguf"
    convert(sample, g, "gguf")
    path = shim(tmp_path, "gguf")
    p = run_cli("convert", sample, tmp_path / "out.gguf", "--to", "gguf", pythonpath=path)
    assert p.returncode == 3 and no_traceback(p), p.stderr
    assert "pip install 'exl2fmt[gguf]'" in p.stderr and "[UNSUPPORTED_INPUT]" in p.stderr, p.stderr
    p = run_cli("convert", g, tmp_path / "back", "--to", "fp16", "--json", pythonpath=path)
    doc = json.loads(p.stdout)
    assert p.returncode == 3 and doc["exit_code"] == 3 and doc["error"]["code"] == "UNSUPPORTED_INPUT"
    assert "pip install 'exl2fmt[gguf]'" in doc["error"]["message"]
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "back").exists()
    assert not [p for p in tmp_path.iterdir() if ".exl2fmt-" in p.name]       # no work was started


def test_missing_torch_for_the_quantizer_is_exit_3(tmp_path):
    path = shim(tmp_path, "torch")
    for to in ("exl2",):
        p = run_cli("convert", FIXTURE, tmp_path / f"q-{to}", "--to", to, pythonpath=path)
        assert p.returncode == 3 and no_traceback(p), p.stderr
        assert "torch" in p.stderr and "pip install 'exl2fmt[quant]'" in p.stderr
        assert not (tmp_path / f"q-{to}").exists() and not (tmp_path / f".q-{to}.exl2fmt-work").exists()


def test_an_unforeseen_missing_extra_is_answered_the_same_way():
    from exl2fmt.extras import missing_extra, packages_of

    assert set(packages_of("quant")) >= {"torch", "tokenizers"} and packages_of("gguf") == ("gguf",)
    e = missing_extra(ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers"))
    assert e is not None and "pip install 'exl2fmt[quant]'" in e.message
    assert missing_extra(ModuleNotFoundError("No module named 'nosuch'", name="nosuch")) is None


# ------------------------------------------------------------------------------------------------ 2 --debug


def test_global_debug_reaches_convert(sample, tmp_path):
    path = shim(tmp_path, "gguf", 'raise RuntimeError("boom in the gguf package (test shim)")\n')
    args = ("convert", sample, tmp_path / "o.gguf", "--to", "gguf")
    p = run_cli("--debug", *args, pythonpath=path)
    assert p.returncode == 4 and "Traceback" in p.stderr and "boom in the gguf package" in p.stderr
    env_before = os.environ.get("EXL2FMT_DEBUG")
    os.environ["EXL2FMT_DEBUG"] = "1"
    try:
        p = run_cli(*args, pythonpath=path)
    finally:
        os.environ.pop("EXL2FMT_DEBUG") if env_before is None else os.environ.__setitem__("EXL2FMT_DEBUG", env_before)
    assert p.returncode == 4 and "Traceback" in p.stderr


# ------------------------------------------------------------------------------------------------ 3 --force, names


def test_force_replaces_only_an_output_of_the_same_kind(sample, tmp_path):
    txt = tmp_path / "precious.txt"
    txt.write_text("keep me\n")
    p = run_cli("convert", sample, txt, "--to", "fp16", "--force")
    assert p.returncode == 2 and "[OUTPUT_EXISTS]" in p.stderr and "regular file" in p.stderr
    assert txt.read_text() == "keep me\n"
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.md").write_text("x")
    p = cli("convert", sample, notes, "--to", "fp16", "--force")
    assert p.exit_code == 2 and "holds no model" in p.stderr and (notes / "todo.md").exists()
    out = tmp_path / "f16"
    assert cli("convert", sample, out, "--to", "fp16").exit_code == 0
    p = cli("convert", sample, out, "--to", "bf16")
    assert p.exit_code == 2 and "the output directory exists; pass --force" in p.stderr
    assert "force=True" not in p.stderr and "overwrite/" not in p.stderr
    p = cli("convert", sample, out, "--to", "bf16", "--force")             # a model directory: replaced
    assert p.exit_code == 0, p.stderr
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_gguf_force_names_and_inferred_target(sample, tmp_path):
    pytest.importorskip("gguf")
    g = tmp_path / "m.gguf"
    p = run_cli("convert", sample, g)                                      # --to inferred from .gguf
    assert p.returncode == 0 and g.read_bytes()[:4] == b"GGUF", p.stderr
    p = cli("convert", sample, tmp_path / "plain")
    assert p.exit_code == 2 and "--to" in p.stderr
    txt = tmp_path / "x.gguf.txt"
    txt.write_text("not gguf")
    p = cli("convert", sample, txt, "--to", "gguf", "--force")
    assert p.exit_code == 2 and "GGUF magic" in p.stderr and txt.read_text() == "not gguf"
    p = cli("convert", sample, tmp_path / "plainfile", "--to", "gguf")
    assert p.exit_code == 0 and "does not end in .gguf" in p.stderr
    assert cli("convert", sample, g, "--to", "gguf", "--force").exit_code == 0       # a GGUF: replaced
    p = cli("convert", sample, tmp_path / "dir.gguf", "--to", "fp16")
    assert p.exit_code == 0 and (tmp_path / "dir.gguf").is_dir()
    assert "writes a model directory" in p.stderr and "named like a file" in p.stderr


# ------------------------------------------------------------------------------------------------ 6 options


def test_options_are_checked_before_dst_and_against_the_target(sample, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    cases = [
        (("--to", "fp16", "--bits", "9"), "--bits applies only to --to exl2 or gptq"),
        (("--to", "gptq", "--bits", "9"), "--bits for --to gptq must be 2, 3, 4 or 8"),
        (("--to", "exl2", "--bits", "9"), "--bits for --to exl2 must lie in [2, 8.5]"),
        (("--to", "fp16", "--calibration", "x.txt"), "--calibration only applies when quantizing"),
        (("--to", "fp16", "--gguf-type", "q8_0"), "--gguf-type applies only to --to gguf"),
        (("--to", "gguf", "--shard-size", "1GB"), "--shard-size does not apply to --to gguf"),
        (("--to", "fp16", "--sym"), "--sym/--asym applies only to --to gptq"),
        (("--to", "gptq", "--seed", "3"), "the source is exl2, not an FP16/BF16 model"),
        (("--to", "gptq", "--resume"), "--resume only applies when quantizing"),
    ]
    p = run_cli("convert", sample, out, *cases[0][0])       # the person's case: --bits 9, not OUTPUT_EXISTS
    assert p.returncode == 2 and "[USAGE]" in p.stderr and cases[0][1] in p.stderr, p.stderr
    for args, msg in cases[1:]:
        p = cli("convert", sample, out, *args)
        assert p.exit_code == 2 and "[USAGE]" in p.stderr and msg in p.stderr, (args, p.stderr)
    assert not any(out.iterdir())


# ------------------------------------------------------------------------------------------------ 7 messages


def test_messages_dequantize_sample(sample, tmp_path):
    p = run_cli("dequantize", sample, "model.layers.0.mlp.down_prj")
    assert p.returncode == 1 and "did you mean: model.layers.0.mlp.down_proj" in p.stderr
    d = tmp_path / "adir"
    d.mkdir()
    p = cli("dequantize", sample, "model.layers.0.mlp.down_proj", "-o", d, "--force")
    assert p.exit_code == 2 and "is a directory" in p.stderr and "output file exists" not in p.stderr
    f = tmp_path / "afile"
    f.write_text("x")
    p = cli("sample", f)
    assert p.exit_code == 2 and "exists as a file" in p.stderr and f.read_text() == "x"
    p = cli("sample", sample)
    assert p.exit_code == 2 and "pass --force" in p.stderr and "overwrite/" not in p.stderr


# ------------------------------------------------------------------------------------------------ 8 help


def test_convert_help_lists_every_path_once(tmp_path):
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "exl2fmt.cli.app", "convert", "--help"], capture_output=True,
                       text=True, env=env, cwd=str(ROOT), timeout=120)
    h = p.stdout
    assert p.returncode == 0 and "<bool>" not in h
    assert h.count("Exit codes") == 1
    summary = h.split("The source format")[0]
    for path in ("GGUF -> FP16", "-> GGUF", "FP16/BF16 -> EXL2/GPTQ", "EXL2 <-> GPTQ"):
        assert path.replace(" ", "") in summary.replace(" ", "").replace("\n", ""), path
    assert ".gguf" in h.split("Options")[0]                           # SRC / DST help name the GGUF file
    assert re.search(r"gguf \(one\s+llama\.cpp\s+file\)", h)
    for cmd in ("inspect", "validate", "sample", "dequantize", "demo"):
        assert "<bool>" not in cli(cmd, "--help").stdout, cmd


def test_no_converter_message_lists_every_path(sample, tmp_path):
    from exl2fmt.converters import convert

    g = tmp_path / "g"
    convert(sample, g, "gptq")
    p = run_cli("convert", g, tmp_path / "g2", "--to", "gptq")
    assert p.returncode == 2 and "no converter from gptq to gptq" in p.stderr
    for pair in ("dense->exl2", "dense->gptq", "exl2->gguf", "gguf->fp16", "gptq->gguf", "exl2->fp16"):
        assert pair in p.stderr, pair


# ------------------------------------------------------------------------------------------------ 9 counts, codes


def test_inspect_and_convert_count_the_same_linear_layers_and_codes_agree(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = tmp_path / "bert"
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=128, max_position_embeddings=64)
    transformers.BertModel(cfg).save_pretrained(bert, safe_serialization=True)
    ins = json.loads(run_cli("inspect", bert, "--json").stdout)
    p = run_cli("convert", bert, tmp_path / "f16", "--to", "fp16", "--json")
    conv = json.loads(p.stdout)
    n = ins["summary"]["linear_layers"]
    assert n == 13 and conv["summary"]["linear_layers"] == n
    p = cli("convert", bert, tmp_path / "f16b", "--to", "fp16")
    assert f"{n} linear layers" in p.stdout
    if __import__("importlib").util.find_spec("gguf"):
        p = run_cli("convert", bert, tmp_path / "b.gguf", "--to", "gguf")     # unsupported architecture
        assert p.returncode == 3 and "FORMAT_UNSUPPORTED" in p.stderr, p.stderr
    # a truncated file: the input breaks a rule (exit 1) for every command, with the same code
    src = tmp_path / "s"
    write_sample(src)
    data = (src / "output.safetensors").read_bytes()
    (src / "output.safetensors").write_bytes(data[: len(data) // 2])
    for args in (("inspect", src), ("validate", src), ("convert", src, tmp_path / "t", "--to", "fp16"),
                 ("dequantize", src, "lm_head")):
        p = cli(*args)
        assert p.exit_code == 1 and "TRUNCATED" in p.stdout + p.stderr, (args, p.stderr)


# ------------------------------------------------------------------------------------------------ 4 progress, 10 card


def _pty_run(args, columns=80, timeout=240):
    """Run the CLI with stderr (and stdout) on a pseudo-terminal COLUMNS wide; return (rc, text)."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS=str(columns), LINES="24", TERM="xterm")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "exl2fmt.cli.app", *map(str, args)], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, cwd=str(ROOT), env=env)
    os.close(slave)
    chunks = []
    t0 = time.monotonic()
    while True:
        try:
            b = os.read(master, 65536)
        except OSError:
            break
        if not b:
            break
        chunks.append(b)
        if time.monotonic() - t0 > timeout:
            proc.kill()
            break
    os.close(master)
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


def test_quantizer_progress_card_and_files(mini, tmp_path):
    src, ids = mini
    out = tmp_path / "q"
    rc, text = _pty_run(["convert", src, out, "--to", "gptq", "--calibration", ids, "--rows", 2, "--length", 32,
                         "--resume"])
    assert rc == 0, text[-3000:]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)                  # terminal control sequences
    frames = re.split(r"\r", text)
    bars = [f for f in frames if re.match(r"^[█░#-]{10,20} +\d+%", f)]
    assert bars, text[-2000:]
    assert all(len(f.rstrip("\n")) <= 79 for f in bars), max(bars, key=len)
    pct = [int(re.match(r"^[█░#-]+ +(\d+)%", f).group(1)) for f in bars]
    assert pct == sorted(pct) and pct[-1] >= 99                       # one bar: it never goes back
    first_q = next(i for i, f in enumerate(bars) if "quantize:" in f)
    assert any("calibrat" in f for f in bars[:first_q])               # said at once, before any layer
    assert "nothing to resume" in text and "starting fresh" in text
    # the card: front matter, facts equal to the manifest, the inspect --markdown layer table, the source card
    card = (out / "README.md").read_text()
    front = card.split("---\n")[1]
    man = json.loads((out / "exl2fmt-manifest.json").read_text())
    for line in ('base_model: "mini"', "base_model_relation: quantized", 'quantized_by: "exl2fmt ', "format: gptq",
                 "bits: 4", "group_size: 128", "license: apache-2.0", "rows: 2", "length: 32"):
        assert line in front, line
    assert f"source: {man['calibration_perplexity']['fp16']:.4f}" in front
    assert f"quantized: {man['calibration_perplexity']['quantized']:.4f}" in front
    md = run_cli("inspect", out, "--markdown").stdout
    table = md[md.index("### Linear layers"):].split("\n\n### ")[0].strip()
    assert table in card
    assert "## Original model card" in card and "The source card text." in card
    assert card.count("license: apache-2.0") == 1                     # one front matter
    assert not (out / "train_log.json").exists() and "train_log.json" in card
    # "wrote" lists what is really there
    wrote = next(l for l in text.splitlines() if l.startswith(f"wrote {out}"))
    assert sorted(x.strip() for x in wrote.split(": ", 1)[1].split(",")) == sorted(os.listdir(out))


# ------------------------------------------------------------------------------------------------ 5 interrupt


def test_sigterm_says_where_progress_is_and_resume_continues(mini, tmp_path):
    src, ids = mini
    out = tmp_path / "q"
    work = tmp_path / ".q.exl2fmt-work"
    args = [sys.executable, "-m", "exl2fmt.cli.app", "convert", str(src), str(out), "--to", "gptq", "--calibration",
            str(ids), "--rows", "2", "--length", "32"]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    t0 = time.monotonic()
    while not (work / "job.json").exists() and proc.poll() is None and time.monotonic() - t0 < 180:
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.skip("the quantization finished before it could be interrupted")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"progress saved in {work}" in err and "--resume" in err and "delete that directory" in err, err
    assert not out.exists() and work.exists()
    p = run_cli(*args[3:], "--resume", "--status-lines")   # --status-lines: JSON for machines, from the start
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"resuming the quantization (at block \d+ of 4|\(all 4 blocks done)", p.stderr), p.stderr
    assert out.is_dir() and not work.exists()
    lines = [json.loads(l) for l in p.stderr.splitlines() if l.startswith("{")]
    assert lines[0]["phase"] == "calibrate" and "calibrating" in lines[0]["what"]
    for l in lines:
        assert {"status", "done", "total", "what", "elapsed_s", "fraction", "eta_s"} <= set(l)
    fr = [l["fraction"] for l in lines]
    assert fr == sorted(fr) and fr[-1] == 1.0


def test_workdir_description():
    from exl2fmt.quant.workdir import describe, progress_of

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        assert describe(d) is None
        job = {"fingerprint": {"target": "exl2", "source_config": {"num_hidden_layers": 4}}, "measured": {"a": 1, "b": 2},
               "strategy": None, "snapshot": {"phase": "measure", "next_block": 2}}
        Path(d, "job.json").write_text(json.dumps(job))
        assert describe(d) == "the measurement at block 3 of 8 (2 blocks done)"
        job.update(strategy={}, blocks={"x": 1}, snapshot={"phase": "quant", "next_block": 1})
        Path(d, "job.json").write_text(json.dumps(job))
        assert progress_of(d) == {"phase": "quantization", "done": 1, "block": 2, "blocks": 8}


# ------------------------------------------------------------------------------------------------ progress units


def test_overall_fraction_is_weighted_and_monotonic():
    from exl2fmt.cli.progress import PHASE_WEIGHTS, Overall, phases_for

    o = Overall(phases_for("exl2", measuring=True))
    f1, ph, item = o.update(500, 1000, "measure: block 0 option 3")
    w = PHASE_WEIGHTS
    tot = sum(w[p] for p in phases_for("exl2", True))
    assert ph == "measure" and item == "block 0 option 3"
    assert f1 == pytest.approx((w["calibrate"] + 0.5 * w["measure"]) / tot)
    f2, _, _ = o.update(0, 40, "quantize: model.layers.0.self_attn.q_proj")   # a new phase starts from its offset
    assert f2 == pytest.approx((w["calibrate"] + w["measure"]) / tot) and f2 > f1
    assert o.update(1, 1000, "measure: late")[0] == f2                        # never backwards
    g = Overall(phases_for("gptq", measuring=True))                           # no measurement: rescaled
    assert g.update(1, 1, "quantize: x")[0] == pytest.approx((w["calibrate"] + w["quantize"]) /
                                                              sum(w[p] for p in phases_for("gptq", True)))
    plain = Overall([])
    assert plain.update(3, 4, "model.layers.0.mlp.up_proj")[0] == 0.75


def test_eta_appears_only_once_stable_and_lines_fit():
    from exl2fmt.cli.progress import Bar, Eta, Overall, fit

    t = [0.0]
    e = Eta(clock=lambda: t[0])
    assert e.update(0.0) is None
    seen = []
    for i in range(1, 40):                       # a steady 1% per second: 100 s in all
        t[0] = float(i)
        seen.append(e.update(i / 100))
    assert all(v is None for v in seen[:10])     # nothing in the first 10 s
    late = [v for v in seen[20:] if v is not None]
    assert late and all(abs((v + t0) - 100) < 15 for v, t0 in zip(seen[-5:], range(35, 40)))
    e2 = Eta(clock=lambda: t[0])                 # a jumpy rate: no estimate while the estimates disagree
    t[0] = 0.0
    e2.update(0.0)
    for i, f in enumerate([0.05, 0.5, 0.52, 0.9], start=1):
        t[0] = 10.0 + 3 * i
        assert e2.update(f) is None
    assert fit("a" * 100, 10) == "aaa…" + "a" * 6 and len(fit("x" * 200, 33)) == 33
    b = Bar(Overall([]), stream=open(os.devnull, "w"), width=80)
    assert len(b.line(0.37, "quantize: " + "model.layers.123.self_attn.q_proj" * 3, 123.0)) <= 79


# ------------------------------------------------------------------------------------------------ 12 first run


def test_compile_notice_fires_once_and_only_when_numba_compiles():
    numba = pytest.importorskip("numba")
    from exl2fmt.jitnote import MESSAGE, compile_notice

    said = []

    @numba.njit
    def f(x):
        return x + 1

    @numba.njit
    def g(x):
        return x * 2

    with compile_notice(said.append):
        f(1), g(2)                           # two compilations: one message
        f(3)                                 # already compiled: nothing
    assert said == [MESSAGE]
    said.clear()
    with compile_notice(said.append):
        f(4), g(5)
    assert said == []


@pytest.mark.slow
def test_first_deep_validate_says_it_compiles_once(sample, tmp_path):
    env_before = os.environ.get("NUMBA_CACHE_DIR")
    os.environ["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")     # a fresh install's empty cache
    try:
        first = run_cli("validate", sample, "--deep")
        second = run_cli("validate", sample, "--deep")
    finally:
        if env_before is None:
            os.environ.pop("NUMBA_CACHE_DIR")
        else:
            os.environ["NUMBA_CACHE_DIR"] = env_before
    assert first.returncode == 0 and second.returncode == 0
    assert first.stderr.count("compiling kernels, once per install") == 1
    assert "compiling kernels" not in second.stderr and any((tmp_path / "numba-cache").iterdir())


def test_repacked_output_gets_its_own_card_and_only_model_files(sample, tmp_path):
    import shutil

    from exl2fmt.converters import convert

    src = tmp_path / "src"
    shutil.copytree(sample, src)
    (src / "README.md").write_text("---\nlicense: mit\n---\n# the EXL2 card\n")
    (src / "tokenizer_config.json").write_text("{}")
    (src / "train.log").write_text("step 1\n")
    rep = convert(src, tmp_path / "g", "gptq")
    card = (tmp_path / "g" / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "format: gptq" in front and "license: mit" in front and "calibration: null" in front
    assert "## Original model card" in card and "# the EXL2 card" in card
    assert (tmp_path / "g" / "tokenizer_config.json").exists() and not (tmp_path / "g" / "train.log").exists()
    assert "train.log" in card and rep.files_copied == ["tokenizer_config.json"]
    # a plain (dequantized) output keeps copying the source's files as before
    convert(src, tmp_path / "f", "fp16")
    assert (tmp_path / "f" / "README.md").read_text() == "---\nlicense: mit\n---\n# the EXL2 card\n"


def test_gguf_output_carries_its_card_as_general_metadata(sample, mini, tmp_path):
    import shutil

    gguf = pytest.importorskip("gguf")
    from exl2fmt.converters import convert

    src = tmp_path / "src"                       # a quantized (EXL2) source: its card goes into general.*
    shutil.copytree(sample, src)
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# the EXL2 card\n")
    rep = convert(src, tmp_path / "m.gguf", "gguf")
    assert rep.summary_lines()[0].startswith("exl2 -> gguf:")
    f = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    assert f["general.base_model.count"].contents() == 1
    assert f["general.license"].contents() == "apache-2.0"                           # from the source card
    assert "exl2fmt" in f["general.tags"].contents() and "exl2fmt" in f["general.quantized_by"].contents()
    # a dense source gets llama.cpp's own general.* block (byte-identical files): no keys of ours but provenance
    dense, _ = mini
    rep = convert(dense, tmp_path / "d.gguf", "gguf")
    assert rep.summary_lines()[0].startswith("dense -> gguf: 15 linear layers")      # as inspect counts them
    f = gguf.GGUFReader(str(tmp_path / "d.gguf")).fields
    assert "general.tags" not in f and "general.description" not in f
    assert f["general.license"].contents() == "apache-2.0"                           # llama.cpp reads the card too
