"""The ``exl2fmt`` command line: a thin typer shell over library calls (the typer app; the entry point is
``exl2fmt.cli.app:main``, which runs plain ``inspect`` / ``validate`` command lines without loading this module).

Each command calls one library function (``exl2fmt.inspect.inspect_model``, ``exl2fmt.validate.validate_model``,
``exl2fmt.sample.write_sample``, ``exl2fmt.dequantize_layer``) and hands the result to the one output sink
(``exl2fmt.cli.output.Output``).  Exceptions become a message and an exit code in ``exl2fmt.cli.errors``.
``inspect`` and ``validate`` are the typer-free functions of ``exl2fmt.cli.checks`` behind typer's options.

Start-up cost matters (``inspect`` of a 70B model: at most 5x a bare Python process that parses the same headers,
bench/bench_inspect.py): this module imports only typer and exl2fmt.errors at import time; rich, the container
and numba are imported inside the commands that need them, numpy on the first array (``inspect`` reads q_groups
as bytes and never imports it), typer's pydantic adapters only for values that need one (``_lazy_coercion``),
and torch/triton only for ``validate --kernel`` / ``--run``.
"""

from __future__ import annotations

import os
from typing import Annotated, List, Optional

import typer

from . import checks
from .errors import EXIT_INVALID, EXIT_OK, EXIT_USAGE, set_debug

__all__ = ["app"]

EXIT_CODES_HELP = (
    "Exit codes: 0 success (validate: no check failed; inspect: the report was made, and the issues it saw in "
    "passing are listed in it: validate is the gate) · 1 the input breaks a rule / a check failed · "
    "2 usage error · 3 unreadable or unsupported input · 4 internal error (details with --debug)."
)

app = typer.Typer(
    name="exl2fmt",
    help="Reference toolkit for the EXL2 quantized-LLM format: inspect, validate, dequantize, convert.",
    epilog=EXIT_CODES_HELP,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)

_STATE = {"debug": False}


def _version_callback(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"exl2fmt {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback, is_eager=True,
                                                    help="Print the version and exit.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors "
                                        "(also EXL2FMT_DEBUG=1).")] = False,
) -> None:
    """Reference toolkit for the EXL2 quantized-LLM format: inspect, validate, dequantize, convert."""
    _STATE["debug"] = debug
    set_debug(debug)   # every command's exception boundary, convert's included


#: ``--debug`` after the command as well as before it (``exl2fmt inspect FILE --debug``): the hint of an internal
#: error says "run with --debug", and users add it at the end of the command line they just ran.
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an internal error (same as "
                                        "exl2fmt --debug COMMAND, or EXL2FMT_DEBUG=1).")]


def _debug(flag: bool) -> bool:
    """The command's ``--debug`` or the root one, made global (every exception boundary sees it)."""
    if flag:
        _STATE["debug"] = True
        set_debug(True)
    return _STATE["debug"]


def _output(json_: bool = False, markdown: bool = False):
    out = checks.make_output(json_, markdown)
    if out is None:  # the usage error is printed
        raise typer.Exit(EXIT_USAGE)
    return out


def _run(out, body) -> None:
    """Run a command body; map every exception to a message and an exit code."""
    raise typer.Exit(checks.run_body(out, body, debug=_STATE["debug"], passthrough=(typer.Exit,)))


# ------------------------------------------------------------------------------------------------ inspect

RevisionOpt = Annotated[Optional[str], typer.Option("--revision", metavar="BRANCH|TAG|COMMIT", help="For hf:// "
                        "paths: the revision (same as hf://ORG/REPO@REV; EXL2 repos use one branch per bitrate; a "
                        "missing one lists the branches).", show_default=False)]


PathArg = Annotated[str, typer.Argument(help="A .safetensors file, a model directory (sharded or not), a .gguf "
                                        "file, or a Hub model hf://ORG/REPO[@REVISION][/PATH] (read by range: "
                                        "pip install 'exl2fmt[hub]').", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout "
                                       "(schema: spec/inspect.schema.json).")]


