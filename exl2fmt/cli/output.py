"""The one output sink of the CLI.

``Output(mode)`` renders library results in one of three modes:

* ``human``     rich tables and lines on stdout (colour only on a terminal); warnings and progress on stderr
* ``json``      one JSON document on stdout (``spec/inspect.schema.json``), nothing else on stdout
* ``markdown``  GitHub-flavoured markdown on stdout, for model cards

Every string that comes from a file (tensor names, paths, metadata values, messages that quote them) goes
through ``exl2fmt.errors.escape_name`` before it reaches a terminal, and is wrapped in ``rich.text.Text`` so
that rich never interprets it as markup.  JSON output keeps names exact: ``json.dumps`` with
``ensure_ascii=True`` escapes every control and non-ASCII character itself.  ``escape_name`` also defuses CI
workflow commands (a leading ``::``, any ``##[``); JSON output writes ``##[`` as ``\\u0023#[``, the same value.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Iterator

from ..errors import escape_name, json_ci_defuse

__all__ = ["Output", "human_bytes", "human_count", "md_escape", "dumps_json"]

MODES = ("human", "json", "markdown")

#: human and markdown output print at most this many non-PASS lines per (status, code); the rest of a rule's
#: findings become one "... and M more" line, so a file with 100k broken entries cannot make printing dominate
#: the run.  JSON output keeps every finding (it is for machines and stays complete).
MAX_ISSUES_PER_RULE = 20

_PLAIN_WIDTH = 200  # the console width when stdout is not a terminal


def _capped(items: list, key, more_line) -> list:
    """Items in order with at most MAX_ISSUES_PER_RULE per ``key(item)`` (None = never capped); right after
    the last item shown for a key that has more, ``more_line(key, m)`` stands for the m items left out.
    Linear in len(items)."""
    seen: dict = {}
    left: dict = {}
    shown = []
    for it in items:
        k = key(it)
        if k is not None:
            n = seen.get(k, 0)
            seen[k] = n + 1
            if n == MAX_ISSUES_PER_RULE:
                left[k] = len(shown)
                shown.append(None)
            if n >= MAX_ISSUES_PER_RULE:
                continue
        shown.append(it)
    for k, pos in left.items():
        shown[pos] = more_line(k, seen[k] - MAX_ISSUES_PER_RULE)
    return shown


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{int(x)} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1000
    return f"{n} B"  # pragma: no cover


def human_count(n: int | None) -> str:
    if n is None:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _yn(x) -> str:
    return "-" if x is None else ("yes" if x else "no")


_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*[]<>|#"})


def md_escape(s: Any) -> str:
    """Escape a file-derived string for a markdown table cell: control characters, then markdown syntax."""
    return escape_name(str(s)).translate(_MD_SPECIAL)


class Output:
    """Renders reports; one instance per command invocation."""

    def __init__(self, mode: str = "human"):
        if mode not in MODES:
            raise ValueError(mode)
        self.mode = mode
        self._out = None
        self._err = None
        self._plain = None

    # --- consoles (created lazily: sys.stdout may be replaced by a test runner) ------------------------
    @property
    def console(self):
        if self._out is None:
            tty = sys.stdout.isatty()
            self._out = _console_class()(file=sys.stdout, highlight=False, emoji=False, markup=False,
                                         width=None if tty else _PLAIN_WIDTH, no_color=not tty)
        return self._out

    @property
    def err_console(self):
        if self._err is None:
            from rich.console import Console

            tty = sys.stderr.isatty()
            self._err = Console(file=sys.stderr, highlight=False, emoji=False, markup=False,
                                width=None if tty else 200, no_color=not tty)
        return self._err

    @staticmethod
    def text(s: Any, style: str | None = None):
        from rich.text import Text

        return Text(escape_name("-" if s is None else str(s)), style=style or "")

    def _plain_stdout(self) -> bool:
        """True when rich would write our text to stdout unstyled: stdout is not a terminal and no variable makes
        rich take it for one (``TTY_COMPATIBLE=1``, a non-empty ``FORCE_COLOR``; not under IPython)."""
        if self._plain is None:
            import builtins
            import os

            env = os.environ
            self._plain = (not sys.stdout.isatty() and env.get("TTY_COMPATIBLE", "") != "1"
                           and not env.get("FORCE_COLOR") and not hasattr(builtins, "get_ipython"))
        return self._plain

    def _emit(self, segments: list[tuple[str, str | None]], soft_wrap: bool = True) -> None:
        """``console.print(Text(...), soft_wrap=soft_wrap)`` of the concatenated ``(text, style)`` segments.

        Where rich would write the text unchanged - stdout not a terminal (``_plain_stdout``, no styles then),
        printable ASCII lines, and with ``soft_wrap=False`` none longer than the console's 200 columns - it is
        written here (and flushed, as rich does) without importing rich, which costs more than the rest of
        ``inspect`` of a large model.  tests/test_cli.py compares both writers on generated text."""
        text = "".join(t for t, _ in segments)
        if self._plain_stdout() and text.isascii():
            lines = text.split("\n")
            if all(ln.isprintable() and (soft_wrap or len(ln) <= _PLAIN_WIDTH) for ln in lines):
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
                return
        from rich.text import Text

        if len(segments) == 1:  # one styled text (its base style), as self.text() builds it
            out = Text(segments[0][0], style=segments[0][1] or "")
        else:
            out = Text()
            for t, style in segments:
                out.append(t, style=style)
        self.console.print(out, soft_wrap=soft_wrap)

    def line(self, s: str = "", style: str | None = None) -> None:
        """A plain line on stdout (file-derived parts must already be escaped by the caller or be ours)."""
        if self.mode == "json":
            return
        if self.mode == "markdown":
            sys.stdout.write(s + "\n")
            return
        self._emit([(escape_name("-" if s is None else str(s)), style or "")])

    def warn(self, s: str) -> None:
        self.err_console.print(self.text(f"warning: {s}", "yellow"), soft_wrap=True)

    def info(self, s: str) -> None:
        """A status line on stderr (never mixed into JSON or markdown on stdout)."""
        self.err_console.print(self.text(s, "dim"), soft_wrap=True)

    def json(self, doc: dict) -> None:
        # the same JSON value, with no "##[" a CI runner would take for a workflow command (exl2fmt.errors)
        sys.stdout.write(json_ci_defuse(dumps_json(doc)) + "\n")
        sys.stdout.flush()

    # --- errors -----------------------------------------------------------------------------------------
    def error(self, code: str, message: str, *, file: str | None = None, tensor: str | None = None,
              category: str | None = None, exit_code: int = 1, hint: str | None = None) -> None:
        if self.mode == "json":
            from .. import __version__
            from ..inspect import SCHEMA_VERSION

            self.json({"report": "error", "schema_version": SCHEMA_VERSION,
                       "tool": {"name": "exl2fmt", "version": __version__},
                       "error": {"code": code, "category": category, "message": message, "file": file,
                                 "tensor": tensor}, "exit_code": exit_code})
            return
        where = []
        if file:
            where.append(escape_name(file))
        if tensor is not None:
            where.append(f"tensor {escape_name(tensor)}")
        prefix = ": ".join(where)
        msg = f"error: [{code}] {prefix + ': ' if prefix else ''}{escape_name(message)}"
        self.err_console.print(self.text(msg, "bold red"), soft_wrap=True)
        if hint:
            self.err_console.print(self.text(hint, "dim"), soft_wrap=True)

    # --- progress ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def progress(self, description: str) -> Iterator:
        """A ``progress(done, total, what)`` callback drawing a rich bar on stderr when stderr is a terminal
        (and the mode is not JSON); when stderr is a log or a pipe (CI), plain heartbeat lines
        (``plain_progress``); None in JSON mode."""
        if self.mode == "json":
            yield None
            return
        if not sys.stderr.isatty():
            from .progress import plain_progress

            yield plain_progress(description)
            return
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        # Units differ between callers (bytes for conversions, blocks x options for the quantizer), so the bar
        # shows percent, elapsed time, an ETA and the current item (for the quantizer "phase: layer").
        with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), TextColumn("{task.fields[what]}", markup=False), console=self.err_console,
                      transient=True) as bar:
            task = bar.add_task(description, total=None, what="")

            def update(done: int, total: int, what: str) -> None:
                text = escape_name(str(what))
                bar.update(task, completed=done, total=total or None, what=text if len(text) < 60 else
                           "..." + text[-57:])

            yield update

    @contextlib.contextmanager
    def status_lines(self, description: str, min_interval: float = 1.0) -> Iterator:
        """A ``progress(done, total, what)`` callback writing one JSON object per line to stderr, for bots and
        pipelines: ``{"status": description, "done", "total", "what", "elapsed_s"}``.  At most one line per
        ``min_interval`` seconds, except that a change of ``what``'s phase (the text before ':') and the last
        step are always written."""
        import time

        t0 = time.monotonic()
        last = {"t": -1e9, "phase": None}

        def update(done: int, total: int, what: str) -> None:
            now = time.monotonic()
            phase = str(what).split(":", 1)[0]
            if now - last["t"] < min_interval and phase == last["phase"] and not (total and done >= total):
                return
            last.update(t=now, phase=phase)
            sys.stderr.write(json_ci_defuse(json.dumps({"status": description, "done": int(done),
                                                        "total": int(total or 0), "what": str(what),
                                                        "elapsed_s": round(now - t0, 3)})) + "\n")
            sys.stderr.flush()

        yield update

    # =====================================================================================================
    # inspect
    # =====================================================================================================
    def inspect_report(self, rep: dict, *, show_layers: bool = True) -> None:
        if self.mode == "json":
            self.json(rep)
        elif self.mode == "markdown":
            self._inspect_markdown(rep, show_layers)
        else:
            self._inspect_human(rep, show_layers)

    def _summary_pairs(self, rep: dict) -> list[tuple[str, str]]:
        s = rep["summary"]
        fmt = rep["format"]
        prod = rep["producer"]
        files = rep["files"]
        pairs = [("path", rep["path"])]
        if len(files) == 1:
            pairs.append(("file", f"{files[0]['path']} ({human_bytes(files[0]['bytes'])}, {files[0]['tensors']} tensors)"))
        else:
            pairs.append(("files", f"{len(files)} shards, {human_bytes(s['file_bytes'])}"
                          + (f", index {rep['index']}" if rep.get("index") else ", no index")))
        cfg = fmt.get("config_quant_method")
        fm = fmt["label"]
        if cfg:
            fm += f"  (config: quant_method {cfg})"
        pairs.append(("format", fm))
        if prod.get("name"):
            pairs.append(("producer", f"{prod['name']} {prod.get('version') or ''}".strip()
                          + (f"  (from {prod['source']})" if prod.get("source") else "")))
        arch = s.get("architecture") or "-"
        if s.get("model_type") and s.get("model_type") != arch:
            arch += f" ({s['model_type']})"
        nl = s.get("num_hidden_layers")
        arch += f", {nl if nl is not None else s['blocks']} layers"
        if nl is not None and s["blocks"] and nl != s["blocks"]:
            arch += f" (config) / {s['blocks']} blocks found"
        pairs.append(("architecture", arch))
        by = ", ".join(f"{n} {f}" for f, n in sorted(s["layers_by_format"].items()))
        pairs.append(("linear layers", f"{s['linear_layers']}" + (f" ({by})" if by else "")))
        pairs.append(("parameters", f"{human_count(s['parameters'])} logical weights ({s['parameters']:,})"))
        pairs.append(("stored", f"{human_bytes(s['stored_bytes'])} in {s['tensors']} tensors"))
        b = s["bpw"]
        parts = [f"{k} {_f(b[k], 3)}" for k in ("decoder", "head", "embeddings", "overall") if b.get(k) is not None]
        if s.get("head_tied"):
            parts.insert(1, "head tied to embedding (fp16)")
        if b.get("decoder_incl_16bit") is not None:        # MoE routers stay 16-bit, outside the decoder bpw
            parts.append(f"(decoder with the 16-bit routers {_f(b['decoder_incl_16bit'], 3)})")
        pairs.append(("bits per weight", "  ".join(parts) + "  (overhead included)" if parts else "-"))
        pairs.append(("weight memory", f"~{human_bytes(s['weight_memory_bytes'])} (weights only)"))
        if rep.get("hub"):  # hf:// (exl2fmt.hub): what the range reads cost
            h = rep["hub"]
            pairs.append(("hub", f"{h['repo']}@{h['revision']} (commit {str(h['commit'])[:12]}): read "
                          f"{human_bytes(h['bytes_fetched'])} of {human_bytes(h['model_bytes'])} in {h['requests']} "
                          "requests (headers, config, index, q_groups only)"))
        if rep.get("gguf"):
            g = rep["gguf"]
            pairs.append(("gguf", f"v{g['version']} {g['byte_order']}-endian, {g['kv_count']} keys, "
                          f"{g['tensor_count']} tensors, alignment {g['alignment']}"))
        return pairs

    def _inspect_human(self, rep: dict, show_layers: bool) -> None:
        self.pairs(self._summary_pairs(rep))
        if show_layers and rep["layers"]:
            # plain aligned columns: a 561-row rich Table takes ~0.3 s to lay out, this takes milliseconds
            rows = [[escape_name(r["key"]), f"{r['in_features'] or '?'} x {r['out_features'] or '?'}", r["format"],
                     escape_name(r["plan"] or (r["error"] and "invalid") or "-"), _f(r["bpw"], 3),
                     _yn(r["act_order"]), _yn(r["bias"])] for r in rep["layers"]]
            self.plain_table("Linear layers", ["layer", "in x out", "format", "plan", "bpw", "act-order", "bias"],
                             rows, right={1, 4})
        if rep["blocks"]:
            self.plain_table("Per block", ["block", "layers", "params", "stored", "bpw", "min", "max"],
                             [[escape_name(b["block"]), str(b["layers"]), human_count(b["params"]),
                               human_bytes(b["stored_bytes"]), _f(b["bpw"]), _f(b["bpw_min"]), _f(b["bpw_max"])]
                              for b in rep["blocks"]], right={1, 2, 3, 4, 5, 6})
        for scope in ("decoder", "head"):
            hist = rep["bits_histogram"].get(scope) or []
            if hist:
                self.plain_table(f"Bit widths ({scope} weights)", ["bits", "weights", "share", ""],
                                 [[str(h["bits"]), human_count(h["weights"]), f"{100 * h['fraction']:.1f}%",
                                   "#" * max(1, round(40 * h["fraction"]))] for h in hist], right={0, 1, 2})
        if rep.get("gguf") and rep["gguf"]["types"]:
            self.plain_table("GGUF tensor types", ["type", "tensors", "params", "bytes", "bpw"],
                             [[escape_name(e["type"]), str(e["tensors"]), human_count(e["params"]),
                               human_bytes(e["bytes"]), _f(e["bpw"])] for e in rep["gguf"]["types"]],
                             right={1, 2, 3, 4})
        self._issues_human(rep.get("issues") or [])

    def pairs(self, pairs: list[tuple[str, Any]]) -> None:
        """Key / value lines (values escaped here)."""
        w = max((len(k) for k, _ in pairs), default=0)
        segments = []
        for i, (k, v) in enumerate(pairs):
            segments.append((k.ljust(w + 2), "bold"))
            segments.append((escape_name("-" if v is None else str(v)) + ("\n" if i + 1 < len(pairs) else ""), None))
        self._emit(segments)

    def plain_table(self, title: str, headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> None:
        """Aligned columns without box drawing; cells must already be escaped."""
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

        def fmt(cells):
            return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        self._emit([("\n" + title + "\n", "bold"), (fmt(headers).rstrip() + "\n", "bold"),
                    ("\n".join(fmt(r).rstrip() for r in rows), None)])

    def _issues_human(self, issues: list[dict]) -> None:
        if not issues:
            return
        self._emit([(f"{len(issues)} issue(s) seen while inspecting (run exl2fmt validate for all checks):",
                     "bold yellow")], soft_wrap=False)
        issues = _capped(issues, lambda i: (i["severity"], i["code"]),
                         lambda k, m: {"severity": k[0], "code": k[1],
                                       "message": f"... and {m} more (--json lists all)"})
        for i in issues:
            where = []
            if i.get("file"):
                where.append(i["file"])
            if i.get("tensor") is not None:
                where.append(f"tensor {i['tensor']}")
            sev = "FAIL" if i["severity"] == "error" else "WARN"
            self._emit([(escape_name(f"  {sev} {i['code']}  {': '.join(where) + ': ' if where else ''}"
                                     f"{i['message']}"), "red" if sev == "FAIL" else "yellow")])

    def _inspect_markdown(self, rep: dict, show_layers: bool) -> None:
        w = sys.stdout.write
        name = rep["path"].rstrip("/").rsplit("/", 1)[-1] or rep["path"]
        w(f"## exl2fmt inspect: {md_escape(name)}\n\n| | |\n|---|---|\n")
        for k, v in self._summary_pairs(rep):
            w(f"| {md_escape(k)} | {md_escape(v)} |\n")
        if show_layers and rep["layers"]:
            from ..modelcard import layers_markdown   # the same table a quantized model's card holds

            w("\n" + layers_markdown(rep["layers"]))
        if rep["blocks"]:
            w("\n### Per block\n\n| block | layers | params | stored | bpw | min | max |\n"
              "|---|---:|---:|---:|---:|---:|---:|\n")
            for b in rep["blocks"]:
                w(f"| {md_escape(b['block'])} | {b['layers']} | {human_count(b['params'])} | "
                  f"{human_bytes(b['stored_bytes'])} | {_f(b['bpw'])} | {_f(b['bpw_min'])} | {_f(b['bpw_max'])} |\n")
        for scope in ("decoder", "head"):
            hist = rep["bits_histogram"].get(scope) or []
            if hist:
                w(f"\n### Bit widths ({scope} weights)\n\n| bits | weights | share |\n|---:|---:|---:|\n")
                for h in hist:
                    w(f"| {h['bits']} | {human_count(h['weights'])} | {100 * h['fraction']:.1f}% |\n")
        if rep.get("gguf") and rep["gguf"]["types"]:
            w("\n### GGUF tensor types\n\n| type | tensors | params | bytes | bpw |\n|---|---:|---:|---:|---:|\n")
            for e in rep["gguf"]["types"]:
                w(f"| {md_escape(e['type'])} | {e['tensors']} | {human_count(e['params'])} | "
                  f"{human_bytes(e['bytes'])} | {_f(e['bpw'])} |\n")
        if rep.get("issues"):
            w("\n### Issues\n\n| severity | code | where | message |\n|---|---|---|---|\n")
            shown = _capped(rep["issues"], lambda i: (i["severity"], i["code"]),
                            lambda k, m: {"severity": k[0], "code": k[1], "message": f"... and {m} more (--json "
                                          "lists all)"})
            for i in shown:
                where = " ".join(x for x in (i.get("file"), i.get("tensor")) if x)
                w(f"| {i['severity']} | {i['code']} | {md_escape(where)} | {md_escape(i['message'])} |\n")
        w(f"\n<sub>generated by exl2fmt {rep['tool']['version']} (schema {rep['schema_version']})</sub>\n")

    # =====================================================================================================
    # validate
    # =====================================================================================================
    def validate_report(self, rep: dict) -> None:
        if self.mode == "json":
            self.json(rep)
            return
        md = self.mode == "markdown"
        w = sys.stdout.write
        if md:
            w(f"## exl2fmt validate: {md_escape(rep['path'])}\n\n| status | code | where | message |\n"
              "|---|---|---|---|\n")
        else:
            self._emit([(escape_name(f"exl2fmt validate {rep['path']}" + (" --deep" if rep["deep"] else "")
                                     + (f" --reference {rep['reference']}" if rep["reference"] else "")
                                     + (" --strict" if rep["strict"] else "")), "bold")])
        styles = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
        checks = _capped(rep["checks"], lambda c: None if c["status"] == "PASS" else (c["status"], c["code"]),
                         lambda k, m: {"status": k[0], "code": k[1], "message": f"... and {m} more (--json lists all)"})
        for c in checks:
            where = []
            if c["status"] != "PASS" and c.get("file"):
                where.append(c["file"])
            if c.get("tensor") is not None:
                where.append(f"tensor {c['tensor']}")
            msg = c["message"] + (" [warning escalated by --strict]" if c.get("escalated") else "")
            if md:
                w(f"| {c['status']} | {c['code']} | {md_escape(': '.join(where))} | {md_escape(msg)} |\n")
            else:
                self._emit([(f"{c['status']} ", styles[c["status"]]), (f"{c['code']:<22} ", "bold"),
                            (escape_name(": ".join(where) + ": " if where else ""), None), (escape_name(msg), None)])
        layers = [l for l in rep.get("layers") or [] if l.get("stats")]
        if layers and not md:
            cols = ["layer", "out x in", "mean", "std", "absmax"]
            has_ref = any(l.get("reference") for l in layers)
            if has_ref:
                cols += ["rel err", "max abs", "cosine", "limit", ""]
            rows = []
            for l in layers:
                st = l["stats"]
                row = [escape_name(l["key"]), " x ".join(str(x) for x in l["shape"] or []), f"{st['mean']:+.3e}",
                       f"{st['std']:.3e}", f"{st['absmax']:.3e}"]
                if has_ref:
                    r = l.get("reference")
                    if r:
                        rel = r["rel_fro"]
                        row += ["inf" if rel is None else f"{rel:.4f}", _f(r["max_abs"], 4), _f(r["cosine"], 5),
                                f"{r['threshold']:.4f}", "OVER" if rel is None or rel > r["threshold"] else ""]
                    else:
                        row += ["-"] * 5
                rows.append(row)
            self.plain_table("Dequantized layers", cols, rows, right=set(range(1, len(cols) - 1)))
        n = rep["counts"]
        verdict = (f"RESULT {rep['result']}: {n['pass']} passed, {n['warn']} warning(s), {n['fail']} failed "
                   f"(exit {rep['exit_code']})")
        if md:
            w(f"\n**{verdict}**\n")
        else:
            self._emit([(escape_name(verdict), "bold green" if rep["result"] == "PASS" else "bold red")],
                       soft_wrap=False)

    # =====================================================================================================
    # small results
    # =====================================================================================================
    def kv(self, title: str, pairs: list[tuple[str, Any]]) -> None:
        if self.mode == "json":
            self.json({k: v for k, v in pairs})
            return
        if self.mode == "markdown":
            sys.stdout.write(f"## {md_escape(title)}\n\n| | |\n|---|---|\n")
            for k, v in pairs:
                sys.stdout.write(f"| {md_escape(k)} | {md_escape(v)} |\n")
            return
        self.console.print(self.text(title, "bold"))
        self.pairs(pairs)

    def table(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        if self.mode != "human":
            return
        self.plain_table(title, columns, [[escape_name("-" if x is None else str(x)) for x in r] for r in rows])


def _console_class():
    """rich's Console, except that a closed stdout raises BrokenPipeError (the CLI's exit 141) instead of
    rich's own SystemExit(1), which would look like a failed check."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(32, "Broken pipe")

    return _Console


