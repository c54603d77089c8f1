"""``exl2fmt convert``: the command-line face of ``exl2fmt.converters.convert``.

``convert_command`` is a plain typer-compatible function; the CLI registers it with
``app.command("convert")(convert_command)`` (``cli/commands.py``).  Imports stay inside the function so that
registering it costs nothing at CLI start-up.  Which parameters are the quantizer's options, and which flag
each option has, comes from ``exl2fmt.converters.options`` (the table ``convert`` checks its arguments with).
"""

from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from ..layout import EXL2_BITS

__all__ = ["convert_command", "Target"]


class Target(str, enum.Enum):
    fp16 = "fp16"
    bf16 = "bf16"
    gptq = "gptq"
    exl2 = "exl2"
    gguf = "gguf"


class GgufType(str, enum.Enum):
    auto = "auto"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"
    q6_k = "q6_k"
    q5_k = "q5_k"
    q5_1 = "q5_1"
    q5_0 = "q5_0"
    q4_k = "q4_k"
    q4_1 = "q4_1"
    q4_0 = "q4_0"
    iq4_nl = "iq4_nl"
    q3_k = "q3_k"
    q2_k = "q2_k"


class VerifyMode(str, enum.Enum):
    auto = "auto"
    full = "full"


class PlainDtype(str, enum.Enum):
    fp16 = "fp16"
    bf16 = "bf16"


