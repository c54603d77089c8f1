"""The library API a user finds at the top: ``exl2fmt.inspect_model``, ``validate_model``, ``convert``, ``quantize``,
``dequantize_layer`` (lazy re-exports), their docstring examples, and what importing them costs."""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import subprocess
import sys

import pytest

import exl2fmt
from exl2fmt.errors import ErrorCode, Exl2Error

API = ("inspect_model", "validate_model", "convert", "quantize", "dequantize_layer")


def test_the_api_is_listed_and_resolves():
    from exl2fmt.converters import convert, quantize
    from exl2fmt.inspect import inspect_model
    from exl2fmt.model import dequantize_layer
    from exl2fmt.validate import validate_model

    assert set(API) <= set(exl2fmt.__all__) and set(API) <= set(dir(exl2fmt))
    assert (exl2fmt.inspect_model, exl2fmt.validate_model, exl2fmt.convert, exl2fmt.quantize,
            exl2fmt.dequantize_layer) == (inspect_model, validate_model, convert, quantize, dequantize_layer)
    for name, (mod, attr) in exl2fmt._LAZY.items():  # every lazy entry names a real object
        assert getattr(importlib.import_module(mod), attr) is getattr(exl2fmt, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        exl2fmt.nope  # noqa: B018


def _imported_after(code: str) -> list[str]:
    p = subprocess.run([sys.executable, "-c", "import sys\n" + code + "\nimport json\nprint(json.dumps(sorted("
                        "m for m in ('torch', 'numba', 'triton', 'numpy') if m in sys.modules)))"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_import_and_api_lookup_stay_light():
    # the read-side and conversion entry points: none of torch, numba, triton (not even numpy) on lookup
    assert _imported_after("import exl2fmt\nexl2fmt.inspect_model") == []
    assert _imported_after("import exl2fmt\nfor n in ('inspect_model', 'validate_model', 'convert', 'quantize'):\n"
                           "    getattr(exl2fmt, n)") == []
    # dequantize_layer is the Numba decoder itself: numba, never torch
    heavy = _imported_after("import exl2fmt\nexl2fmt.dequantize_layer")
    assert "torch" not in heavy and "triton" not in heavy


@pytest.mark.parametrize("obj", ["exl2fmt", "exl2fmt.validate", "exl2fmt.converters.convert",
                                 "exl2fmt.converters.quantize"])
def test_docstring_examples_run(obj, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the examples' tempfile.mkdtemp() lands in tmp_path
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    mod, _, attr = obj.partition(".converters.")
    target = importlib.import_module(obj) if not attr else getattr(importlib.import_module("exl2fmt.converters"),
                                                                     attr)
    finder = doctest.DocTestFinder(recurse=False)
    tests = [t for t in finder.find(target, obj) if t.examples]
    assert tests, f"{obj} has no docstring example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    res = runner.summarize(verbose=False)
    assert res.failed == 0 and res.attempted > 0


def test_every_api_function_has_an_example():
    import exl2fmt.inspect as ins

    for name in API:
        doc = inspect.getdoc(getattr(exl2fmt, name)) or ""
        if ">>>" not in doc:  # inspect_model's and dequantize_layer's examples live in the package docstring
            assert f"exl2fmt.{name}(" in exl2fmt.__doc__, name
    assert ins.inspect_model is exl2fmt.inspect_model


def test_convert_has_no_test_hooks_in_its_signature():
    for fn in (exl2fmt.convert, exl2fmt.quantize):
        params = inspect.signature(fn).parameters
        assert not [p for p in params if p.startswith("_")], fn.__name__


def test_verify_checksum_is_refused(tmp_path):
    from exl2fmt.sample import write_sample

    write_sample(tmp_path / "m")
    with pytest.raises(Exl2Error) as e:
        exl2fmt.convert(tmp_path / "m", tmp_path / "o", "fp16", verify="checksum")
    assert e.value.code is ErrorCode.USAGE and "auto, full" in e.value.message and "'checksum'" in e.value.message
    assert not (tmp_path / "o").exists()


def test_quantize_refuses_what_is_not_a_quantizer_job(tmp_path):
    from exl2fmt.sample import write_sample

    write_sample(tmp_path / "m")
    with pytest.raises(Exl2Error) as e:
        exl2fmt.quantize(tmp_path / "m", tmp_path / "o", "fp16")
    assert e.value.code is ErrorCode.USAGE and "exl2 or gptq" in e.value.message
    with pytest.raises(Exl2Error) as e:  # an EXL2 source: re-packing is convert's job, not the quantizer's
        exl2fmt.quantize(tmp_path / "m", tmp_path / "o", "gptq")
    assert e.value.code is ErrorCode.USAGE and "the source is exl2" in e.value.message
    assert not (tmp_path / "o").exists()