def dumps_json(doc) -> str:
    """``json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False, default=_json_default)``, byte for byte.

    The standard encoder runs in Python when it indents (its C encoder only writes compact JSON), one generator per
    container; a report of a 70B model (561 layer rows) took longer to print than to read its headers.  Documents
    of plain types (dict with str keys, list, str, int, finite float, bool, None; exact types, no subclasses) are
    written here by appending to one list; anything else - an enum, a tuple, a numpy scalar, a non-str key, NaN,
    nesting too deep - goes to ``json.dumps`` itself, which then decides (value, or its exception).
    tests/test_cli.py compares the two on generated documents and on real reports."""
    parts: list[str] = []
    try:
        _write_json(doc, "\n", parts)
    except (_NotPlain, ValueError, RecursionError):
        return json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False, default=_json_default)
    return "".join(parts)


class _NotPlain(Exception):
    """A value ``dumps_json`` leaves to ``json.dumps``."""


_esc = json.encoder.encode_basestring_ascii
_INF = float("inf")


def _write_json(o, nl: str, parts: list) -> None:
    """Append ``o`` as indented JSON; ``nl`` is a newline plus the indentation of the line ``o`` starts on."""
    t = type(o)
    if t is str:
        parts.append(_esc(o))
    elif o is None:
        parts.append("null")
    elif o is True:
        parts.append("true")
    elif o is False:
        parts.append("false")
    elif t is int:
        parts.append(int.__repr__(o))
    elif t is float:
        if o != o or o == _INF or o == -_INF:
            raise _NotPlain
        parts.append(float.__repr__(o))
    elif t is dict:
        if not o:
            parts.append("{}")
            return
        inner = nl + "  "
        sep = "{" + inner
        for k, v in o.items():
            if type(k) is not str:
                raise _NotPlain
            parts.append(sep)
            parts.append(_esc(k))
            parts.append(": ")
            _write_json(v, inner, parts)
            sep = "," + inner
        parts.append(nl + "}")
    elif t is list:
        if not o:
            parts.append("[]")
            return
        inner = nl + "  "
        sep = "[" + inner
        for v in o:
            parts.append(sep)
            _write_json(v, inner, parts)
            sep = "," + inner
        parts.append(nl + "]")
    else:
        raise _NotPlain


def _json_default(o):
    import enum

    if isinstance(o, enum.Enum):
        return o.value
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")