def convert_command(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(metavar="SRC", help="The source model: a model directory (sharded or not), "
                                       "one .safetensors file, or a .gguf file. Never modified.",
                                       show_default=False)],
    dst: Annotated[str, typer.Argument(metavar="DST", help="The output: a new model directory, or a .gguf file for "
                                       "--to gguf. Must not exist (see --force) and must lie outside SRC.",
                                       show_default=False)],
    to: Annotated[Optional[Target], typer.Option("--to", "-t", case_sensitive=False, show_default=False,
                                                 help="Target format: fp16 / bf16 (a plain Hugging Face model; also "
                                                 "from a .gguf SRC), gptq, exl2 (quantize an FP16/BF16 model, or "
                                                 "re-pack EXL2 <-> GPTQ), gguf (one llama.cpp file). Optional when "
                                                 "DST ends in .gguf (then gguf).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing DST of the same kind (a model "
                                        "directory, or a GGUF file for --to gguf; never another file), only once the "
                                        "new model is complete and verified.")] = False,
    shard_size: Annotated[str, typer.Option("--shard-size", metavar="SIZE", help="Maximum tensor bytes per "
                                            "output shard: 5GB (10^9), 500MB, 2GiB (2^30) or a byte count. Several "
                                            "shards are named model-0000i-of-0000N.safetensors with an index.")] = "5GB",
    bits: Annotated[Optional[float], typer.Option("--bits", show_default=False, help="--to gptq: 2, 3, 4 or 8 "
                                                  "(default 4). --to exl2 from GPTQ: 2, 3, 4, 5, 6 or 8 (default: "
                                                  "the GPTQ bits). --to exl2 from FP16/BF16: the average bits per "
                                                  "weight of the decoder linears, overhead included, 2.0-8.5 "
                                                  "(default 4.125).")] = None,
    head_bits: Annotated[Optional[int], typer.Option("--head-bits", show_default=False, help="FP16 -> exl2: bits "
                                                     "of the quantized LM head "
                                                     f"({', '.join(map(str, sorted(EXL2_BITS)))}). Default: 6; "
                                                     "none for a model that ties its head to its embedding "
                                                     "(tie_word_embeddings: the fp16 embedding serves as the "
                                                     "head, as in GPTQ files); given, a tied model's head is "
                                                     "also written, quantized.")] = None,
    calibration: Annotated[Optional[str], typer.Option("--calibration", metavar="FILE", show_default=False,
                                                       help="FP16 -> exl2/gptq: calibration data: .txt, .jsonl "
                                                       "(\"text\" field), or token ids (.npy, .safetensors "
                                                       "input_ids, .json). Default: the built-in set (shipped text "
                                                       "plus seeded random-token rows).")] = None,
    rows: Annotated[Optional[int], typer.Option("--rows", show_default=False, help="Calibration rows (default 100 "
                                                "on CUDA, 32 on CPU).")] = None,
    length: Annotated[Optional[int], typer.Option("--length", show_default=False, help="Tokens per calibration "
                                                  "row (default 2048 on CUDA, 512 on CPU).")] = None,
    measurement: Annotated[Optional[str], typer.Option("--measurement", metavar="FILE", show_default=False,
                                                       help="FP16 -> exl2: reuse a measurement.json (ours or "
                                                       "ExLlamaV2's) and skip the measurement pass.")] = None,
    save_measurement: Annotated[Optional[str], typer.Option("--save-measurement", metavar="FILE",
                                                            show_default=False, help="FP16 -> exl2: also write "
                                                            "the measurement (ExLlamaV2's measurement.json "
                                                            "layout) to FILE, outside SRC and DST; an existing "
                                                            "measurement.json is replaced only with --force.")
                          ] = None,
    batch_tokens: Annotated[Optional[int], typer.Option("--batch-tokens", metavar="N", show_default=False,
                                                        help="FP16 -> exl2/gptq: calibration tokens per forward "
                                                        "batch, in whole rows (at least one). Default: 8192 on "
                                                        "CUDA; on the CPU the rows whose widest float32 activation "
                                                        "fits 24 MiB (a 1B model at 512-token rows: 2 rows). More "
                                                        "tokens per batch cost memory; a different split changes "
                                                        "only the rounding of sums over tokens.")] = None,
    measure_rows: Annotated[Optional[str], typer.Option("--measure-rows", metavar="N|all", show_default=False,
                                                        help="FP16 -> exl2: calibration rows that score the "
                                                        "measurement's candidates (evenly spaced; ExLlamaV2's -mr). "
                                                        "Default: a quarter of --rows, at least 2048 tokens' worth "
                                                        "(8 of the CPU default 32). Hessians and reference outputs "
                                                        "always use every row.")] = None,
    measure_search: Annotated[Optional[str], typer.Option("--measure-search", metavar="bracket|full",
                                                          show_default=False, help="FP16 -> exl2: how the "
                                                          "measurement's candidates search each group's scale: "
                                                          "bracket (default: 27 of ExLlamaV2's 97 multipliers, "
                                                          "around the coarse best) or full (all 97). The quantize "
                                                          "pass always searches all 97.")] = None,
    measure_precision: Annotated[Optional[str], typer.Option("--measure-precision", metavar="auto|bf16|fp32",
                                                             show_default=False, help="FP16 -> exl2: how the "
                                                             "measurement multiplies candidates when it scores "
                                                             "options: bf16 (each candidate's difference from the "
                                                             "original layer, in bf16, added to the recorded fp32 "
                                                             "output), fp32, or auto (default: bf16 where bf16 "
                                                             "products are fast: AMX/AVX512-BF16 CPUs, CUDA).")
                         ] = None,
    device: Annotated[Optional[str], typer.Option("--device", show_default=False, help="FP16 -> exl2/gptq: cpu "
                                                  "or cuda[:i] (default: cuda if torch sees one). With --workers "
                                                  "/ --ray-address: each worker's device (cuda: one GPU per "
                                                  "worker).")] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", metavar="N", show_default=False,
                                                   help="FP16 -> exl2/gptq: run the EXL2 measurement and the "
                                                   "quantize pass's independent groups (the experts of a MoE "
                                                   "block; q/k/v, gate/up) on N worker processes of a local Ray "
                                                   "cluster (pip install 'exl2fmt[distributed]'); with "
                                                   "--ray-address at most N tasks at once on that cluster. The "
                                                   "output is byte-identical to the run without it (each worker "
                                                   "uses this process's torch/Numba thread counts: set "
                                                   "OMP_NUM_THREADS / NUMBA_NUM_THREADS to choose them).")] = None,
    ray_address: Annotated[Optional[str], typer.Option("--ray-address", metavar="HOST:PORT", show_default=False,
                                                       help="FP16 -> exl2/gptq: use the running Ray cluster "
                                                       "whose head is HOST:PORT (`ray start --head` on it). "
                                                       "Default: one task per CPU (per GPU with --device cuda) "
                                                       "of the cluster.")] = None,
    shared_fs: Annotated[Optional[bool], typer.Option("--shared-fs/--no-shared-fs", show_default=False,
                                                      help="With --workers / --ray-address: whether the workers "
                                                      "can read SRC at the same path (a shared filesystem; the "
                                                      "default, not detected). --no-shared-fs: they never open "
                                                      "it; this process reads each layer's tensors and ships "
                                                      "them through Ray's object store (the quantize pass "
                                                      "always ships its weights that way).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="FP16 -> exl2/gptq: seed of the built-in calibration "
                                      "set; same inputs and seed give byte-identical output.")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="FP16 -> exl2/gptq: continue an interrupted run from "
                                         "its work directory (.DST.exl2fmt-work next to DST, or --work-dir).")] = False,
    work_dir: Annotated[Optional[str], typer.Option("--work-dir", metavar="DIR", show_default=False, help="FP16 -> exl2/gptq: "
                                                     "the directory in which the work directory "
                                                     ".DST.exl2fmt-work (checkpoints, per-layer files, the "
                                                     "measurement's candidates) is made (default: next to DST); "
                                                     "outside SRC and DST. Only that work directory is removed "
                                                     "after success, never DIR.")] = None,
    act_order: Annotated[Optional[bool], typer.Option("--act-order/--no-act-order", show_default=False,
                                                      help="FP16 -> exl2/gptq: --act-order = --order act, "
                                                      "--no-act-order = --order natural.")] = None,
    order: Annotated[Optional[str], typer.Option("--order", metavar="act|group|static|natural", show_default=False,
                                                 help="FP16 -> exl2/gptq: input-feature order of the GPTQ sweep. "
                                                 "act: by decreasing Hessian diagonal (GPTQ: desc_act, "
                                                 "non-monotone g_idx). GPTQ only, g_idx stays monotone "
                                                 "(desc_act false, as vLLM's Marlin kernels want): static = "
                                                 "act-order over groups of consecutive features; group = "
                                                 "whole groups, most important first, act-order inside each "
                                                 "(GPTQModel's default). natural: no reordering. Default: act "
                                                 "for exl2, static for gptq. EXL2 -> gptq: static|group|natural "
                                                 "re-quantizes the decoded weights (calibrated, desc_act false, "
                                                 "as vLLM needs) instead of the exact act-order re-pack.")] = None,
    upstream_tables: Annotated[bool, typer.Option("--upstream-tables", help="FP16 -> exl2: choose only among "
                                                  "ExLlamaV2's own candidate settings (default: also exl2fmt's "
                                                  "extra rows; see bench/RESULTS.md).")] = False,
    block_gains: Annotated[bool, typer.Option("--block-gains", help="FP16 -> exl2 (experimental): weight each "
                                              "block's measured error by how much it grows on the way to the "
                                              "model's output before the solver adds them up (each block "
                                              "perturbed by its own measured candidate near 3 bpw and carried to "
                                              "the output on 2 calibration rows; stored in the measurement). "
                                              "Helps models whose early layers' errors are amplified (Gemma 3); "
                                              "default: the errors as measured (ExLlamaV2's objective); "
                                              "bench/RESULTS.md, issue 40.")
                   ] = False,
    refine_scales: Annotated[Optional[bool], typer.Option("--refine-scales/--upstream-scales", show_default=False,
                                                          help="FP16 -> exl2: after ExLlamaV2's scale search, move "
                                                          "each column's 4-bit scale code to the neighbour with the "
                                                          "smallest squared error. Default: on in weight-only mode "
                                                          "(round-to-nearest), off with calibration, where it "
                                                          "measurably hurts (bench/RESULTS.md).")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", show_default=False, help="--to gptq: rows "
                                                      "per group, -1 = one group (default: the largest of 128/64/32 "
                                                      "that splits every EXL2 group, so the result stays exact). "
                                                      "--to exl2: a multiple of 32 (default: the GPTQ group "
                                                      "size).")] = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--asym", show_default=False, help="--to gptq: symmetric "
                                                "(default; Marlin needs it) or asymmetric (v1 zeros clamped to "
                                                ">= 1) for re-quantized groups.")] = None,
    dtype: Annotated[Optional[PlainDtype], typer.Option("--dtype", case_sensitive=False, show_default=False,
                                                        help="--to gptq / exl2: cast the unquantized tensors "
                                                        "(embeddings, norms, dense head) to this dtype (default: "
                                                        "kept as they are).")] = None,
    verify: Annotated[VerifyMode, typer.Option("--verify", case_sensitive=False, help="auto: re-read the output "
                                               "through the reader and validator, match every tensor's bytes "
                                               "against what was produced (checksum), and decode every re-packed "
                                               "(GPTQ / EXL2) layer against the source. full: also decode every "
                                               "dequantized layer again from SRC and compare element by "
                                               "element.")] = VerifyMode.auto,
    gguf_type: Annotated[GgufType, typer.Option("--gguf-type", case_sensitive=False, help="--to gguf: tensor type "
                                                "of the weights. auto: dense keeps its dtype; GPTQ sym <= 4-bit -> "
                                                "q4_0, 8-bit -> q8_0 (exact); EXL2 and other GPTQ: near the source's "
                                                "size, each layer the cheapest K-quant (q2_k..q6_k, q8_0; rows of "
                                                "256k weights) or, for other rows, of iq4_nl/q4_1/q5_0/q5_1/q8_0 with "
                                                "bits per weight >= its own (f16 above), blocks fitted by a scale "
                                                "search, the error per layer reported. f16: exact (about 3-4x an "
                                                "EXL2 4.0's size).")
                         ] = GgufType.auto,
    json_: Annotated[bool, typer.Option("--json", help="Print the conversion report as JSON on stdout.")] = False,
    status_lines: Annotated[bool, typer.Option("--status-lines", help="Report progress as JSON lines on stderr "
                                               "({\"status\", \"done\", \"total\", \"what\", \"elapsed_s\", "
                                               "\"phase\", \"fraction\" of the whole run, \"eta_s\" once stable}, the "
                                               "first at once, at "
                                               "most one a second and one per phase) instead of a progress bar, for "
                                               "bots and pipelines.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an internal error (same as "
                                        "exl2fmt --debug convert, or EXL2FMT_DEBUG=1).")] = False,
) -> None:
    """Convert a model between formats: FP16/BF16 -> EXL2/GPTQ (quantize), EXL2/GPTQ -> FP16/BF16, EXL2 <-> GPTQ,
    EXL2/GPTQ/FP16 -> GGUF, GGUF -> FP16/BF16/EXL2/GPTQ.

    The source format is detected from the tensors. Every conversion plans the whole output first, streams
    layer by layer (peak memory about one layer), writes into a hidden temporary directory next to DST and
    renames it at the end (an interrupted run leaves no DST), re-reads the result through the reader and the
    validator, compares it with the source (bit for bit where the conversion is exact, an error per layer
    where it is not), and prints a summary. SRC is only read.

    * **EXL2 -> fp16/bf16**: ExLlamaV2's fp16 reconstruction bit for bit (bf16: rounded once), `*.weight`
      in nn.Linear orientation with the N / vocab padding removed; quantization_config dropped; tokenizer and
      other files copied (a stale index is not).
    * **GPTQ -> fp16/bf16**: 2/3/4/8 bits, v1/v2 zeros, sym/asym, act-order g_idx, group size -1.
    * **EXL2 -> gptq**: exact where the math allows (groups of <= target bits keep their scale, codes
      shifted; the EXL2 permutation becomes act-order g_idx); wider groups are re-quantized and reported;
      Marlin and vLLM compatibility is stated. vLLM refuses act-order (desc_act): with --order static (or
      group, natural) the decoded EXL2 weights are quantized again by the calibrated GPTQ (desc_act false),
      each layer's weight error against the EXL2 decode reported.
    * **GPTQ -> exl2**: the GPTQ integers kept as far as EXL2's 4-bit scale grid allows; error per layer.
    * **FP16/BF16 -> exl2** (decoder-only models through transformers' modeling code: llama, mistral, qwen2,
      qwen3, gemma, gemma2, cohere, granite, starcoder2, phi3, mixtral, qwen3_moe, ...; MoE experts calibrated
      on their routed tokens, routers kept 16-bit): calibration, measurement of every candidate setting per block, an exact bit budget (--bits = average bpw of the decoder linears, overhead
      included), sequential GPTQ; checkpoints in .DST.exl2fmt-work (--resume). **-> gptq**: same engine.
    * **EXL2 / GPTQ / dense -> gguf** (DST is a .gguf file; llama, mistral, mixtral, granite, qwen2/3 and their
      MoE, gemma 1/2/3, phi3, cohere, starcoder2): names and Q/K rows as
      llama.cpp expects, norms F32, tokenizer and hyper-parameters as metadata; blocks repacked exactly where
      the source's integers fit (--gguf-type), the rest quantized (gguf.quants; under auto and for the
      K-quants / iq4_nl exl2fmt's own block quantizer with a scale search) and reported.
    * **model.gguf -> fp16/bf16**: every type the gguf package decodes; config.json rebuilt from the metadata.

    **Examples**

    * `exl2fmt convert ./Llama-3-8B-exl2-4.0bpw ./Llama-3-8B-fp16 --to fp16`
    * `exl2fmt convert ./model-exl2 ./model-bf16 --to bf16 --shard-size 2GB`
    * `exl2fmt convert ./model-exl2 ./model-gptq --to gptq --bits 4`
    * `exl2fmt convert ./model-exl2 ./model-gptq --to gptq --bits 8 --group-size 32 --force`
    * `exl2fmt convert ./model-exl2 ./model-gptq-static --to gptq --bits 4 --group-size 128 --order static` (for vLLM)
    * `exl2fmt convert ./model-gptq ./model-exl2 --to exl2 --bits 6`
    * `exl2fmt convert ./Llama-fp16 ./Llama-exl2-4.0 --to exl2 --bits 4.0 --head-bits 6 --save-measurement m.json`
    * `exl2fmt convert ./SmolLM2-fp16 ./SmolLM2-exl2-4.0 --to exl2 --bits 4.0` (a tied head: no separate head
      written; `--head-bits 6` adds a quantized one)
    * `exl2fmt convert ./Llama-fp16 ./Llama-exl2-6.0 --to exl2 --bits 6.0 --measurement m.json`
    * `exl2fmt convert ./Llama-fp16 ./Llama-gptq --to gptq --bits 4 --group-size 128 --calibration text.jsonl`
    * `exl2fmt convert ./model-gptq ./model-fp16 --to fp16 --json > report.json`
    * `exl2fmt convert ./Llama-fp16 ./Llama-exl2 --to exl2 --bits 5.0 --status-lines --json 2> status.jsonl`
    * `exl2fmt convert ./model-gptq ./model.gguf --to gguf` · `exl2fmt convert ./model.gguf ./model-fp16 --to fp16`
    * `exl2fmt convert ./Llama-fp16 ./Llama-exl2 --to exl2 --bits 4.0 --workers 4` (the measurement on 4 local
      Ray workers) · `... --ray-address 10.0.0.1:6379 --device cuda` (on a cluster, one GPU per worker)
    * `exl2fmt convert ./Mixtral-fp16 ./Mixtral-gptq --to gptq --bits 4 --workers 8` (the experts' GPTQ on 8
      workers) · `... --ray-address 10.0.0.1:6379 --no-shared-fs` (workers that cannot read SRC)

    **Exit codes**: 0 converted and verified · 1 the source breaks a rule or the output failed verification ·
    2 usage error (unknown pair, an option that does not apply, DST exists without --force, DST inside SRC) ·
    3 unreadable or unsupported source, or a missing optional package (the pip command is named) ·
    4 internal error (the traceback with --debug) · 130 interrupted (the quantizer's progress is kept for --resume).
    """
    from .errors import EXIT_OK, Interrupted, handle_exception, set_debug
    from .output import Output

    if debug:   # also after the command; the root --debug has set it already
        set_debug(True)

    from ..container.partials import SHIELD

    out = Output("json" if json_ else "human")
    given = _given(ctx)
    bar = None
    target = None
    try:
        from ..converters import convert
        from ..converters.options import QUANT_OPTIONS, convert_option, refusal
        from ..errors import ErrorCode, Exl2Error
        from ..outputs import infer_target, name_warning

        if to is None:
            target = infer_target(dst)
            if target is None:
                raise Exl2Error(ErrorCode.USAGE, "name the target with --to fp16|bf16|gptq|exl2|gguf (it can be "
                                "left out only when DST ends in .gguf)")
        else:
            target = to.value
        shard = convert_option("shard_size")   # convert() checks the other options (it always has a shard size)
        if shard.parameter in given and target not in shard.targets:
            raise refusal(shard.key, target)
        # said once the arguments have passed (at the first progress step, or with the report)
        warn = name_warning(dst, target) if out.mode == "human" else None
        # the quantizer's options set on the command line, by their quant= keys (a default is not passed)
        quant = {o.key: (o.from_cli or _same)(ctx.params[o.parameter]) for o in QUANT_OPTIONS if o.parameter in given}
        bar = _progress(out, status_lines, target, measuring=measurement is None, resume=resume, dst=dst,
                        work_dir=work_dir, warn=warn)
        # SIGTERM is Ctrl-C until DST is published; from then on SIGINT / SIGTERM are only noted until the report
        # is out, so a published, verified result always exits 0 (exl2fmt/container/partials.py).  The SIGTERM handler is
        # the outer scope so that the shield, once lowered, restores it and not the other way round.
        with _sigterm_as_interrupt(), SHIELD.held():
            with _jit_notice(out, bar):
                rep = convert(src, dst, target, force=force, shard_size=shard_size, dtype=None if dtype is None else
                              dtype.value, bits=bits, group_size=group_size, sym=sym, progress=bar,
                              verify=verify.value, gguf_type=gguf_type.value, quant=quant)
            _clear(bar)
            if bar.pending_warning():
                out.warn(warn)
            _render(out, rep)
        code = EXIT_OK
    except typer.Exit:
        _clear(bar)
        raise
    except BaseException as e:  # noqa: BLE001 - the command's one exception boundary
        _clear(bar)
        if isinstance(e, SystemExit):
            raise
        code = handle_exception(e, out)
        if isinstance(e, (KeyboardInterrupt, Interrupted)) and target in ("exl2", "gptq") and out.mode == "human":
            _interrupted_note(out, dst, work_dir)
    raise typer.Exit(code or 0)