@app.command(epilog=EXIT_CODES_HELP)
def inspect(
    path: PathArg,
    json_: JsonOpt = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="GitHub markdown for a model card.")] = False,
    layers: Annotated[bool, typer.Option("--layers/--no-layers", help="Show the per-layer table.")] = True,
    revision: RevisionOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Show what a model really is, from its headers alone (never reads tensor data).

    Format per layer and for the model (EXL2, GPTQ, AWQ, EXL3, dense, GGUF), producer, logical parameters,
    stored bytes, bits per weight (decoder, head, overall; overhead included), estimated weight memory,
    per-layer group plans, per-block totals and a bit-width histogram.

    **Examples**

    * `exl2fmt inspect ./Llama-3-8B-exl2-4.0bpw/`
    * `exl2fmt inspect model.safetensors --no-layers`
    * `exl2fmt inspect ./model --json > report.json`
    * `exl2fmt inspect ./model --markdown >> README.md`
    * `exl2fmt inspect hf://turboderp/Llama-3-8B-exl2@4.0bpw` (Hub: headers by range, nothing downloaded)
    """
    raise typer.Exit(checks.inspect_command(path, json_=json_, markdown=markdown, layers=layers, revision=revision,
                                            debug=_debug(debug)))


# ------------------------------------------------------------------------------------------------ validate


@app.command()
def validate(
    path: Annotated[str, typer.Argument(help="A .safetensors file, a model directory, or hf://ORG/REPO[@REVISION] "
                                        "(structural checks by range requests).", show_default=False)],
    deep: Annotated[bool, typer.Option("--deep", help="Also read the data: permutations, scales, NaN/Inf, "
                                       "dequantize every layer, per-layer weight statistics.")] = False,
    reference: Annotated[Optional[str], typer.Option("--reference", metavar="DIR|hf://ORG/REPO", help="Compare "
                         "every dequantized layer with this FP16/BF16 model (implies --deep); an hf:// source is "
                         "compared by shapes and config from its headers alone.", show_default=False)] = None,
    fix_index: Annotated[bool, typer.Option("--fix-index", help="First write a correct "
                         "model.safetensors.index.json (atomically; tensor files are never touched).")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Treat warnings as failures.")] = False,
    kernel: Annotated[bool, typer.Option("--kernel", help="Run every EXL2 layer (and 2/4/8-bit GPTQ layer) through the bundled Triton kernels "
                      "on random inputs and compare with the reference: dequantization bit for bit, y = x @ W "
                      "within the fp32-accumulation bound (needs pip install 'exl2fmt[kernels]').")] = False,
    run: Annotated[bool, typer.Option("--run", help="A full forward pass (transformers' modeling code for the "
                   "model's architecture, one layer at a time) on fixed token ids with every EXL2 linear through the Triton kernel, compared with the forward over the "
                   "dequantized weights: max logit difference, KL, top-1 agreement (needs pip install "
                   "'exl2fmt[kernels]').")] = False,
    prompt_ids: Annotated[Optional[str], typer.Option("--prompt-ids", metavar="ID,ID,...", help="Token ids for "
                          "--run (default: 16 ids drawn with a fixed seed over the vocabulary).",
                          show_default=False)] = None,
    device: Annotated[Optional[str], typer.Option("--device", metavar="cpu|cuda[:N]", help="Where --kernel / --run run "
                      "(default: cuda when torch sees one, else cpu = Triton's interpreter, slow: small models "
                      "only).", show_default=False)] = None,
    kernel_m: Annotated[Optional[List[int]], typer.Option("--kernel-m", metavar="M", help="Rows of x for "
                        "--kernel, repeatable (default: 1 and 16; on CUDA also 128).", show_default=False)] = None,
    json_: JsonOpt = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="A markdown table of the checks.")] = False,
    fmt: Annotated[Optional[str], typer.Option("--format", metavar="human|json|markdown|junit|github",
                   help="Output format: junit = JUnit XML (one test case per rule per file, for GitLab / Jenkins / "
                   "GitHub test reporters), github = GitHub Actions annotations; --json / --markdown are "
                   "short for --format json / markdown.", show_default=False)] = None,
    revision: RevisionOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Check a model against every rule exl2fmt knows: one line per check, PASS / WARN / FAIL with a stable code.

    Structural checks read headers only: safetensors container, index <-> shards both ways, config.json <->
    tensor shapes, every EXL2 invariant, GPTQ shapes, control characters in names, one format per layer,
    quantization_config.bits vs measured bpw.  `--deep` reads the data; `--reference DIR` adds an error
    bound per layer against the original model; `--kernel` proves every EXL2 (and 2/4/8-bit GPTQ) layer runs through the Triton
    kernels and matches the reference (on `--device cpu` in Triton's interpreter: slow, small models only);
    `--run` runs the whole model through the kernel on fixed token ids and compares the logits with the
    forward over the dequantized weights.

    **Exit codes**: 0 every check passed (warnings allowed unless `--strict`) · 1 a check failed ·
    2 usage error · 3 unreadable or unsupported input · 4 internal error.

    **Examples**

    * `exl2fmt validate ./model/` (CI gate before publishing)
    * `exl2fmt validate ./model/ --deep --strict`
    * `exl2fmt validate ./model-exl2/ --reference ./model-fp16/`
    * `exl2fmt validate ./model/ --fix-index`
    * `exl2fmt validate ./model/ --kernel` (GPU; `--device cpu` for a small model)
    * `exl2fmt validate ./model/ --run --prompt-ids 1,15043,3186 --json | jq .run.kernel`
    * `exl2fmt validate ./model/ --json | jq '.checks[] | select(.status != "PASS")'`
    * `exl2fmt validate ./model/ --format junit > exl2fmt-junit.xml` (CI test report)
    * `exl2fmt validate ./model/ --format github` (annotations in a GitHub Actions job)
    * `exl2fmt validate hf://ORG/REPO@4.0bpw` (structural checks on the Hub, headers by range)
    * `exl2fmt validate ./model-exl2/ --reference hf://ORG/REPO-fp16` (shapes and config from headers alone)
    """
    raise typer.Exit(checks.validate_command(path, deep=deep, reference=reference, fix_index=fix_index, strict=strict,
                                             kernel=kernel, run=run, prompt_ids=prompt_ids, device=device,
                                             kernel_m=kernel_m, json_=json_, markdown=markdown, fmt=fmt,
                                             revision=revision, debug=_debug(debug)))


