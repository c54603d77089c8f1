"""``exl2fmt generate``: text from a model directory through transformers (``exl2fmt.runtime``).

``generate_command`` is a plain typer-compatible function, registered by ``cli/commands.py`` with
``app.command("generate")(generate_command)``; torch and transformers are imported inside the command body only,
so registering it costs nothing at CLI start-up (and the typer-free ``inspect`` / ``validate`` path never sees it).

Human mode streams the new text to stdout as it comes (whole characters; control characters other than newline and
tab shown escaped) and ends with one line of counts and speeds on stderr.  ``--json`` prints nothing until the end,
then one object (``$defs/generate`` of spec/inspect.schema.json); errors as the usual error document.  Ctrl-C stops
the loop: the text so far is kept (printed, or in the JSON with ``"stop": "interrupted"``), a note goes to stderr,
and the exit code is 130.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["generate_command", "Dtype", "GENERATE_HELP_EXAMPLES"]


class Dtype(str, enum.Enum):
    auto = "auto"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


GENERATE_HELP_EXAMPLES = """
    **Examples**

    * `exl2fmt generate ./Llama-3-8B-exl2-4.0bpw --prompt "The capital of France is"`
    * `exl2fmt generate ./SmolLM2-135M-Instruct --chat --prompt "Write a haiku about rain."`
    * `exl2fmt generate ./model --prompt "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 1`
    * `exl2fmt generate ./model --prompt "Hello" --max-new-tokens 128 --ignore-eos --json | jq .tokens_per_s`
    * `exl2fmt generate ./model --prompt "Hello" --device cuda --dtype bfloat16`
