"""validate --format junit / github (exl2fmt/cli/ci_formats.py).

JUnit: validated against spec/junit.xsd by a real XML Schema validator (xmlschema) and read back by a real JUnit
parser (junitparser); the test cases must be exactly the (file, rule) groups of the same run's --json checks.
GitHub: one workflow command per finding, escaped per GitHub's rules (%, CR, LF; also ':' and ',' in properties),
so an untrusted tensor name can never end the command or start another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from exl2fmt.cli.app import app
from exl2fmt.cli.ci_formats import gh_data, gh_property, xml_text
from exl2fmt.container import write_safetensors
from exl2fmt.sample import write_sample

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
XSD = ROOT / "spec" / "junit.xsd"
EVIL = 'model.layers.0.x<&"]]>\x1b[2J\nfoo,bar:baz%'


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ci")
    good = write_sample(d / "good")
    bad = d / "bad"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    write_safetensors(bad / "extra.safetensors", {EVIL: np.zeros(4, np.float16)})
    return good, bad


def _run(*args):
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout


def _groups(doc):
    return {(c["file"] or doc["path"], f"{c['check']} {c['code']}") for c in doc["checks"]}


def test_junit_schema_valid_and_parsed(models):
    xmlschema = pytest.importorskip("xmlschema")
    junitparser = pytest.importorskip("junitparser")
    schema = xmlschema.XMLSchema(str(XSD))
    for model, want_code in ((models[0], 0), (models[1], 1)):
        code, xml = _run("validate", model, "--format", "junit")
        assert code == want_code  # exit codes unchanged
        schema.validate(xml)  # raises on any violation
        code_j, js = _run("validate", model, "--json")
        doc = json.loads(js)
        assert code_j == code
        suites = junitparser.JUnitXml.fromstring(xml)
        cases = [c for s in suites for c in s]
        assert {(c.classname, c.name) for c in cases} == {(xml_text(f), xml_text(n)) for f, n in _groups(doc)}
        assert len(cases) == len(_groups(doc))  # one test case per rule per file
        failed = {(c.classname, c.name) for c in cases if any(isinstance(r, junitparser.Failure) for r in c.result)}
        want_failed = {(xml_text(c["file"] or doc["path"]), f"{c['check']} {c['code']}") for c in doc["checks"]
                       if c["status"] == "FAIL"}
        assert failed == want_failed
        suite = next(iter(suites))
        assert suite.tests == len(cases) and suite.failures == len(want_failed) and suite.errors == 0
        for c in cases:
            for r in c.result:
                assert r.type == c.name.split(" ", 1)[1]  # the stable code
    assert "\x1b" not in xml and "\\x1b[2J" in xml  # the control characters are shown, not sent


def test_junit_fatal_error_is_a_report(tmp_path):
    xmlschema = pytest.importorskip("xmlschema")
    junitparser = pytest.importorskip("junitparser")
    code, xml = _run("validate", tmp_path / "missing", "--format", "junit")
    assert code == 3
    xmlschema.XMLSchema(str(XSD)).validate(xml)
    (case,) = [c for s in junitparser.JUnitXml.fromstring(xml) for c in s]
    assert isinstance(case.result[0], junitparser.Error) and case.result[0].type == "PATH_NOT_FOUND"


def test_github_annotations(models):
    code, out = _run("validate", models[1], "--format", "github")
    assert code == 1
    _, js = _run("validate", models[1], "--json")
    doc = json.loads(js)
    lines = out.splitlines()
    assert all(l.startswith("::") for l in lines)  # nothing can forge or break a command line
    errors = [l for l in lines if l.startswith("::error ")]
    warnings = [l for l in lines if l.startswith("::warning ")]
    assert len(errors) == sum(c["status"] == "FAIL" for c in doc["checks"])
    assert len(warnings) == sum(c["status"] == "WARN" for c in doc["checks"])
    assert lines[-1].startswith("::notice title=exl2fmt validate FAIL::")
    evil = next(l for l in errors if "NAME_CONTROL_CHARS" in l)
    props, msg = evil[len("::error "):].split("::", 1)
    assert props.count(",") == 1 and props.startswith("file=") and ",title=" in props
    assert "extra.safetensors" in props
    assert gh_property("exl2fmt NAME_CONTROL_CHARS: " + EVIL) in props  # the tensor is named in the title
    assert "foo%2Cbar%3Abaz%25" in props and "foo,bar:baz%25" in msg
    cfg = next(l for l in errors if "CONFIG_MISMATCH" in l)
    assert "file=" in cfg and "config.json" in cfg.split("::")[1]
    code, out = _run("validate", models[0], "--format", "github")
    # a good model: notices, and the loader note (HF_NEEDS_IMPORT: transformers needs import exl2fmt.hf for exl2)
    assert code == 0 and out.splitlines() == [l for l in out.splitlines() if l.startswith("::notice")
                                              or (l.startswith("::warning ") and "HF_NEEDS_IMPORT" in l)]


def test_github_escaping_rules():
    assert gh_data("50% done\r\n") == "50%25 done\\x0d\\x0a"  # control characters visible, then % escaped
    assert gh_property("a:b,c%d") == "a%3Ab%2Cc%25d"
    assert gh_data("a:b,c") == "a:b,c"  # ':' and ',' only matter in properties
    assert xml_text("x\x00y\ufffe") == "x\\x00y\\ufffe"


def test_format_option_compatibility(models):
    def doc(*args):
        code, out = _run("validate", models[0], *args)
        d = json.loads(out)
        d.pop("seconds")
        return code, d

    assert doc("--format", "json") == doc("--json")
    assert _run("validate", models[0], "--format", "xml")[0] == 2
    assert _run("validate", models[0], "--json", "--format", "junit")[0] == 2
    assert _run("validate", models[0], "--markdown", "--format", "markdown")[0] == 0


def test_precommit_entry_maps_files_to_model_dirs(models, tmp_path, capfd):
    from exl2fmt.cli.precommit import main, model_dirs

    good, bad = models
    other = tmp_path / "docs"
    other.mkdir()
    (other / "config.json").write_text("{}")
    files = [str(good / "config.json"), str(good / "output.safetensors"), str(other / "config.json"),
             str(bad / "config.json"), str(tmp_path / "deleted" / "x.safetensors")]
    assert model_dirs(files) == [str(good), str(bad)]  # each model once, the non-model and the deleted skipped
    assert main(["--format", "github", *files]) == 1  # the worst exit code of the runs (good: 0, bad: 1)
    out = capfd.readouterr().out
    assert out.count("::notice title=exl2fmt validate PASS::") == 1 and "CONFIG_MISMATCH" in out
    assert main([str(other / "config.json")]) == 0
