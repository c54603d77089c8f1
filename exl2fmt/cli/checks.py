"""The ``inspect`` and ``validate`` commands without typer: their bodies, option checks and output.

``exl2fmt.cli.app.main`` runs a plain ``inspect`` / ``validate`` command line through these functions directly
(typer's import and command tree cost more than inspecting a 70B model's headers: bench/RESULTS.md, issue 18);
the typer commands in ``exl2fmt.cli.commands`` call the same functions, so both routes print the same bytes and
return the same exit code.  Each ``*_command`` takes the parsed options and returns the exit code; nothing here
exits the process.
"""

from __future__ import annotations

from .errors import EXIT_OK, EXIT_USAGE, handle_exception

__all__ = ["make_output", "run_body", "inspect_command", "validate_command", "parse_ids", "kernel_table"]


def make_output(json_: bool = False, markdown: bool = False):
    """The output sink for the mode the flags choose; None (after printing the usage error) for both flags."""
    from .output import Output

    if json_ and markdown:
        out = Output("human")
        out.error("USAGE", "--json and --markdown exclude each other", category="usage", exit_code=EXIT_USAGE)
        return None
    return Output("json" if json_ else "markdown" if markdown else "human")


def run_body(out, body, debug: bool = False, passthrough: tuple = ()) -> int:
    """Run a command body and return its exit code; every exception becomes a message and an exit code
    (``exl2fmt.cli.errors``), except ``SystemExit`` and the ``passthrough`` types, which propagate."""
    try:
        code = body()
    except BaseException as e:  # noqa: BLE001 - this is the CLI's one exception boundary
        if isinstance(e, (SystemExit, *passthrough)):
            raise
        code = handle_exception(e, out, debug=debug)
    return code or 0


def _not_hub(path: str) -> str:
    from ..errors import ErrorCode, Exl2Error

    raise Exl2Error(ErrorCode.USAGE, f"--revision applies to hf://ORG/REPO paths only, not {path!r}")


# ------------------------------------------------------------------------------------------------ inspect


def inspect_command(path: str, json_: bool = False, markdown: bool = False, layers: bool = True,
                    revision: str | None = None, *, debug: bool = False) -> int:
    """``exl2fmt inspect``: the report of ``inspect_model`` (or ``inspect_hub`` for hf:// paths)."""
    out = make_output(json_, markdown)
    if out is None:
        return EXIT_USAGE

    def body():
        if path.startswith("hf://") or revision is not None:
            from ..hub import inspect_hub

            rep = inspect_hub(path if path.startswith("hf://") else _not_hub(path), revision=revision, layers=layers)
        else:
            from ..inspect import inspect_model

            rep = inspect_model(path, layers=layers)
        out.inspect_report(rep, show_layers=layers)
        return EXIT_OK

    return run_body(out, body, debug)


# ------------------------------------------------------------------------------------------------ validate


def validate_command(path: str, deep: bool = False, reference: str | None = None, fix_index: bool = False,
                     strict: bool = False, kernel: bool = False, run: bool = False, prompt_ids: str | None = None,
                     device: str | None = None, kernel_m: list[int] | None = None, json_: bool = False,
                     markdown: bool = False, fmt: str | None = None, revision: str | None = None, *,
                     debug: bool = False) -> int:
    """``exl2fmt validate``: every check, in the format the options choose (see the typer command's help)."""
    from .ci_formats import CiErrorOutput, FORMATS

    if fmt is not None and fmt not in FORMATS:
        make_output().error("USAGE", f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}", category="usage",
                            exit_code=EXIT_USAGE)
        return EXIT_USAGE
    if fmt is not None and (json_ or markdown) and fmt != ("json" if json_ else "markdown"):
        make_output().error("USAGE", "--format contradicts --json / --markdown", category="usage",
                            exit_code=EXIT_USAGE)
        return EXIT_USAGE
    ci = fmt if fmt in ("junit", "github") else None
    out = CiErrorOutput(ci) if ci else make_output(json_ or fmt == "json", markdown or fmt == "markdown")
    if out is None:
        return EXIT_USAGE
    hub_path = path.startswith("hf://")
    hub_ref = reference is not None and reference.startswith("hf://")

    def body():
        from ..validate import fix_index as write_index
        from ..validate import validate_model

        from ..errors import ErrorCode, Exl2Error

        ks = None
        ids = parse_ids(prompt_ids) if prompt_ids is not None else None
        if ids is not None and not run:
            raise Exl2Error(ErrorCode.USAGE, "--prompt-ids only applies with --run")
        if kernel_m and not kernel:
            raise Exl2Error(ErrorCode.USAGE, "--kernel-m only applies with --kernel")
        if revision is not None and not hub_path and not hub_ref:
            raise Exl2Error(ErrorCode.USAGE, "--revision applies to hf://ORG/REPO paths only")
        if hub_path and (deep or reference or fix_index or kernel or run):
            raise Exl2Error(ErrorCode.USAGE, "an hf:// model gets the structural checks only (headers by range); "
                            "--deep, --reference, --fix-index, --kernel and --run need a local copy")
        if hub_path:
            from ..validate.remote import validate_hub

            doc, code = validate_hub(path, revision=revision, strict=strict)
            _validate_out(out, ci, doc)
            return code
        if kernel or run:  # before anything else: torch/triton load first (interpreter mode) and fail fast
            ks = _load_kernels(out, device, kernel_m, "--kernel" if kernel else "--run")
        elif device is not None:
            raise Exl2Error(ErrorCode.USAGE, "--device only applies with --kernel or --run")
        written = None
        if fix_index:
            written = write_index(path)
            if out.mode == "human":
                out.info(f"wrote {written['path']}: {written['tensors']} tensors in {written['shards']} shard(s), "
                         f"total_size {written['total_size']}")
        what = ("validate --kernel" if kernel else "validate --run" if run else "validate --deep"
                if reference is None or hub_ref else "validate --reference")
        with out.progress(what) as cb, _jit_notice(out, deep or (reference is not None and not hub_ref)
                                                   or kernel or run):
            rep = validate_model(path, deep=deep, reference=None if hub_ref else reference, strict=strict,
                                 progress=cb, kernel=kernel, device=None if ks is None else ks.device,
                                 kernel_ms=tuple(kernel_m) if kernel_m else None, run=run, prompt_ids=ids)
        hub_info = None
        if hub_ref:  # shapes and config against the Hub source, from its headers alone
            from ..validate.remote import reference_shape_checks

            hub_info = reference_shape_checks(rep, path, reference, revision=revision)
            rep.reference = reference
            rep.apply_strict()
        rep.index_written = written
        if kernel:
            kernel_table(out, rep.as_dict())
        doc = rep.as_dict()
        if hub_info is not None:
            doc["hub"] = hub_info
            doc["exit_code"] = rep.exit_code
        _validate_out(out, ci, doc)
        return rep.exit_code

    return run_body(out, body, debug)


