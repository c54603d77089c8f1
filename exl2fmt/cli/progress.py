"""One overall progress bar for ``convert``: across the quantizer's phases, weighted by their expected cost.

The library reports ``progress(done, total, what)`` per phase (``what`` = ``"phase: item"`` for the quantizer,
a layer key for the other converters), and each phase counts in its own units (blocks x options, blocks x
layers, bytes).  ``Overall`` maps that onto one fraction of the whole run: the phases expected for the target
(``phases_for``), each with a share of the run's time (``PHASE_WEIGHTS``, measured on the bundled tiny-llama and
a 0.5B model on the CPU: bench/RESULTS.md), the current phase's fraction inside its share.  The fraction never
goes backwards.

``Eta`` gives an estimate only once it is stable: after ``min_elapsed`` seconds and ``min_gain`` of the run,
and when the last estimates (one per ``sample_s`` seconds) agree within ``tolerance``; it is then smoothed.
The rate is this run's: a resumed quantization reports the step it resumes at (item ``resumed at ...``), and
the work before it, done by the interrupted run, is not counted.

``Bar`` draws one line on a terminal (stderr), at most 10 times a second, never wider than the terminal minus
one column (so 80 columns fit: bar, percent, elapsed, ETA, then the item text shortened in the middle).
``plain_progress`` writes plain heartbeat lines for a stderr that is no terminal (a CI log, a pipe).
``StatusLines`` writes the machine form, one JSON object per line (``status``, ``done``, ``total``, ``what``,
``elapsed_s``, plus ``phase``, ``fraction`` and ``eta_s``); the first update is written at once.
"""

from __future__ import annotations

import json
import shutil
import sys
import time

from ..errors import escape_name, json_ci_defuse

__all__ = ["PHASE_WEIGHTS", "phases_for", "Overall", "Eta", "Bar", "StatusLines", "plain_progress", "fmt_duration",
           "fit"]

#: Share of a quantization's time per phase, from the timings in bench/RESULTS.md (FP16 -> EXL2 on the CPU at the
#: default 32 x 512 calibration, since the measurement scores on a quarter of the rows: a 1B-shaped layer 75 s
#: measure / 52 s quantize, the fixture 9 s / 6 s; compile + verify ~1%); without the measurement (GPTQ,
#: --measurement) the others are rescaled to fill the bar.
PHASE_WEIGHTS = {"calibrate": 0.02, "measure": 0.56, "quantize": 0.38, "head": 0.02, "compile": 0.01,
                 "verify": 0.01, "done": 0.0}


#: the item of the step a resumed quantization reports where it resumes ("quantize: resumed at block 3 of 8"):
#: what came before it was an earlier run's work, so the ETA's rate is measured from there (issue 41)
RESUMED = "resumed at "


def phases_for(target: str, measuring: bool) -> list[str]:
    """The quantizer's phases for ``target`` (``measuring``: EXL2 without ``--measurement``)."""
    ph = ["calibrate"] + (["measure"] if target == "exl2" and measuring else []) + \
        ["quantize", "head", "compile", "verify", "done"]
    return ph