def _same(v):
    return v


def _given(ctx) -> set[str]:
    """The parameters set on the command line or from the environment (not their defaults)."""
    out = set()
    for name in ctx.params:
        src = ctx.get_parameter_source(name)   # by name: typer may carry its own copy of click's enum
        if getattr(src, "name", None) in ("COMMANDLINE", "ENVIRONMENT"):
            out.add(name)
    return out


def _progress(out, status_lines: bool, target: str, *, measuring: bool, resume: bool, dst: str, work_dir,
              warn: str | None = None):
    """The progress callback: one overall bar on a terminal, JSON lines with --status-lines, plain heartbeat lines
    (``plain_progress``) in a log or a pipe, nothing with --json (but a --resume still says where it resumes, once
    the quantizer starts)."""
    import sys

    from .progress import Bar, Overall, StatusLines, phases_for, plain_progress

    quantizing = target in ("exl2", "gptq")
    overall = Overall(phases_for(target, measuring) if quantizing else [])
    if status_lines:
        draw = StatusLines(f"convert -> {target}", overall)
    elif out.mode != "json" and sys.stderr.isatty():
        draw = Bar(overall, first=f"convert -> {target}: reading the source")
    elif out.mode != "json":                  # a log or a pipe: plain heartbeat lines of the overall fraction
        beat = plain_progress(f"convert -> {target}")

        def draw(done: int, total: int, what: str) -> None:
            f, phase, item = overall.update(done, total, what)
            beat(round(f * 1000), 1000, f"{phase}: {item}" if phase else item)
    else:
        draw = None
    said = {"resume": not (resume and quantizing), "warn": warn is None}

    def cb(done: int, total: int, what: str) -> None:
        if not said["warn"]:
            said["warn"] = True
            if draw is not None and hasattr(draw, "clear"):
                draw.clear()
            out.warn(warn)
        if not said["resume"] and str(what).startswith("calibrate:"):
            said["resume"] = True
            _resume_note(out, dst, work_dir, draw)
        if draw is not None:
            draw(done, total, what)

    cb.draw = draw
    cb.pending_warning = lambda: not said["warn"]
    return cb