def _jit_notice(out, uses_codecs: bool):
    """"compiling kernels, once per install..." on stderr when the Numba codecs are compiled (not when they load
    from the cache); nothing when the command does not use them (structural validate never imports numba)."""
    import contextlib

    if not uses_codecs or out.mode == "json":
        return contextlib.nullcontext()
    from ..jitnote import compile_notice

    return compile_notice(out.info)


def _validate_out(out, ci, doc: dict) -> None:
    """The validate report in the chosen format (junit / github through ci_formats, else the output sink)."""
    hub = doc.get("hub")
    if hub and out.mode == "human":
        out.info(f"hub: read {hub['bytes_fetched']:,} of {hub['model_bytes']:,} bytes ({hub['requests']} requests) "
                 f"from {hub['repo']}@{hub['revision']} (commit {str(hub['commit'])[:12]})")
    if ci:
        from .ci_formats import emit

        emit(ci, doc)
    else:
        out.validate_report(doc)


def _load_kernels(out, device, kernel_m, what="--kernel"):
    """validate --kernel / --run: load the Triton kernels (exit 3 with a one-line reason when torch, triton or the
    device is missing) and say when they run in the CPU interpreter."""
    from ..validate import check_ms, load_kernels

    if kernel_m:
        check_ms(tuple(kernel_m))
    ks = load_kernels(device, what)
    if ks.interpreted and out.mode != "json":
        out.info(f"note: {what} on cpu runs the Triton kernels in Triton's CPU interpreter: slow (seconds per "
                 "layer), meant for small models; a CUDA device runs them compiled")
    return ks


def parse_ids(text: str) -> list[int]:
    """--prompt-ids "1,2,3" (commas and/or spaces) -> [1, 2, 3]; USAGE for anything else.  The vocabulary range
    is checked against config.json by validate."""
    from ..errors import ErrorCode, Exl2Error

    parts = [p for p in text.replace(",", " ").split()]
    if not parts:
        raise Exl2Error(ErrorCode.USAGE, "--prompt-ids: give comma-separated token ids, e.g. 1,15043,3186")
    out = []
    for p in parts:
        try:
            v = int(p, 10)
        except ValueError:
            raise Exl2Error(ErrorCode.USAGE, f"--prompt-ids: {p!r} is not an integer token id") from None
        out.append(v)
    return out


def kernel_table(out, rep: dict) -> None:
    """Per-layer kernel results as a plain table (human mode; JSON carries them in layers[].kernel)."""
    rows_in = [l for l in rep["layers"] if l.get("kernel")]
    if not rows_in:
        return
    cols: list[tuple[int, str]] = []
    for l in rows_in:
        for r in l["kernel"]["results"]:
            if (r["M"], r["path"]) not in cols:
                cols.append((r["M"], r["path"]))
    rows = []
    for l in rows_in:
        k = l["kernel"]
        cells = {(r["M"], r["path"]): r for r in k["results"]}
        row = [l["key"], " x ".join(str(x) for x in l["shape"] or []),
               "bit-exact" if k["dequant_exact"] else f"DIFFERS ({k['mismatches']})"]
        for c in cols:
            r = cells.get(c)
            if r is None:
                row.append("-")
                continue
            rel = "not finite" if r["max_rel_err"] is None else f"{r['max_rel_err']:.2e}"
            row.append(rel if r["within_bound"] else f"{rel} OUT ({r['outside']})")
        ok = k["dequant_exact"] and all(r["within_bound"] for r in k["results"])
        row.append("ok" if ok else "FAIL")
        rows.append(row)
    kd = rep.get("kernel") or {}
    where = f"{kd.get('device')}" + (", Triton interpreter" if kd.get("interpreter") else "")
    out.table(f"Triton kernels vs reference ({where}; max relative error of y = x @ W per M and path, x fp16 "
              f"unit-normal, seed {kd.get('seed')})",
              ["layer", "out x in", "dequantize", *[f"M={m} {p}" for m, p in cols], ""], rows)