def fmt_duration(s: float) -> str:
    s = int(round(max(0.0, s)))
    h, r = divmod(s, 3600)
    m, sec = divmod(r, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fit(text: str, width: int) -> str:
    """``text`` shortened to ``width`` columns by cutting its middle (the layer name at the end stays)."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text
    if width <= 3:
        return text[:width]
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


class Overall:
    """(done, total, "phase: item") -> (fraction of the run in [0, 1], phase, item)."""

    def __init__(self, phases: list[str] | None = None, weights: dict[str, float] | None = None):
        self.phases = list(phases or [])
        w = dict(PHASE_WEIGHTS if weights is None else weights)
        total = sum(w.get(p, 0.0) for p in self.phases) or 1.0
        self.weight = {p: w.get(p, 0.0) / total for p in self.phases}
        self.start = {}
        acc = 0.0
        for p in self.phases:
            self.start[p] = acc
            acc += self.weight[p]
        self.fraction = 0.0

    def update(self, done: int, total: int, what: str) -> tuple[float, str, str]:
        text = str(what)
        phase, sep, item = text.partition(": ")
        if not sep or phase not in self.start:  # not a phase of the plan: a plain done / total
            phase, item = "", text
            inner = min(1.0, max(0.0, done / total)) if total else 0.0
            # with a plan (a GGUF decoded before it is quantized), such steps are part of its first phase
            f = self.weight[self.phases[0]] * inner if self.phases else (inner if total else self.fraction)
        else:
            inner = min(1.0, max(0.0, done / total)) if total else 0.0
            f = self.start[phase] + self.weight[phase] * inner
        self.fraction = min(1.0, max(self.fraction, f))
        return self.fraction, phase, item


class Eta:
    """A remaining-time estimate that is shown only once it has settled."""

    def __init__(self, min_elapsed: float = 10.0, min_gain: float = 0.03, sample_s: float = 2.0,
                 window: int = 4, tolerance: float = 0.3, clock=time.monotonic):
        self.clock = clock
        self.t0 = clock()
        self.f0 = None
        self.min_elapsed, self.min_gain, self.sample_s = min_elapsed, min_gain, sample_s
        self.window, self.tolerance = window, tolerance
        self.samples: list[float] = []
        self.t_last = -1e9
        self.value: float | None = None     # the smoothed estimate, once stable
        self.stable = False

    def rebase(self, fraction: float) -> None:
        """The work up to ``fraction`` was done by an earlier run (a resume point): measure the rate from here."""
        self.f0, self.t0 = fraction, self.clock()
        self.samples, self.t_last, self.value, self.stable = [], -1e9, None, False

    def update(self, fraction: float) -> float | None:
        now = self.clock()
        if self.f0 is None:
            self.f0, self.t0 = fraction, now   # a resumed run starts part-way: rate from here on
        gain, el = fraction - self.f0, now - self.t0
        if fraction >= 1.0:
            self.value = 0.0
            return self.value
        if el < self.min_elapsed or gain < self.min_gain:
            return None
        if now - self.t_last >= self.sample_s:
            self.t_last = now
            est = el * (1.0 - fraction) / gain
            self.samples = (self.samples + [est])[-self.window:]
            if not self.stable and len(self.samples) >= self.window:
                lo, hi = min(self.samples), max(self.samples)
                self.stable = hi <= lo * (1.0 + self.tolerance) + 2.0
            if self.stable:
                self.value = est if self.value is None else 0.7 * self.value + 0.3 * est
        elif self.value is not None:
            self.value = max(0.0, self.value - (now - getattr(self, "_t_prev", now)))
        self._t_prev = now
        return self.value if self.stable else None


class Bar:
    """One line on a terminal: ``[██████░░░░]  37%  1:23  eta ~2:10  quantize: model.layers.1.mlp.down_proj``."""

    def __init__(self, overall: Overall, stream=None, first: str = "", min_interval: float = 0.1, width=None):
        self.overall = overall
        self.stream = stream or sys.stderr
        self.eta = Eta()
        self.t0 = time.monotonic()
        self.t_draw = -1e9
        self.min_interval = min_interval
        self._width = width
        self.last = None
        self.shown = False
        enc = (getattr(self.stream, "encoding", None) or "").lower()
        self.full, self.empty = ("█", "░") if "utf" in enc else ("#", "-")
        if first:
            self._draw(0.0, first, None, force=True)

    def width(self) -> int:
        if self._width:
            return self._width
        return max(20, shutil.get_terminal_size((80, 24)).columns)

    def line(self, fraction: float, text: str, eta: float | None) -> str:
        cols = self.width() - 1                         # never the last column: no wrap on any terminal
        bw = 20 if cols >= 70 else 10
        filled = int(round(bw * fraction))
        bar = self.full * filled + self.empty * (bw - filled)
        t = f"{fmt_duration(time.monotonic() - self.t0)}"
        e = f"  eta ~{fmt_duration(eta)}" if eta is not None else ""
        head = f"{bar} {100 * fraction:3.0f}%  {t}{e}  "
        room = cols - len(head)
        text = escape_name(text)
        phase, sep, item = text.partition(": ")
        if sep and len(text) > room and len(phase) + 2 + 8 <= room:
            # keep the phase whole and the end of the layer name: "quantize: …layers.0.mlp.down_proj"
            rest = room - len(phase) - 2
            return head + phase + sep + (item if len(item) <= rest else "…" + item[len(item) - rest + 1:])
        return head + fit(text, room)

    def _draw(self, fraction, text, eta, force=False) -> None:
        now = time.monotonic()
        if not force and now - self.t_draw < self.min_interval:
            return
        self.t_draw = now
        s = self.line(fraction, text, eta)
        self.stream.write("\r" + s + "\x1b[K")
        self.stream.flush()
        self.shown = True

    def __call__(self, done: int, total: int, what: str) -> None:
        f, phase, item = self.overall.update(done, total, what)
        if item.startswith(RESUMED):
            self.eta.rebase(f)
        eta = self.eta.update(f)
        text = f"{phase}: {item}" if phase else item
        new_phase = self.last is None or phase != self.last[3]
        self.last = (f, text, eta, phase)
        self._draw(f, text, eta, force=new_phase or bool(total and done >= total and phase in ("", "done")))

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


class StatusLines:
    """JSON lines on stderr for bots: at most one a ``min_interval``, plus every change of phase and the last
    step; the first update at once."""

    def __init__(self, description: str, overall: Overall, stream=None, min_interval: float = 1.0):
        self.description = description
        self.overall = overall
        self.stream = stream or sys.stderr
        self.min_interval = min_interval
        self.t0 = time.monotonic()
        self.t_last = -1e9
        self.phase = None
        self.eta = Eta()

    def __call__(self, done: int, total: int, what: str) -> None:
        now = time.monotonic()
        f, phase, item = self.overall.update(done, total, what)
        if item.startswith(RESUMED):
            self.eta.rebase(f)
        eta = self.eta.update(f)
        ph = str(what).split(":", 1)[0]
        if now - self.t_last < self.min_interval and ph == self.phase and not (total and done >= total):
            return
        self.t_last, self.phase = now, ph
        line = json.dumps({"status": self.description, "done": int(done), "total": int(total or 0),
                           "what": str(what), "elapsed_s": round(now - self.t0, 3), "phase": phase or None,
                           "fraction": round(f, 4), "eta_s": None if eta is None else round(eta, 1)})
        self.stream.write(json_ci_defuse(line) + "\n")  # same value; no "##[" for a CI runner
        self.stream.flush()


#: seconds between two heartbeat lines of ``plain_progress``
PLAIN_PROGRESS_INTERVAL = 30.0


def plain_progress(description: str, stream=None, interval: float = PLAIN_PROGRESS_INTERVAL):
    """A ``progress(done, total, what)`` callback for a stderr that is no terminal (a CI log, a pipe): one plain
    line when the work starts, then at most one per ``interval`` seconds, and one when it ends, e.g.
    ``validate --run: 19 % (model.layers.5), 1:27 elapsed``, so that minutes of CPU work never look like a hang
    (issue 41: ``validate --run`` ran 13.5 minutes in a log without a line). ``what`` comes from files: escaped."""
    t0 = time.monotonic()
    state = {"t": None, "ended": False}

    def update(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        end = bool(total) and done >= total
        if state["ended"] or (state["t"] is not None and now - state["t"] < interval and not end):
            return
        state["t"], state["ended"] = now, end
        pct = f"{100 * done / total:.0f} %" if total else f"{done}"
        item = escape_name(str(what))
        item = item if len(item) <= 60 else "..." + item[-57:]
        e = int(now - t0)
        out = stream if stream is not None else sys.stderr
        out.write(f"{description}: {pct}{f' ({item})' if item else ''}, {e // 60}:{e % 60:02d} elapsed\n")
        out.flush()

    return update