def _jit_notice(out, bar):
    """Say once when the Numba codecs are compiled (first run of an install), above the bar."""
    import contextlib

    if out.mode == "json":
        return contextlib.nullcontext()
    from ..jitnote import compile_notice

    def say(msg: str) -> None:
        _clear(bar)
        out.info(msg)

    return compile_notice(say)


def _clear(bar) -> None:
    draw = getattr(bar, "draw", None)
    if draw is not None and hasattr(draw, "clear"):
        draw.clear()


def _resume_note(out, dst, work_dir, draw) -> None:
    from ..quant.workdir import describe, work_root

    root = work_root(dst, work_dir)
    d = describe(root) if root.exists() else None
    msg = f"resuming {d} from {root}" if d else f"nothing to resume in {root}, starting fresh"
    if out.mode == "json":
        return
    if draw is not None and hasattr(draw, "clear"):
        draw.clear()
    out.info(msg)


def _interrupted_note(out, dst, work_dir) -> None:
    """After Ctrl-C / SIGTERM in the quantizer: where its progress is and how to continue or discard it."""
    from ..quant.workdir import describe, work_root

    root = work_root(dst, work_dir)
    d = describe(root) if root.exists() else None
    if d is None:
        out.info("no progress was saved to resume from (the quantizer had not started, or this model is "
                 "quantized weight-only); run the command again to start over")
        return
    out.info(f"progress saved in {root}: interrupted in {d}.")
    out.info("run the same command with --resume to continue from there, or delete that directory to start over")