"""


def generate_command(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A local model directory (config.json, "
                                         ".safetensors weights, tokenizer files): EXL2, GPTQ, EXL3 or dense.",
                                         show_default=False)],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The text to continue (with --chat: the user's "
                                        "message).", show_default=False)],
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt as one user turn in the tokenizer's chat "
                                       "template (an error when the tokenizer has none).")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", metavar="N",
                                                help="Stop after N new tokens.")] = 128,
    temperature: Annotated[Optional[float], typer.Option("--temperature", metavar="T", help="Sampling temperature; 0 = "
                                               "greedy (the default, unless --top-k / --top-p are given: then "
                                               "1.0).", show_default=False)] = None,
    top_k: Annotated[int, typer.Option("--top-k", metavar="K", help="Sample from the K most likely tokens "
                                       "(0 = off; implies sampling).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", metavar="P", help="Sample from the smallest set of tokens "
                                         "whose probability reaches P (1 = off; implies sampling).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of the sampler: the same seed, model, "
                                                "device and options give the same text.",
                                                show_default=False)] = None,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", metavar="R", help="Divide the "
                                                      "logits of tokens already seen by R (CTRL rule; 1 = off).")] = 1.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Give end-of-sequence tokens no probability: "
                                             "always --max-new-tokens new tokens (benchmarks).")] = False,
    device: Annotated[Optional[str], typer.Option("--device", metavar="cpu|cuda[:N]|...", help="Where the model "
                                                  "runs (default: the loader's choice).", show_default=False)] = None,
    dtype: Annotated[Dtype, typer.Option("--dtype", case_sensitive=False, help="Compute dtype of the model (auto: "
                                         "the checkpoint's).")] = Dtype.auto,
    json_: Annotated[bool, typer.Option("--json", help="One JSON object at the end (text, token counts, timings, "
                                        "tokens/s) and nothing else on stdout.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an internal error (same as "
                                        "exl2fmt --debug generate, or EXL2FMT_DEBUG=1).")] = False,
) -> None:
    """Generate text with a model: streamed as it comes, greedy by default, KV-cached; tokens/s at the end.

    Loads the model with `exl2fmt.load_model` (EXL2, GPTQ and EXL3 packed, dense as they are) and its tokenizer, runs
    the prompt once (prefill), then one token at a time until an end-of-sequence token, `--max-new-tokens` or the
    model's context length.  The last line (stderr) reports prefill and decode speed separately.  Ctrl-C stops
    cleanly: the text so far stays, exit code 130.

    **Exit codes**: 0 done · 2 usage error (bad option, --chat without a chat template) · 3 unreadable model (no
    directory, no tokenizer, an architecture transformers cannot load) · 4 internal error · 130 interrupted.
    """
    from .checks import make_output, run_body
    from .errors import set_debug

    if debug:
        set_debug(True)
    out = make_output(json_)

    def body():
        return _generate(out, model, prompt, chat=chat, dtype=dtype.value, device=device,
                         options=dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                      seed=seed, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos))

    raise typer.Exit(run_body(out, body, debug=debug))


generate_command.__doc__ += GENERATE_HELP_EXAMPLES


def _options(o: dict):
    from ..runtime.generate import GenerationOptions

    if o["temperature"] is None:
        o["temperature"] = 1.0 if (o["top_k"] or o["top_p"] != 1.0) else 0.0
    return GenerationOptions(**o).check()


def _model_dir(path: str) -> Path:
    """The model directory, checked before anything heavy is imported."""
    from ..errors import ErrorCode, Exl2Error

    if path.startswith("hf://"):
        raise Exl2Error(ErrorCode.USAGE, "generate runs a local model directory; download the hf:// model first "
                        "(e.g. hf download ORG/REPO --local-dir DIR)")
    p = Path(path)
    if not p.exists():
        raise Exl2Error(ErrorCode.PATH_NOT_FOUND, "no such model directory", file=path)
    if not p.is_dir():
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, "generate needs a model directory (config.json, weights and "
                        "tokenizer files), not a single file", file=path)
    if not (p / "config.json").is_file():
        raise Exl2Error(ErrorCode.CONFIG_MISSING, "the model directory has no config.json: transformers cannot "
                        "load it", file=path)
    return p


def _torch_args(device: str | None, dtype: str):
    import torch

    from ..errors import ErrorCode, Exl2Error

    dt = None if dtype == "auto" else getattr(torch, dtype)
    if device is None:
        return None, dt
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise Exl2Error(ErrorCode.USAGE, f"--device: {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") \
            from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise Exl2Error(ErrorCode.USAGE, f"--device {device}: torch sees no CUDA device here (try --device cpu)")
    return dev, dt


#: files of which a model directory needs one for AutoTokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")


def _tokenizer(p: Path):
    from ..errors import ErrorCode, Exl2Error
    from ..runtime import load_tokenizer

    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise Exl2Error(ErrorCode.TOKENIZER_MISSING, "no tokenizer files in the model directory (one of "
                        f"{', '.join(TOKENIZER_FILES)}); copy them from the original model", file=str(p))
    try:
        tok = load_tokenizer(p)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as e:
        why = " ".join(str(e).split())
        raise Exl2Error(ErrorCode.TOKENIZER_MISSING, f"the tokenizer does not load: {type(e).__name__}"
                        + (f": {why[:300]}" if why else ""), file=str(p)) from None
    if tok is None or isinstance(tok, bool):
        raise Exl2Error(ErrorCode.TOKENIZER_MISSING, "no tokenizer files (tokenizer.json, or tokenizer.model with "
                        "tokenizer_config.json)", file=str(p))
    return tok


def _load(p: Path, device, dt, quiet: bool):
    """``quiet``: transformers' own "Loading weights" bar is turned off (``--json``, or stderr not a terminal,
    where a bar redrawn with carriage returns is one long garbled log line)."""
    from ..errors import ErrorCode, Exl2Error
    from ..runtime import load_model

    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return load_model(p, device=device, dtype=dt)
    except (ValueError, KeyError) as e:
        raise Exl2Error(ErrorCode.ARCH_UNSUPPORTED, f"transformers cannot load this model: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}", file=str(p)) from None


def _safe(piece: str) -> str:
    """Model text for a terminal: control characters other than newline and tab shown escaped."""
    if piece.isprintable():
        return piece
    from ..errors import escape_name

    return "".join(ch if ch in "\n\t" or ch.isprintable() else escape_name(ch) for ch in piece)


def _generate(out, path: str, prompt: str, *, chat: bool, dtype: str, device: str | None, options: dict) -> int:
    import time

    from .errors import EXIT_INTERRUPTED, EXIT_OK, Interrupted

    opts = _options(options)
    p = _model_dir(path)
    dev, dt = _torch_args(device, dtype)
    tok = _tokenizer(p)
    from ..runtime.generate import Generation, chat_prompt, encode_prompt

    ids = chat_prompt(tok, prompt) if chat else encode_prompt(tok, prompt)
    t0 = time.perf_counter()
    import sys

    model = _load(p, dev, dt, quiet=out.mode == "json" or not sys.stderr.isatty())
    load_s = time.perf_counter() - t0
    gen = Generation(model, tok, ids, opts)
    gen.timings.load_s = round(load_s, 6)
    human = out.mode != "json"
    code = EXIT_OK
    try:
        for piece in gen:
            if human:
                sys.stdout.write(_safe(piece))
                sys.stdout.flush()
    except (KeyboardInterrupt, Interrupted):
        rest = gen.interrupted()
        if human and rest:
            sys.stdout.write(_safe(rest))
        code = EXIT_INTERRUPTED
    doc = gen.summary()
    param = next(model.parameters(), None)
    if human:
        if gen.text and not gen.text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        if code == EXIT_INTERRUPTED:
            out.warn(f"interrupted: stopped after {doc['tokens']['generated']} new tokens (the text so far is "
                     "above)")
        out.info(_speed_line(doc))
    else:
        from .. import __version__
        from ..inspect import SCHEMA_VERSION

        out.json({"report": "generate", "schema_version": SCHEMA_VERSION,
                  "tool": {"name": "exl2fmt", "version": __version__}, "path": str(path), "prompt": prompt,
                  "chat": chat, **doc,
                  "device": None if param is None else str(param.device),
                  "dtype": None if param is None else str(param.dtype).replace("torch.", ""),
                  "exit_code": code})
    return code


def _speed_line(doc: dict) -> str:
    t, n, tps = doc["timings"], doc["tokens"], doc["tokens_per_s"]

    def rate(v):
        return "-" if v is None else f"{v:,.1f} tok/s"

    return (f"prompt {n['prompt']} tokens: prefill {t['prefill_s']:.3f} s, {rate(tps['prefill'])} · "
            f"{n['generated']} new tokens: decode {t['decode_s']:.3f} s, {rate(tps['decode'])} · "
            f"stop: {doc['stop']} · load {t['load_s']:.1f} s")
