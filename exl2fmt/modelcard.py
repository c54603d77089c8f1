"""Model cards for quantized outputs, and which of the source's files a quantized output carries.

A quantized model directory gets its own ``README.md`` (Hugging Face model-card conventions: YAML front matter,
then markdown): ``base_model`` with ``base_model_relation: quantized``, ``quantized_by``, the library that loads
it, tags, the source's license / language, and a ``quantization`` block (tool exl2fmt and its version, format,
bits, head bits, calibration set, the measured calibration perplexity of the source and of the output).  The
body states the same for people and holds the per-layer table that ``exl2fmt inspect --markdown`` prints for
the output.  The source's card is kept below a clearly marked heading ("Original model card"), its front matter
dropped (a card has exactly one), never as the output's own card.

``copy_model_files`` copies only the files a model needs to be used (tokenizer, generation config, chat
template, license and notice files, custom code), not whatever else lies in the source directory (a training
log, notebooks, images); what was left out is returned so the report can say so.

Every file of the source used here (copied, or the source card read) passes ``container.sidefiles``: a regular
file whose real path is inside the source, under its kind's size cap; anything else is skipped with a warning.
A source card that exl2fmt itself generated (the source is an exl2fmt quantization) is not carried as the
"original" card: the original card it kept is (``is_generated_card``, ``original_card``).

``layers_markdown`` is the per-layer table of ``exl2fmt inspect --markdown`` (the CLI renders it with this
function, so the card and the command agree).
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Any

from .errors import ErrorCode, Exl2Error, escape_name

__all__ = ["MODEL_FILES", "copy_model_files", "layers_markdown", "model_card", "write_model_card",
           "split_front_matter", "read_source_card", "is_generated_card", "original_card"]

#: Files a model needs besides its weights and config.json (glob patterns, top level of the source directory).
MODEL_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "*.tiktoken", "sentencepiece*.model",
    "generation_config.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "processor_config.json", "LICENSE", "LICENSE.*", "LICENCE*", "NOTICE", "NOTICE.*", "USE_POLICY.md",
    "configuration_*.py", "modeling_*.py", "tokenization_*.py",
)
CARD_NAME = "README.md"

_MD = str.maketrans({c: "\\" + c for c in "\\`*[]<>|#"})


def _md(s: Any) -> str:
    return escape_name(str(s)).translate(_MD)


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _yn(x) -> str:
    return "-" if x is None else ("yes" if x else "no")


def layers_markdown(layers: list[dict]) -> str:
    """The "Linear layers" table of ``inspect --markdown`` from the report's ``layers`` list."""
    out = ["### Linear layers\n\n| layer | in × out | format | plan | bpw | act-order | bias |\n"
           "|---|---:|---|---|---:|:-:|:-:|\n"]
    for r in layers:
        out.append(f"| {_md(r['key'])} | {r['in_features'] or '?'} × {r['out_features'] or '?'} | "
                   f"{_md(r['format'])} | {_md(r['plan'] or '-')} | {_f(r['bpw'])} | "
                   f"{_yn(r['act_order'])} | {_yn(r['bias'])} |\n")
    return "".join(out)


def _is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in MODEL_FILES)


