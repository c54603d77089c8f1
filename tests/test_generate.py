"""``exl2fmt generate`` and the generation loop (exl2fmt.runtime.generate) on the trained dense fixture
tests/fixtures/tiny-llama (its own byte-level BPE tokenizer, no chat template), and validate's ``loader`` warning.

Greedy output equals transformers' own ``generate`` token for token; the --json document follows
spec/inspect.schema.json ($defs/generate); --max-new-tokens, seeded sampling, --chat with and without a template,
errors without a traceback, and Ctrl-C (SIGINT to a subprocess whose model is slowed down test-side) exiting 130
with the text so far.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from exl2fmt.cli.app import app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llama"
SCHEMA = json.loads((ROOT / "spec" / "inspect.schema.json").read_text())
runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["generate", *[str(a) for a in args]])


def run_json(*args):
    r = run(*args, "--json")
    return r, json.loads(r.stdout)   # stdout holds exactly one JSON document


@pytest.fixture(scope="module")
def hf():
    from exl2fmt.runtime import load_model, load_tokenizer

    return load_model(FIXTURE), load_tokenizer(FIXTURE)


def hf_greedy(model, ids, n, stop_at_eos):
    kw = {} if stop_at_eos else {"min_new_tokens": n}
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)
    new = out[0, len(ids):].tolist()
    if stop_at_eos and new and new[-1] == model.config.eos_token_id:
        new = new[:-1]
    return new


def check_schema(doc):
    from test_cli import check_schema as check

    check(doc, SCHEMA)


# ------------------------------------------------------------------------------------------------ the loop


@pytest.mark.parametrize("prompt,ignore_eos", [("The Python", False), ("def main():\n    return", True),
                                               ("Ünïcödé 漢字", True)])
def test_greedy_equals_transformers_generate(hf, prompt, ignore_eos):
    model, tok = hf
    r, doc = run_json(FIXTURE, "--prompt", prompt, "-n", 40, *(["--ignore-eos"] if ignore_eos else []))
    assert r.exit_code == 0, r.stderr
    ids = tok(prompt)["input_ids"]
    assert doc["tokens"]["prompt"] == len(ids)
    assert doc["token_ids"] == hf_greedy(model, ids, 40, not ignore_eos)
    assert doc["text"] == tok.decode(doc["token_ids"], skip_special_tokens=True)
    assert doc["stop"] == ("max_new_tokens" if ignore_eos or len(doc["token_ids"]) == 40 else "eos")


def test_json_schema_and_counts():
    r, doc = run_json(FIXTURE, "--prompt", "The", "--max-new-tokens", 5, "--ignore-eos")
    assert r.exit_code == 0
    check_schema(doc)
    assert doc["report"] == "generate" and doc["exit_code"] == 0 and doc["chat"] is False
    assert doc["tokens"]["generated"] == len(doc["token_ids"]) == 5 and doc["stop"] == "max_new_tokens"
    t = doc["timings"]
    assert t["decode_steps"] == 4 and t["prefill_s"] > 0 and t["decode_s"] > 0 and t["load_s"] > 0
    tps = doc["tokens_per_s"]
    assert tps["prefill"] == pytest.approx(doc["tokens"]["prompt"] / t["prefill_s"], rel=1e-2)
    assert tps["decode"] == pytest.approx(4 / t["decode_s"], rel=1e-2)
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"   # load_model: float32 on the CPU by default


def test_human_mode_streams_text_and_reports_speed(hf):
    _, tok = hf
    r = run(FIXTURE, "--prompt", "The", "-n", 12, "--ignore-eos", "--dtype", "float32")
    assert r.exit_code == 0, r.stderr
    _, doc = run_json(FIXTURE, "--prompt", "The", "-n", 12, "--ignore-eos", "--dtype", "float32")
    assert doc["dtype"] == "float32"
    assert r.stdout == doc["text"] + ("" if doc["text"].endswith("\n") else "\n")
    assert "prefill" in r.stderr and "decode" in r.stderr and "tok/s" in r.stderr and "stop: max_new_tokens" in r.stderr


@pytest.mark.parametrize("n", [1, 3])
def test_max_new_tokens_honoured(n):
    _, doc = run_json(FIXTURE, "--prompt", "The", "-n", n, "--ignore-eos")
    assert len(doc["token_ids"]) == n and doc["timings"]["decode_steps"] == n - 1


def test_sampling_with_seed_is_reproducible():
    args = (FIXTURE, "--prompt", "The", "-n", 24, "--ignore-eos", "--temperature", 0.9, "--top-k", 40, "--top-p",
            0.95, "--repetition-penalty", 1.1)
    a = run_json(*args, "--seed", 7)[1]
    b = run_json(*args, "--seed", 7)[1]
    c = run_json(*args, "--seed", 8)[1]
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert a["token_ids"] != c["token_ids"]
    assert a["options"]["temperature"] == 0.9 and a["options"]["seed"] == 7
    greedy = run_json(FIXTURE, "--prompt", "The", "-n", 24, "--ignore-eos")[1]
    assert greedy["options"]["temperature"] == 0.0 and greedy["token_ids"] != a["token_ids"]
    # --top-k alone turns sampling on at temperature 1
    assert run_json(FIXTURE, "--prompt", "The", "-n", 2, "--top-k", 5, "--seed", 1)[1]["options"]["temperature"] == 1.0


def test_stream_decoder_emits_whole_characters(hf):
    from exl2fmt.runtime.generate import StreamDecoder

    _, tok = hf
    text = "naïve 漢字 🙂 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]   # a byte-level token ending inside a character was held back


# ------------------------------------------------------------------------------------------------ --chat


def test_chat_without_template_is_a_clean_error():
    r = run(FIXTURE, "--prompt", "Hi", "--chat")
    assert r.exit_code == 2
    assert "CHAT_TEMPLATE_MISSING" in r.stderr and "Traceback" not in r.stderr + r.stdout and r.stdout == ""
    r, doc = run_json(FIXTURE, "--prompt", "Hi", "--chat")
    assert r.exit_code == 2 and doc["error"]["code"] == "CHAT_TEMPLATE_MISSING"
    check_schema(doc)


def test_chat_with_template(tmp_path, hf):
    import shutil

    d = tmp_path / "chat"
    shutil.copytree(FIXTURE, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}assistant:{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    r, doc = run_json(d, "--prompt", "Hello there", "--chat", "-n", 4)
    assert r.exit_code == 0 and doc["chat"] is True
    _, tok = hf
    assert doc["tokens"]["prompt"] == len(tok("<s>user: Hello there\nassistant:", add_special_tokens=False)
                                          ["input_ids"])


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("args,code,err", [
    (["{missing}", "--prompt", "x"], 3, "PATH_NOT_FOUND"),
    (["{notok}", "--prompt", "x"], 3, "TOKENIZER_MISSING"),
    (["{fixture}/model.safetensors", "--prompt", "x"], 3, "UNSUPPORTED_INPUT"),
    (["{fixture}", "--prompt", "x", "--top-p", "1.5"], 2, "USAGE"),
    (["{fixture}", "--prompt", "x", "--temperature", "-1"], 2, "USAGE"),
    (["{fixture}", "--prompt", "x", "-n", "0"], 2, "USAGE"),
    (["{fixture}", "--prompt", "x", "--repetition-penalty", "0"], 2, "USAGE"),
    (["{fixture}", "--prompt", "x", "--device", "nonsense"], 2, "USAGE"),
    (["hf://org/repo", "--prompt", "x"], 2, "USAGE"),
])
def test_errors_are_clean(tmp_path, args, code, err):
    import shutil

    notok = tmp_path / "notok"
    notok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / f, notok / f)
    fill = {"missing": tmp_path / "nope", "notok": notok, "fixture": FIXTURE}
    r = run(*[a.format(**fill) for a in args])
    assert r.exit_code == code, (r.stdout, r.stderr)
    assert f"[{err}]" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_help_has_examples():
    r = runner.invoke(app, ["generate", "--help"])
    assert r.exit_code == 0
    for opt in ("--prompt", "--chat", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                "--repetition-penalty", "--json", "--device", "--dtype", "Examples"):
        assert opt in r.stdout


def test_registering_generate_imports_no_torch():
    code = ("import sys; import exl2fmt.cli.commands as c; "
            "assert 'generate' in [x.name or x.callback.__name__ for x in c.app.registered_commands]; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr


# ------------------------------------------------------------------------------------------------ Ctrl-C

#: the exl2fmt entry point with the fixture's forward slowed down (test-side) and a marker on stderr at the first
#: decode step, so that SIGINT lands mid-generation
SLOW_MAIN = """
import functools, sys, time
import transformers.models.llama.modeling_llama as ml
orig = ml.LlamaForCausalLM.forward
calls = [0]
@functools.wraps(orig)
def slow(self, *a, **k):
    calls[0] += 1
    if calls[0] == 2:
        sys.stderr.write("DECODING\\n"); sys.stderr.flush()
    time.sleep(0.05)
    return orig(self, *a, **k)
