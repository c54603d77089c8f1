"""The options of each target (``exl2fmt.converters.options``): one table that ``convert``'s argument check and the
``exl2fmt convert`` command both read.  Every option given to a target it does not apply to is refused by its own
flag, through the CLI and through the Python API (issue 38: ``--batch-tokens`` / ``--order`` were refused as
"batch_tokens only applies ...")."""

from __future__ import annotations

import inspect

import pytest

from exl2fmt.converters import convert
from exl2fmt.converters.options import CONVERT_OPTIONS, QUANT_OPTIONS, QUANTIZING
from exl2fmt.errors import ErrorCode, Exl2Error

TARGETS = ("fp16", "bf16", "gptq", "exl2", "gguf")

#: one example per option: (command-line arguments, the Python value).  A new option of the table needs an entry
#: here (``test_every_option_has_an_example``).
QUANT_EXAMPLES = {
    "head_bits": (["--head-bits", "6"], 6),
    "calibration": (["--calibration", "x.txt"], "x.txt"),
    "rows": (["--rows", "8"], 8),
    "length": (["--length", "64"], 64),
    "measurement": (["--measurement", "m.json"], "m.json"),
    "save_measurement": (["--save-measurement", "s.json"], "s.json"),
    "device": (["--device", "cpu"], "cpu"),
    "seed": (["--seed", "3"], 3),
    "resume": (["--resume"], True),
    "act_order": (["--no-act-order"], False),
    "order": (["--order", "act"], "act"),
    "work_dir": (["--work-dir", "w"], "w"),
    "extended": (["--upstream-tables"], False),
    "refine_scales": (["--refine-scales"], True),
    "block_gain": (["--block-gains"], True),
    "batch_tokens": (["--batch-tokens", "8"], 8),
    "measure_rows": (["--measure-rows", "all"], "all"),
    "measure_search": (["--measure-search", "full"], "full"),
    "measure_precision": (["--measure-precision", "fp32"], "fp32"),
    "workers": (["--workers", "2"], 2),
    "ray_address": (["--ray-address", "127.0.0.1:6379"], "127.0.0.1:6379"),
    "shared_fs": (["--no-shared-fs"], False),
}
CONVERT_EXAMPLES = {
    "bits": (["--bits", "4"], 4),
    "group_size": (["--group-size", "128"], 128),
    "sym": (["--sym"], True),
    "dtype": (["--dtype", "fp16"], "fp16"),
    "gguf_type": (["--gguf-type", "q8_0"], "q8_0"),
    "shard_size": (["--shard-size", "1GB"], "1GB"),
}


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    from exl2fmt.sample import write_sample

    d = tmp_path_factory.mktemp("opts") / "exl2"
    write_sample(d)
    return d


def _cli(*args):
    import typer
    from typer.testing import CliRunner

    from exl2fmt.cli.convert import convert_command

    app = typer.Typer()
    app.command("convert")(convert_command)

    @app.command()
    def _noop() -> None:  # a second command so that typer keeps the sub-command name
        pass

    return CliRunner().invoke(app, ["convert", *map(str, args)])


def _dst(tmp_path, target):
    return tmp_path / ("out.gguf" if target == "gguf" else "out")


def test_every_option_has_an_example_and_a_cli_parameter():
    from exl2fmt.cli.convert import convert_command

    assert set(QUANT_EXAMPLES) == {o.key for o in QUANT_OPTIONS}
    assert set(CONVERT_EXAMPLES) == {o.key for o in CONVERT_OPTIONS}
    params = set(inspect.signature(convert_command).parameters)
    for o in QUANT_OPTIONS + CONVERT_OPTIONS:
        assert o.parameter in params, o.key
        args = {**QUANT_EXAMPLES, **CONVERT_EXAMPLES}[o.key][0]
        assert args[0] in o.flag.split("/"), o.key      # the example sets the option through its own flag


def test_the_quantizer_accepts_every_quantizer_option():
    pipeline = pytest.importorskip("exl2fmt.quant.pipeline")
    assert {o.key for o in QUANT_OPTIONS} <= set(pipeline.QuantOptions.__dataclass_fields__)


@pytest.mark.parametrize("option", QUANT_OPTIONS, ids=lambda o: o.key)
def test_a_quantizer_option_where_nothing_is_quantized_is_refused_by_its_flag(option, sample, tmp_path):
    args, value = QUANT_EXAMPLES[option.key]
    for target in [t for t in TARGETS if t not in option.targets]:
        r = _cli(sample, _dst(tmp_path, target), "--to", target, *args)
        assert r.exit_code == 2 and "USAGE" in r.output and f"{option.flag} only applies" in r.output, \
            (target, r.output)
        with pytest.raises(Exl2Error) as e:
            convert(sample, _dst(tmp_path, target), target, quant={option.key: value})
        assert e.value.code is ErrorCode.USAGE and e.value.message.startswith(f"{option.flag} only applies"), \
            (target, e.value.message)
    # a quantizing target from a quantized source is a re-pack: nothing to calibrate either (EXL2 -> GPTQ with
    # --order static|group|natural re-quantizes, tests/test_requantize.py; --order act is the exact re-pack)
    for target in QUANTIZING:
        r = _cli(sample, tmp_path / "out", "--to", target, *args)
        if option.key == "order" and target == "gptq":
            assert r.exit_code == 2 and "--order act: EXL2 -> GPTQ without --order already is the act-order" in \
                r.output, r.output
            continue
        if target == "gptq":   # the way to a GPTQ without activation order is named
            assert "add --order static" in r.output, r.output
        assert r.exit_code == 2 and f"{option.flag} only applies" in r.output and "the source is exl2" in r.output, \
            (target, r.output)
        with pytest.raises(Exl2Error) as e:
            convert(sample, tmp_path / "out", target, quant={option.key: value})
        assert e.value.code is ErrorCode.USAGE and e.value.message.startswith(f"{option.flag} only applies")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("option", CONVERT_OPTIONS, ids=lambda o: o.key)
def test_a_convert_option_for_another_target_is_refused_by_its_flag(option, sample, tmp_path):
    args, value = CONVERT_EXAMPLES[option.key]
    for target in [t for t in TARGETS if t not in option.targets]:
        r = _cli(sample, _dst(tmp_path, target), "--to", target, *args)
        assert r.exit_code == 2 and "USAGE" in r.output and option.flag in r.output, (target, r.output)
        if option.key == "shard_size":   # the API always has a shard size (its default); one file ignores it
            continue
        with pytest.raises(Exl2Error) as e:
            convert(sample, _dst(tmp_path, target), target, **{option.key: value})
        assert e.value.code is ErrorCode.USAGE and e.value.message.startswith(option.flag), (target, e.value.message)
    assert not any(tmp_path.iterdir())