class _sigterm_as_interrupt:
    """SIGTERM (a job scheduler, `kill`, `timeout`) is handled like Ctrl-C: the KeyboardInterrupt unwinds through
    the converters' cleanup and the interrupt message, then exit 130.  Only when SIGTERM has its default action
    and this is the main thread."""

    def __enter__(self):
        import signal
        import threading

        self.old = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def on_term(signum, frame):
                raise KeyboardInterrupt("SIGTERM")

            self.old = signal.signal(signal.SIGTERM, on_term)
        return self

    def __exit__(self, *exc):
        import signal

        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)
        return False


def _files_lines(out, rep) -> None:
    """What the output holds, listed from the directory itself (so "wrote README.md" only when it is there)."""
    import os

    if getattr(rep, "files_copied", None):
        out.line(f"copied from the source: {', '.join(rep.files_copied)}")
    if getattr(rep, "files_left_out", None):
        out.line(f"not copied (not part of a model): {', '.join(rep.files_left_out)}")
    try:
        names = sorted(n for n in os.listdir(rep.destination) if not n.startswith("."))
    except OSError:
        return
    out.line(f"wrote {rep.destination}: {', '.join(names)}")


def _fmt_err(x) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.3e}")


def _compat_lines(out, compat) -> None:
    if compat:
        out.line(f"GPTQ consumers: {compat.get('summary', '')}")
        for name, v in compat.items():
            if isinstance(v, dict) and not v.get("compatible", True):
                out.line(f"  {name}: not compatible ({'; '.join(v['reasons'])})")