ml.LlamaForCausalLM.forward = slow
from exl2fmt.cli.app import main
main(sys.argv[1:])
"""


def _interrupt(*extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-c", SLOW_MAIN, "generate", str(FIXTURE), "--prompt", "The", "-n", "400",
                          "--ignore-eos", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                         # a shell's background job inherits SIGINT ignored, and Python keeps an ignored SIGINT:
                         # give the child the default a terminal's Ctrl-C meets
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = b""
    deadline = time.monotonic() + 120
    try:
        while b"DECODING" not in err:
            assert time.monotonic() < deadline and p.poll() is None, err.decode(errors="replace")
            if select.select([p.stderr], [], [], 1.0)[0]:
                err += os.read(p.stderr.fileno(), 65536)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, rest = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out.decode(), (err + rest).decode(errors="replace")


def test_ctrl_c_keeps_the_text_and_exits_130(hf):
    code, out, err = _interrupt()
    assert code == 130, err
    assert out.strip() and "interrupted" in err and "Traceback" not in err


def test_ctrl_c_with_json(hf):
    model, tok = hf
    code, out, err = _interrupt("--json")
    assert code == 130, err
    doc = json.loads(out)
    check_schema(doc)
    assert doc["stop"] == "interrupted" and doc["exit_code"] == 130
    n = len(doc["token_ids"])
    assert 0 < n < 400
    assert doc["token_ids"] == hf_greedy(model, tok("The")["input_ids"], n, False)
    assert doc["text"] == tok.decode(doc["token_ids"], skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------ validate


def test_validate_warns_when_transformers_needs_an_import(tmp_path):
    from exl2fmt.sample import write_sample
    from exl2fmt.validate import validate_model

    write_sample(tmp_path / "s")
    for strict in (False, True):
        rep = validate_model(tmp_path / "s", strict=strict).as_dict()
        loader = [c for c in rep["checks"] if c["check"] == "loader"]
        assert [(c["status"], c["code"]) for c in loader] == [("WARN", "HF_NEEDS_IMPORT")]
        assert "import exl2fmt.hf" in loader[0]["message"] and "'exl2'" in loader[0]["message"]
        assert rep["exit_code"] == 0 and not loader[0]["escalated"]   # --strict: still a warning
    dense = validate_model(FIXTURE).as_dict()
    assert not [c for c in dense["checks"] if c["check"] == "loader"]
    r = runner.invoke(app, ["validate", str(tmp_path / "s"), "--json"])
    check_schema(json.loads(r.stdout))


def test_no_redrawn_progress_bar_in_a_log():
    """stderr to a pipe (a CI log): transformers' "Loading weights" bar, a line redrawn with carriage returns, is
    off; the one summary line stays."""
    exe = Path(sys.executable).with_name("exl2fmt")
    r = subprocess.run([str(exe), "generate", str(FIXTURE), "--prompt", "The", "-n", "2"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Loading weights" not in r.stderr and "\r" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "decode" in r.stderr