# ------------------------------------------------------------------------------------------------ sample


@app.command()
def sample(
    directory: Annotated[str, typer.Argument(help="Where to write config.json and output.safetensors.",
                                             show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing sample.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Write the embedded sample: a tiny Llama-shaped EXL2 model (deterministic, all six bit widths).

    **Examples**

    * `exl2fmt sample ./exl2fmt-sample`
    * `exl2fmt sample ./exl2fmt-sample --force`
    """
    _debug(debug)
    out = _output()

    def body():
        from ..sample import write_sample

        d = write_sample(directory, overwrite=force)
        files = sorted(p.name for p in d.iterdir() if p.is_file())
        out.line(f"wrote the sample model to {d} ({', '.join(files)})")
        return EXIT_OK

    _run(out, body)


# ------------------------------------------------------------------------------------------------ dequantize


@app.command()
def dequantize(
    path: Annotated[str, typer.Argument(help="A .safetensors file or a model directory.", show_default=False)],
    key: Annotated[str, typer.Argument(help="The layer prefix, e.g. model.layers.0.mlp.down_proj.",
                                       show_default=False)],
    output: Annotated[Optional[str], typer.Option("-o", "--output", metavar="FILE.npy", help="Write the weight "
                      "as a .npy file (float16 [out_features, in_features]).", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output file.")] = False,
    json_: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Dequantize one linear layer (EXL2, GPTQ or dense) to the nn.Linear weight, float16 [out, in].

    Prints the shape and weight statistics; `-o` also writes a .npy file (atomically).

    **Examples**

    * `exl2fmt dequantize ./model model.layers.0.mlp.down_proj`
    * `exl2fmt dequantize ./model lm_head -o lm_head.npy`
    """
    _debug(debug)
    out = _output(json_)

    def body():
        from .. import dequantize_layer
        from ..errors import ErrorCode, Exl2Error
        from ..validate import weight_stats

        if output is not None and os.path.isdir(output):
            raise Exl2Error(ErrorCode.OUTPUT_EXISTS, "the output path is a directory; -o names the .npy file to "
                            "write (e.g. -o down.npy)", file=output)
        if output is not None:     # --force replaces only a .npy file, never one in the model read (issue 41)
            from ..outputs import file_output_error

            err = file_output_error(output, force, "npy", "-o", no_replace_inside=((path, "the model being read"),))
            if err is not None:
                raise err
        try:
            w = dequantize_layer(path, key)
        except Exl2Error as e:
            if e.code is not ErrorCode.LAYER_NOT_FOUND:
                raise
            raise Exl2Error(e.code, e.message + _did_you_mean(path, key), file=e.file, tensor=e.tensor) from None
        if output is not None:
            _save_npy(output, w)
        s = weight_stats(w)
        out.kv(f"{key}", [("key", key), ("shape", list(w.shape)), ("dtype", str(w.dtype)),
                          ("mean", s["mean"]), ("std", s["std"]), ("absmax", s["absmax"]),
                          ("nonfinite", s["nonfinite"]), ("written", output)])
        return EXIT_OK

    _run(out, body)


def _did_you_mean(path: str, key: str) -> str:
    """"; did you mean: A, B?" with the model's closest linear-layer names (difflib), or "" when none is close."""
    import difflib

    try:
        from ..container import open_model
        from ..model import find_layers

        m = open_model(path)
        try:
            names = sorted(find_layers(m.names()))
        finally:
            m.close()
    except Exception:  # noqa: BLE001 - only a hint: the original error stands
        return ""
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    return f"; did you mean: {', '.join(close)}?" if close else ""


def _save_npy(path: str, w) -> None:
    from pathlib import Path

    import numpy as np

    from ..container.publish import atomic_write

    def write(f):
        try:
            np.save(f, w, allow_pickle=False)
        except OSError as e:
            if e.errno is None:              # numpy's short-write error has no errno
                raise OSError(f"{e} (is the disk full?)") from None
            raise

    # a fresh temp name (O_EXCL) next to the file, fsync, rename: never through a link at a guessable name;
    # an OSError becomes IO_ERROR naming the file
    atomic_write(Path(path), write)


# ------------------------------------------------------------------------------------------------ demo


@app.command()
def demo(
    directory: Annotated[Optional[str], typer.Option("--dir", metavar="DIR", help="Where to write the sample "
                         "(default: a new temporary directory).", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a sample already in --dir.")] = False,
    debug: DebugOpt = False,
) -> None:
    """The main job, end to end on the embedded sample: write it, inspect it, validate it with --deep, and
    dequantize every layer, comparing the fast Numba decoder with the slow NumPy oracle bit for bit.

    Exits 0 only if every step passed.

    **Examples**

    * `exl2fmt demo`
    * `exl2fmt demo --dir ./exl2fmt-sample --force`
    """
    _debug(debug)
    out = _output()

    def body():
        import tempfile
        import time

        from ..inspect import inspect_model
        from ..sample import write_sample
        from ..validate import compare_with_oracle, validate_model

        t0 = time.perf_counter()
        d = directory or tempfile.mkdtemp(prefix="exl2fmt-demo-")
        out.line(f"[1/4] writing the sample model to {d}", "bold")
        write_sample(d, overwrite=force)
        out.line(f"[2/4] exl2fmt inspect {d}", "bold")
        out.inspect_report(inspect_model(d), show_layers=True)
        out.line(f"[3/4] exl2fmt validate --deep {d}", "bold")
        rep = validate_model(d, deep=True)
        out.validate_report(rep.as_dict())
        out.line("[4/4] dequantize every layer: Numba decoder vs NumPy oracle, bit for bit", "bold")
        rows = compare_with_oracle(d)
        out.table("Bit-exactness", ["layer", "out x in", "plan", "fp16 mismatches", "verdict"],
                  [[r["key"], " x ".join(map(str, r["shape"])), r["plan"], r["mismatches"],
                    "bit-exact" if r["bit_exact"] else "MISMATCH"] for r in rows])
        exact = sum(r["bit_exact"] for r in rows)
        ok = not rep.failed and rows and exact == len(rows)
        verdict = (f"demo {'PASS' if ok else 'FAIL'}: inspect ok, validate --deep {rep.as_dict()['result']} "
                   f"({rep.counts()['fail']} failed), {exact}/{len(rows)} layers bit-exact against the oracle "
                   f"({time.perf_counter() - t0:.1f} s); sample in {d}")
        out.line(verdict, "bold green" if ok else "bold red")
        return EXIT_OK if ok else EXIT_INVALID

    _run(out, body)


# ------------------------------------------------------------------------------------------------ convert

# The convert command (cli/convert.py); importing it loads neither numpy nor numba.
from .convert import convert_command  # noqa: E402

app.command("convert")(convert_command)   # its own exit-code paragraph (in its help) replaces the epilog

# The generate command (cli/generate.py); importing it loads neither torch nor transformers.
from .generate import generate_command  # noqa: E402

app.command("generate")(generate_command)


# ------------------------------------------------------------------------------------------------ entry


def _no_bool_metavar() -> None:
    """Flags take no value: typer's help shows a ``<bool>`` type for them (and for -h/--help); show none."""
    from typer.core import TyperOption

    if getattr(TyperOption.display_type_rich, "_exl2fmt", False):
        return
    plain = TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return plain(self, ctx)

    display_type_rich._exl2fmt = True
    TyperOption.display_type_rich = display_type_rich


_no_bool_metavar()


def _lazy_coercion() -> None:
    """Typer 0.2x coerces parameter values through pydantic ``TypeAdapter``s, built when a parameter is first
    processed - even for an absent optional one - and the import of pydantic alone costs more than ``inspect`` of
    a 70B model (bench/RESULTS.md, issue 18).  Here the adapter is built only for a value that needs it: absent
    values (None) never reach it in typer's ``RuntimeParam.coerce``, a ``str`` value of a ``str`` /
    ``Optional[str]`` parameter and a ``bool`` value of a ``bool`` / ``Optional[bool]`` one are returned as they
    are (what the adapter returns for them); everything else goes to typer's own coercion, unchanged.  Typer
    versions without this machinery (``typer.core._TyperParameter``) are left alone."""
    try:
        from dataclasses import dataclass
        from typing import Optional as _Opt

        from typer import _coercion
        from typer.core import _TyperParameter
    except ImportError:  # pragma: no cover - typer < 0.2x: click types, no pydantic
        return
    plain = getattr(_TyperParameter, "get_runtime_param", None)
    if plain is None or getattr(plain, "_exl2fmt", False) or not hasattr(_coercion, "build_runtime_param"):
        return
    as_is = {str: str, _Opt[str]: str, bool: bool, _Opt[bool]: bool}

    @dataclass(frozen=True)
    class _Lazy(_coercion.RuntimeParam):
        descriptor: object = None
        built: dict = None

        def _coerce_value(self, value, param, ctx):
            kind = as_is.get(self.annotation)
            if kind is not None and type(value) is kind:
                return value
            if "rp" not in self.built:
                self.built["rp"] = _coercion.build_runtime_param(self.descriptor)
            return self.built["rp"]._coerce_value(value, param=param, ctx=ctx)

    def get_runtime_param(self):
        d = getattr(self, "type_descriptor", None)
        if getattr(self, "_runtime_param", True) is None and d is not None:
            self._runtime_param = _Lazy(parameter_info=d.parameter_info, annotation=d.annotation, descriptor=d,
                                        built={})
        return plain(self)

    get_runtime_param._exl2fmt = True
    _TyperParameter.get_runtime_param = get_runtime_param


_lazy_coercion()