def _render(out, rep) -> None:
    if out.mode == "json":
        out.json(rep.as_dict())
        return
    from ..names import layer_order_key   # layer tables in model order: block 2 before block 10

    if not hasattr(rep, "source_format"):  # the quantizer's report
        for w in rep.warnings:
            out.warn(w)
        werr = any(l.weight_error is not None for l in rep.layers)
        src = rep.options.get("source_format", "dense")
        out.table(f"{src} -> {rep.target}: layers", ["layer", "plan", "bpw", "proxy error"]
                  + (["weight error"] if werr else []),
                  [[l.key, l.plan, f"{l.bpw:.3f}", f"{l.error:.4f}"] + ([_fmt_err(l.weight_error)] if werr else [])
                   for l in sorted(rep.layers, key=lambda l: layer_order_key(l.key))])
        _compat_lines(out, getattr(rep, "compatibility", None))
        _files_lines(out, rep)
        for line in rep.summary_lines():
            out.line(line, "bold")
        return
    for w in rep.warnings:
        out.warn(w)
    rows = [[l.key, " x ".join(map(str, l.shape)), l.source_plan, l.target_plan,
             "exact" if l.exact else "lossy", _fmt_err(l.rel_error if not l.exact else 0),
             _fmt_err(l.max_abs_error if not l.exact else 0), "yes" if l.verified else "no"]
            for l in sorted(rep.layers, key=lambda l: layer_order_key(l.key))]
    out.table(f"{rep.source_format} -> {rep.target}: layers", ["layer", "out x in", "source plan", "target plan",
                                                                 "result", "rel. error", "max abs error", "verified"],
              rows)
    cast = [t for t in rep.tensors if t.source_dtype != t.target_dtype]
    if cast:
        out.table("cast tensors", ["tensor", "from", "to", "exact", "max abs error"],
                  [[t.name, t.source_dtype, t.target_dtype, "yes" if t.exact else "no", _fmt_err(t.max_abs_error)]
                   for t in cast])
    for c in rep.config_changes:
        out.line(f"config.json: {c}")
    _compat_lines(out, rep.compatibility)
    if rep.files_copied:
        out.line(f"copied: {', '.join(rep.files_copied)}")
    out.line(f"wrote {rep.destination}: {', '.join(rep.files_written)}")
    for line in rep.summary_lines():
        out.line(line, "bold")