def copy_model_files(src_dir: str | os.PathLike, out_dir: str | os.PathLike,
                     warnings: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Copy the source's model files (``MODEL_FILES``) into ``out_dir``; returns (copied, left out).  Weights,
    indexes, config.json, quantization side files and the source's README.md (kept inside the new card) are
    neither copied nor listed as left out.  Every file passes the side-file gate (``container.sidefiles``): a
    link out of the source, a FIFO or device, a file over its kind's cap is skipped, and why is appended to
    ``warnings`` (so is a README.md the card will not read)."""
    from .container.sidefiles import CARD_CAP, copy_side_file, side_file_problem, skip_message

    src, out = Path(os.fspath(src_dir)), Path(os.fspath(out_dir))
    copied, left = [], []
    if not src.is_dir():
        return copied, left
    for e in sorted(os.scandir(src), key=lambda e: e.name):
        name = e.name
        if name.startswith("."):
            continue
        if name == CARD_NAME:
            why = side_file_problem(src, src / name, CARD_CAP)
            if why is not None and warnings is not None:
                warnings.append(skip_message(name, why))
            continue
        try:
            is_dir = e.is_dir()
        except OSError:
            is_dir = False
        if is_dir:
            if name not in ("__pycache__",):
                left.append(name + "/")
            continue
        if name in ("config.json", "quantize_config.json", "quant_config.json", "quantization_config.json",
                    "exl2fmt-manifest.json", "measurement.json") \
                or name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack",
                                  ".onnx")) \
                or re.fullmatch(r".*\.(safetensors|bin)\.index\.json", name):
            continue
        if not _is_model_file(name):
            left.append(name)
            continue
        why = copy_side_file(src, src / name, out / name)
        if why is not None:
            if warnings is not None:
                warnings.append(skip_message(name, why))
            continue
        copied.append(name)
    return copied, left


def read_source_card(src_dir: str | os.PathLike, warnings: list[str] | None = None) -> str:
    """The source's README.md through the side-file gate (bounded by ``CARD_CAP``); "" when there is none or it
    may not be read (why appended to ``warnings`` when given)."""
    from .container.sidefiles import CARD_CAP, read_side_text

    d = Path(os.fspath(src_dir))
    return read_side_text(d, d / CARD_NAME, CARD_CAP, warnings) or ""


_GENERATED = (re.compile(r"^quantized_by:[ \t]*\"?exl2fmt[ \"]", re.M), re.compile(r"^[ \t]+tool:[ \t]*exl2fmt[ \t]*$", re.M))
_ORIGINAL_HEADING = "## Original model card"


def is_generated_card(text: str) -> bool:
    """Whether ``text`` is a card exl2fmt wrote for a quantized output (its front matter names exl2fmt as the
    quantizer and as the quantization tool)."""
    front, _ = split_front_matter(text)
    return all(r.search(front) for r in _GENERATED)


def _unwrap(text: str) -> tuple[str, str]:
    """(carried front matter, original body) of a card exl2fmt generated: the source's card it kept under
    "Original model card" (without the note that introduces it), and the license / language entries."""
    front, body = split_front_matter(text)
    i = body.find("\n" + _ORIGINAL_HEADING + "\n")
    orig = ""
    if i >= 0:
        rest = body[i + len(_ORIGINAL_HEADING) + 2:].lstrip("\n")
        if rest.startswith("> The card of the source model"):
            rest = rest.split("\n", 1)[1] if "\n" in rest else ""
        orig = rest.strip()
    return _carried_yaml(front), orig


def original_card(text: str) -> str:
    """The card of the original model rebuilt from a card exl2fmt generated (its license / language front matter
    and the body kept under "Original model card"); "" when it kept neither."""
    carried, body = _unwrap(text)
    if not carried and not body:
        return ""
    return (f"---\n{carried}\n---\n\n" if carried else "") + (body + "\n" if body else "")


def split_front_matter(text: str) -> tuple[str, str]:
    """(YAML front matter without the ``---`` fences, body) of a model card; ("", text) without one."""
    m = re.match(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", text, re.S)
    if not m:
        return "", text
    return m.group(1), text[m.end():]


#: front-matter keys of the source card carried into the output's (they describe the weights' terms of use)
_CARRIED = ("license", "license_name", "license_link", "language", "extra_gated_prompt", "extra_gated_fields")


def _carried_yaml(front: str) -> str:
    """The top-level entries ``_CARRIED`` of a YAML front matter, as text (a key and its indented lines)."""
    out, keep = [], False
    for line in front.splitlines():
        if line and not line[0].isspace() and not line.startswith("-"):
            key = line.split(":", 1)[0].strip()
            keep = key in _CARRIED
        if keep:
            out.append(line)
    return "\n".join(out)


def _yaml_str(s: Any) -> str:
    s = escape_name(str(s))
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _base_model(config: dict | None, src: Path) -> str:
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) and not os.path.exists(name):
        return name                  # a Hub id
    return src.name if src.is_dir() else src.stem


_LOADER = {"exl2": "exllamav2", "gptq": "transformers", "gguf": "gguf"}
_FORMAT = {"exl2": "EXL2", "gptq": "GPTQ", "gguf": "GGUF"}


def model_card(*, fmt: str, src: str | os.PathLike, config: dict | None, version: str, facts: dict,
               inspect_report: dict | None, command: str | None = None, copied: list[str] = (),
               left_out: list[str] = (), note: str | None = None) -> str:
    """The card's text.  ``facts``: ``bits`` (target), ``decoder_bpw``, ``head_bits``, ``head_bpw``,
    ``head_tied`` (no separate head: the embedding serves), ``group_size``, ``calibration`` ({dataset, rows, length} or None for weight-only), ``ppl_source``,
    ``ppl_output``, ``weight_only`` (any may be None)."""
    src_p = Path(os.fspath(src))
    src_dir = src_p if src_p.is_dir() else src_p.parent
    base = _base_model(config, src_p)
    source_card = read_source_card(src_dir)   # gated and bounded; copy_model_files said why when it is not read
    if is_generated_card(source_card):  # the source is itself exl2fmt's output: its card describes that format
        front, body = _unwrap(source_card)
    else:
        front, body = split_front_matter(source_card)
    F = _FORMAT.get(fmt, fmt.upper())
    cal = facts.get("calibration")
    y = ["---", f"base_model: {_yaml_str(base)}", "base_model_relation: quantized",
         f"quantized_by: {_yaml_str('exl2fmt ' + version)}", f"library_name: {_LOADER.get(fmt, fmt)}",
         "tags:", f"- {fmt}", "- quantized", "- exl2fmt"]
    carried = _carried_yaml(front)
    if carried:
        y.append(carried)
    y += ["quantization:", "  tool: exl2fmt", f"  tool_version: {_yaml_str(version)}", f"  format: {fmt}"]
    for k in ("bits", "decoder_bpw", "head_bits", "head_bpw", "group_size"):
        v = facts.get(k)
        if v is not None:
            y.append(f"  {k}: {round(v, 4) if isinstance(v, float) else v}")
    if facts.get("head_tied"):
        y.append("  head: tied to the embedding")
    if cal:
        y += ["  calibration:", f"    dataset: {_yaml_str(cal.get('dataset'))}", f"    rows: {cal.get('rows')}",
              f"    length: {cal.get('length')}"]
    else:
        y.append("  calibration: null")
    if facts.get("ppl_source") is not None or facts.get("ppl_output") is not None:
        y += ["  calibration_perplexity:", f"    source: {_f(facts.get('ppl_source'), 4)}",
              f"    quantized: {_f(facts.get('ppl_output'), 4)}"]
    y.append("---")

    bpw, bits = facts.get("decoder_bpw"), facts.get("bits")
    title = f"# {_md(base)} — {F}" + (f" {bpw:.2f} bpw" if isinstance(bpw, (int, float)) else
                                       f" {bits}-bit" if bits is not None else "")
    lines = [title, "",
             f"{'An' if F in ('EXL2',) else 'A'} {F} quantization of **{_md(base)}**, made with exl2fmt {_md(version)}"
             + (f":\n\n```\n{command}\n```" if command else "."), "",
             "| | |", "|---|---|", f"| format | {F} |"]
    if facts.get("decoder_bpw") is not None:
        tgt = f" (target {facts['bits']})" if facts.get("bits") is not None else ""
        lines.append(f"| decoder linears | {facts['decoder_bpw']:.4f} bits per weight{tgt}, overhead included |")
    elif facts.get("bits") is not None:
        lines.append(f"| bits | {facts['bits']} |")
    if facts.get("group_size") is not None:
        lines.append(f"| group size | {facts['group_size']} |")
    if facts.get("head_bits") is not None or facts.get("head_bpw") is not None:
        hb = facts.get("head_bpw")
        lines.append(f"| LM head | {facts.get('head_bits') or '-'} bits"
                     + (f" ({hb:.3f} bpw)" if hb is not None else "") + " |")
    elif facts.get("head_tied"):
        lines.append("| LM head | tied to the embedding (fp16) |")
    if cal:
        lines.append(f"| calibration | {_md(cal.get('dataset'))}, {cal.get('rows')} rows × {cal.get('length')} "
                     "tokens |")
    elif note is None:
        lines.append("| calibration | none (weight-only: round-to-nearest with the scale search) |")
    a, q = facts.get("ppl_source"), facts.get("ppl_output")
    if a is not None and q is not None:
        lines.append(f"| calibration perplexity | source {a:.3f} → quantized {q:.3f} ({100 * (q / a - 1):+.1f}%) |")
    lines.append("")
    if note:
        lines += [note, ""]
    if a is not None and q is not None:
        lines += ["The perplexity is measured on the calibration rows themselves, so it shows what the quantization "
                  "cost, not how well the model generalises.", ""]
    if inspect_report and inspect_report.get("layers"):
        lines += ["## Layers", "", "As `exl2fmt inspect --markdown` reports them:", "",
                  layers_markdown(inspect_report["layers"])]
    lines += ["## Files", ""]
    if copied:
        lines.append("Copied from the source: " + ", ".join(f"`{_md(c)}`" for c in copied) + ".")
    if left_out:
        lines.append("Not copied (not needed to use the model): " + ", ".join(f"`{_md(c)}`" for c in left_out)
                     + ".")
    lines.append("`exl2fmt-manifest.json` lists every layer's setting and error." if fmt in ("exl2", "gptq")
                 else "")
    lines.append("")
    if body.strip():
        lines += ["---", "", "## Original model card", "",
                  f"> The card of the source model **{_md(base)}**, unchanged below (without its YAML front matter). "
                  f"It describes the original weights, not this {F} quantization.", "", body.strip(), ""]
    return "\n".join(y) + "\n" + "\n".join(lines)


def write_model_card(out_dir: str | os.PathLike, **kw) -> Path:
    """Write ``model_card(**kw)`` to ``out_dir/README.md`` (atomically) and return its path."""
    d = Path(os.fspath(out_dir))
    path = d / CARD_NAME
    tmp = d / f".{CARD_NAME}.tmp"
    try:
        tmp.write_text(model_card(**kw), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot write the model card: {e.strerror or e}", file=str(path)) from None
    return path


def write_quant_card(out_dir, src, config: dict | None, options, report, files: tuple[list[str], list[str]],
                     *, weight_only: bool = False) -> Path:
    """The quantizer's card: facts from its ``QuantOptions`` (resolved) and ``QuantReport``, the per-layer table
    from ``inspect_model(out_dir)``."""
    from . import __version__
    from .inspect import inspect_model

    o = options
    exl2 = o.target == "exl2"
    facts = {"bits": o.bits, "decoder_bpw": report.decoder_bpw,
             "head_bits": o.head_bits if exl2 and not weight_only else None,
             "head_bpw": report.head_bpw if exl2 else None,
             "head_tied": exl2 and not weight_only and o.head_bits is None,
             "group_size": None if exl2 else o.group_size,
             "calibration": None if weight_only else {
                 "dataset": os.path.basename(o.calibration) if o.calibration else "the built-in set",
                 "rows": o.rows, "length": o.length},
             "ppl_source": None if weight_only else report.calibration_ppl_fp16,
             "ppl_output": None if weight_only else report.calibration_ppl}
    # the output's own name is left out: the same inputs give the same card, wherever it is written
    cmd = f"exl2fmt convert {_base_model(config, Path(os.fspath(src)))} OUTPUT --to {o.target} " \
          f"--bits {o.bits}" + (f" --head-bits {o.head_bits}" if exl2 and not weight_only and o.head_bits is not None else "") + \
          (f" --group-size {o.group_size}" if not exl2 else "")
    rep = inspect_model(out_dir)
    return write_model_card(out_dir, fmt=o.target, src=src, config=config, version=__version__, facts=facts,
                            inspect_report=rep, command=cmd, copied=files[0], left_out=files[1])


def write_conversion_card(out_dir, src, config: dict | None, report, left_out: list[str]) -> Path:
    """The card of a re-packed output (EXL2 -> GPTQ, GPTQ -> EXL2): facts from its ``quantization_config`` and
    the conversion report; no calibration (the source's integers are re-packed, not re-calibrated)."""
    from . import __version__
    from .inspect import inspect_model

    qc = report.quantization_config or {}
    rep = inspect_model(out_dir)
    dec = ((rep.get("summary") or {}).get("bpw") or {}).get("decoder")
    fmt = report.target
    facts = {"bits": qc.get("bits"), "decoder_bpw": dec if fmt == "exl2" else None,
             "group_size": qc.get("group_size") if fmt == "gptq" else None, "calibration": None}
    s = report.summary()
    cmd = f"exl2fmt convert {_base_model(config, Path(os.fspath(src)))} OUTPUT --to {fmt}"
    path = write_model_card(out_dir, fmt=fmt, src=src, config=config, version=__version__, facts=facts,
                            inspect_report=rep, command=cmd, copied=report.files_copied, left_out=left_out,
                            note=f"Re-packed from the {report.source_format.upper()} model without calibration: "
                                 f"{s['exact_layers']} of {s['layers']} layers exact, the rest re-quantized "
                                 f"(worst relative error {_f(s['worst_rel_error'], 4)}).")
    return path


def gguf_card_metadata(src, config: dict | None, source_format: str, tensor_type: str) -> list[tuple[str, str, Any]]:
    """A GGUF file's model card: one file has no README.md beside it, so the card's facts go into the ``general.*``
    metadata llama.cpp and the Hub read (``general.base_model.*``, ``general.license``, ``general.tags``,
    ``general.description``).  Returns (key, kind, value) with kind ``str``, ``u32`` or ``strs``."""
    from . import __version__

    src_p = Path(os.fspath(src))
    src_dir = src_p if src_p.is_dir() else src_p.parent
    base = _base_model(config, src_p)
    out: list[tuple[str, str, Any]] = [("general.base_model.count", "u32", 1),
                                       ("general.base_model.0.name", "str", base)]
    card = read_source_card(src_dir)   # gated and bounded (container.sidefiles)
    front = _unwrap(card)[0] if is_generated_card(card) else split_front_matter(card)[0]
    m = re.search(r"^license:[ \t]*['\"]?([^'\"\n#]+?)['\"]?[ \t]*$", front, re.M)
    if m:
        out.append(("general.license", "str", m.group(1).strip()))
    out.append(("general.tags", "strs", ["quantized", "exl2fmt", f"{tensor_type.lower()}"]))
    out.append(("general.description", "str", f"{tensor_type} GGUF of {base}, converted by exl2fmt {__version__} "
                f"from its {source_format} weights"))
    return out
