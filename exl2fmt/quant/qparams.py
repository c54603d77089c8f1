"""Candidate settings of the EXL2 quantizer, their exact cost, and ExLlamaV2's ``measurement.json``.

A *setting* (``QParams``) of one linear layer is a list of tiers, highest bit width first: a proportion of the
stored rows at a bit width in groups of a given size, e.g. ``0.1:4b_128g/0.9:3b_128g`` (scale bits always 4).
An *option* of a block is one setting per linear layer of the block (q/k/v/o for attention, gate/up/down for
the MLP); the solver picks one option per block.

The tables ``ATTN_OPTIONS`` and ``MLP_OPTIONS`` are ExLlamaV2's (spec/exl2.md, "Candidate settings"), so a
measurement written here can be read by ExLlamaV2 and the other way round; ``EXTRA_*`` add settings upstream
does not have (see ``options(extended=True)``).  Costs come from ``exl2fmt.layout.exl2_total_bits`` — the same
accounting the inspector and validator use.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..container import jsonload
from ..errors import ErrorCode, Exl2Error
from ..layout import BIT_WIDTHS, Tier, exl2_total_bits, pad32, plan_rows

__all__ = ["QParams", "Option", "ATTN_OPTIONS", "MLP_OPTIONS", "HEAD_OPTIONS", "block_options", "head_qparams",
           "read_measurement", "write_measurement", "promote", "pareto_rows", "exllamav2_last_module_idx"]


@dataclass(frozen=True)
class QParams:
    """One layer setting: ``tiers`` as (proportion, bits, group_size), highest bits first."""

    tiers: tuple[tuple[float, int, int], ...]

    @staticmethod
    def of(*tiers: tuple[float, int, int]) -> "QParams":
        return QParams(tuple((float(p), int(b), int(g)) for p, b, g in tiers))

    def layout_tiers(self) -> list[Tier]:
        return [Tier(p, b, g) for p, b, g in self.tiers]

    def bits_rows(self, K: int) -> list[tuple[int, int]]:
        return plan_rows(K, self.layout_tiers())

    def total_bits(self, K: int, N: int, has_bias: bool = False) -> int:
        """Exact stored bits of a [N, K] layer with this setting (N padded to 32 as stored)."""
        return exl2_total_bits(K, pad32(N), self.layout_tiers(), has_bias)

    def desc(self) -> str:
        """ExLlamaV2's description string, e.g. ``0.1:4b_128g/0.9:3b_128g s4``."""
        return "/".join(f"{_num(p)}:{b}b_{g}g" for p, b, g in self.tiers) + " s4"

    def to_json(self) -> dict:
        """The QParams dict of ``measurement.json``."""
        gs: dict[str, int] = {}
        for _, b, g in self.tiers:
            gs[str(b)] = g
        return {"group_size": gs, "bits": [b for _, b, _ in self.tiers],
                "bits_prop": [p for p, _, _ in self.tiers], "scale_bits": 4}

    @staticmethod
    def from_json(d, where: str = "") -> "QParams":
        try:
            bits = [int(b) for b in d["bits"]]
            props = [float(p) for p in d["bits_prop"]]
            gsd = d["group_size"]
            if isinstance(gsd, dict):
                gsm = {int(k): int(v) for k, v in gsd.items()}
                sizes = [gsm[b] for b in bits]
            elif isinstance(gsd, list):
                sizes = [int(g) for g in gsd]
            else:
                sizes = [int(gsd)] * len(bits)
            if int(d.get("scale_bits", 4)) != 4:
                raise ValueError("scale_bits must be 4")
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # int(Infinity) overflows
            raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{where}: not a QParams dict ({e})") from None
        if not bits or len(bits) != len(props) or len(sizes) != len(bits):
            raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{where}: bits, bits_prop and group_size disagree")
        for b, p, g in zip(bits, props, sizes):
            if b not in BIT_WIDTHS or not (0 <= p <= 1) or g <= 0 or g % 32 or g > 32768:
                raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{where}: tier {p}x{b}b/{g}g is not a valid "
                                "EXL2 tier (bits 2/3/4/5/6/8, proportion 0..1, group size a multiple of 32 up to "
                                "32768)")
        return QParams(tuple(zip(props, bits, sizes)))


def _num(p: float) -> str:
    return f"{p:g}"


@dataclass(frozen=True)
class Option:
    """One joint choice for a block: layer name (``q_proj`` ...) -> ``QParams``."""

    layers: tuple[tuple[str, QParams], ...]

    def get(self, name: str) -> QParams:
        """The setting of linear ``name``; a dotted name (a MoE block's ``experts.3.gate_proj``) takes the
        setting of its last part (``gate_proj``)."""
        d = dict(self.layers)
        return d[name] if name in d else d[name.rpartition(".")[2]]


def _q(spec: str) -> QParams:
    """``"0.1x4/128 + 0.9x3/128"`` -> QParams."""
    tiers = []
    for part in spec.split("+"):
        p, rest = part.strip().split("x")
        b, g = rest.split("/")
        tiers.append((float(p), int(b), int(g)))
    return QParams.of(*tiers)


# ExLlamaV2's attention table (19 rows: q, k, v, o) and MLP table (17 rows: gate, up, down).
_ATTN = [
    ("0.05x3/64 + 0.95x2/64",) * 4,
    ("0.1x3/64 + 0.9x2/64", "0.1x3/64 + 0.9x2/64", "0.25x3/64 + 0.75x2/64", "0.1x3/64 + 0.9x2/64"),
    ("0.1x3/64 + 0.9x2/64", "0.1x3/64 + 0.9x2/64", "0.1x4/128 + 0.9x3/128", "0.1x3/64 + 0.9x2/64"),
    ("0.1x3/64 + 0.9x2/64", "0.1x3/64 + 0.9x2/64", "0.1x4/128 + 0.9x3/128", "0.1x4/128 + 0.9x3/128"),
    ("0.1x4/128 + 0.9x3/128",) * 4,
    ("0.1x4/128 + 0.9x3/128", "0.1x4/128 + 0.9x3/128", "0.1x4/64 + 0.9x3/64", "0.1x4/128 + 0.9x3/128"),
    ("1x4/128",) * 4,
    ("1x4/128", "1x4/128", "1x4/64", "1x4/128"),
    ("1x4/64", "1x4/64", "1x4/32", "1x4/64"),
    ("1x4/32",) * 4,
    ("0.1x5/128 + 0.9x4/128", "0.1x5/128 + 0.9x4/128", "0.1x5/64 + 0.9x4/64", "0.1x5/128 + 0.9x4/128"),
    ("0.1x5/64 + 0.9x4/64", "0.1x5/64 + 0.9x4/64", "0.1x5/32 + 0.9x4/32", "0.1x5/64 + 0.9x4/64"),
    ("0.1x5/64 + 0.9x4/64", "0.1x5/64 + 0.9x4/64", "1x5/64", "0.1x5/64 + 0.9x4/64"),
    ("0.1x5/32 + 0.9x4/32", "0.1x5/32 + 0.9x4/32", "1x5/32", "0.1x5/32 + 0.9x4/32"),
    ("0.1x6/128 + 0.9x5/128", "0.1x6/128 + 0.9x5/128", "1x6/128", "0.1x6/128 + 0.9x5/128"),
    ("0.1x6/32 + 0.9x5/32", "0.1x6/32 + 0.9x5/32", "1x6/32", "0.1x6/32 + 0.9x5/32"),
    ("1x6/128",) * 4,
    ("1x6/32", "1x6/32", "1x8/32", "1x6/32"),
    ("1x8/128",) * 4,
]
_MLP = [
    ("0.05x3/64 + 0.95x2/64", "0.05x3/64 + 0.95x2/64", "0.05x6/32 + 0.2x3/64 + 0.75x2/64"),
    ("0.1x3/64 + 0.9x2/64", "0.25x3/64 + 0.75x2/64", "0.05x6/32 + 0.2x3/64 + 0.75x2/64"),
    ("0.1x3/64 + 0.9x2/64", "0.3x3/64 + 0.7x2/64", "0.05x5/32 + 0.95x3/32"),
    ("0.1x3/64 + 0.9x2/64", "0.3x3/64 + 0.7x2/64", "0.05x5/32 + 0.95x4/32"),
    ("0.1x4/128 + 0.9x3/128", "0.25x4/128 + 0.75x3/128", "0.05x8/32 + 0.1x4/128 + 0.85x3/128"),
    ("0.1x4/32 + 0.9x3/32", "0.25x4/32 + 0.75x3/32", "0.05x8/32 + 0.1x4/32 + 0.85x3/32"),
    ("0.1x4/32 + 0.9x3/32", "0.25x4/32 + 0.75x3/32", "0.05x8/32 + 0.95x4/128"),
    ("1x4/128", "1x4/32", "0.05x8/32 + 0.95x4/128"),
    ("1x4/32", "1x4/32", "0.05x8/32 + 0.95x4/32"),
    ("0.1x5/128 + 0.9x4/128", "0.25x5/128 + 0.75x4/128", "0.05x8/32 + 0.1x5/128 + 0.85x4/128"),
    ("0.1x5/32 + 0.9x4/32", "0.25x5/32 + 0.75x4/32", "0.05x8/32 + 0.1x5/32 + 0.85x4/32"),
    ("0.1x6/128 + 0.9x5/128", "0.25x6/128 + 0.75x5/128", "0.05x8/32 + 0.1x6/128 + 0.85x5/128"),
    ("0.1x6/32 + 0.9x5/32", "0.25x6/32 + 0.75x5/32", "0.05x8/32 + 0.1x6/32 + 0.85x5/32"),
    ("1x6/128", "1x6/128", "0.05x8/32 + 0.95x6/128"),
    ("0.1x8/128 + 0.9x6/128", "0.1x8/128 + 0.9x6/128", "0.15x8/128 + 0.85x6/128"),
    ("0.1x8/128 + 0.9x6/128", "0.1x8/128 + 0.9x6/128", "1x8/128"),
    ("1x8/128", "1x8/128", "1x8/128"),
]
# Settings upstream lacks: uniform 2-bit-heavy and 3/5-bit steps, so low and mid budgets have finer choices, and a
# plain 4-bit 128-row MLP: upstream's MLP rows jump from ~3.7 to ~4.2 bpw (4-bit gate/up with 32-row groups, 8-bit
# rows in down), so a 4.0 budget mixed MLPs above it with 3-bit attention; on a tiny Gemma at hidden 512 that mix
# lost to round-to-nearest 4-bit g128 and this row won (bench/RESULTS.md, issue 14, 2026-12-03).
_ATTN_EXTRA = [
    ("0.05x4/32 + 0.95x2/32",) * 4,
    ("0.25x3/64 + 0.75x2/64", "0.25x3/64 + 0.75x2/64", "1x3/64", "0.25x3/64 + 0.75x2/64"),
    ("1x3/64", "1x3/64", "1x4/64", "1x3/64"),
    ("0.5x4/64 + 0.5x3/64", "0.5x4/64 + 0.5x3/64", "1x4/64", "0.5x4/64 + 0.5x3/64"),
    ("0.5x5/64 + 0.5x4/64", "0.5x5/64 + 0.5x4/64", "1x5/64", "0.5x5/64 + 0.5x4/64"),
    ("1x5/64", "1x5/64", "1x6/64", "1x5/64"),
]
_MLP_EXTRA = [
    ("0.05x4/32 + 0.95x2/32", "0.05x4/32 + 0.95x2/32", "0.05x6/32 + 0.95x2/32"),
    ("1x3/64", "1x3/64", "0.05x6/32 + 0.95x3/64"),
    ("0.5x4/64 + 0.5x3/64", "0.5x4/64 + 0.5x3/64", "0.05x8/32 + 0.5x4/64 + 0.45x3/64"),
    ("1x4/128", "1x4/128", "1x4/128"),
    ("0.5x5/64 + 0.5x4/64", "0.5x5/64 + 0.5x4/64", "0.05x8/32 + 0.5x5/64 + 0.45x4/64"),
    ("1x5/64", "1x5/64", "0.05x8/32 + 0.95x5/64"),
]

ATTN_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LAYERS = ("gate_proj", "up_proj", "down_proj")


def _options(rows, names) -> list[Option]:
    return [Option(tuple((n, _q(s)) for n, s in zip(names, row))) for row in rows]


ATTN_OPTIONS: list[Option] = _options(_ATTN, ATTN_LAYERS)
MLP_OPTIONS: list[Option] = _options(_MLP, MLP_LAYERS)

#: ``--head-bits`` -> the head's setting (ExLlamaV2's ``qparams_headoptions``).
HEAD_OPTIONS: dict[int, QParams] = {
    2: _q("0.3x4/32 + 0.7x2/32"),
    3: _q("0.15x4/32 + 0.85x3/32"),
    4: _q("0.15x6/32 + 0.85x4/32"),
    5: _q("0.15x6/128 + 0.85x5/128"),
    6: _q("0.15x8/128 + 0.85x6/128"),
    8: _q("1x8/128"),
}


def block_options(kind: str, extended: bool = False) -> list[Option]:
    """The candidate options of a block: ``kind`` is ``"attn"`` or ``"mlp"``.  ``extended`` appends the extra
    settings (upstream's table first, so option indices of a measurement stay compatible)."""
    if kind == "attn":
        return ATTN_OPTIONS + (_options(_ATTN_EXTRA, ATTN_LAYERS) if extended else [])
    if kind == "mlp":
        return MLP_OPTIONS + (_options(_MLP_EXTRA, MLP_LAYERS) if extended else [])
    raise ValueError(kind)


def promote(qp: QParams, K: int) -> QParams | None:
    """``qp`` with one more group of rows at a higher bit width (None if every row is already 8-bit).

    The first tier below 8 bits that is not the top tier grows the tier above it by one of that tier's groups;
    a single-tier setting gains a new top tier at the next width with the same group size.  Rows move from the
    lowest tiers (``plan_rows`` clips the last tiers to what is left).
    """
    widths = sorted(BIT_WIDTHS)
    rows = {}
    for b, r in qp.bits_rows(K):
        rows[b] = rows.get(b, 0) + r
    tiers = [list(t) for t in qp.tiers if rows.get(t[1], 0) > 0]
    if len(tiers) == 1 or all(t[1] == 8 for t in tiers[:-1]):
        p, b, g = tiers[-1]
        if b == 8:
            return None
        if len(tiers) == 1:
            up = widths[widths.index(b) + 1]
            new = [[(g - 0.5) / K, up, g], [1.0, b, g]]
        else:
            top = tiers[-2]
            if top[1] == 8 and tiers[-1][1] < 8 and len(tiers) >= 2:
                top_rows = rows[top[1]]
                top[0] = (top_rows + top[2] - 0.5) / K
            new = tiers
    else:
        p0, b0, g0 = tiers[0]
        new = [[(rows[b0] + g0 - 0.5) / K, b0, g0]] + [list(t) for t in tiers[1:]]
    for t in new:        # a group wider than the rows left (K below the group size: small MoE experts) takes all
        t[0] = min(t[0], 1.0)
    new_rows = QParams.of(*new).bits_rows(K)
    if sum(r * b for b, r in new_rows) <= sum(r * b for b, r in qp.bits_rows(K)):
        return None
    return QParams.of(*(tuple(t) for t in new))


def head_qparams(head_bits: int) -> QParams:
    if head_bits not in HEAD_OPTIONS:
        raise Exl2Error(ErrorCode.USAGE, f"--head-bits must be one of {sorted(HEAD_OPTIONS)}, got {head_bits}")
    return HEAD_OPTIONS[head_bits]


# ------------------------------------------------------------------------------------------------ measurement.json


def exllamav2_last_module_idx(num_layers: int) -> int:
    """``last_module_idx`` of a complete measurement, counted the way ExLlamaV2 counts a decoder's modules:
    the embedding (0), then every attention and every MLP module (two per layer), the final norm and the head;
    a finished measurement names the last of them, the head: ``2 * num_layers + 2``."""
    return 2 * int(num_layers) + 2


def pareto_rows(rows: list[tuple[Option, int, float]]) -> list[tuple[Option, int, float]]:
    """``rows`` [(option, total_bits, accuracy)] in ascending cost (a stable sort: equal costs keep their order),
    without the rows that another row beats: one that costs the same or less and is at least as accurate.

    What is left is strictly ascending in cost *and* in accuracy, the order ExLlamaV2's optimizer assumes: after
    its annealing it spends the leftover budget by stepping blocks to the next option index, so with this order
    every such step buys accuracy.  No optimizer gains from a dominated row (the row that beats it is cheaper
    or equal and no worse), so dropping them loses nothing."""
    out: list[tuple[Option, int, float]] = []
    for row in sorted(rows, key=lambda r: r[1]):
        if out and row[2] <= out[-1][2]:
            continue                      # costs at least as much as a kept row and is not more accurate
        if out and row[1] == out[-1][1]:
            out[-1] = row                 # same cost, more accurate: it beats the kept one
            continue
        out.append(row)
    return out


def write_measurement(path: str | os.PathLike, measured: dict[str, list[tuple[Option, int, float]]],
                      last_module_idx: int, gains: dict[str, float] | None = None) -> None:
    """Write ExLlamaV2's ``measurement.json``: ``measured`` maps block key -> [(option, total_bits, accuracy)].
    ``gains`` (block key -> the solver's factor on its error, ``sensitivity.block_gains``) go in a top-level key
    of exl2fmt's own, ``GAINS_KEY``, which ExLlamaV2 does not read.

    Each block's options are written by ``pareto_rows``: ascending cost, each more accurate than the last (the
    order ExLlamaV2's optimizer relies on), whatever order the caller's candidate table has.  ``last_module_idx``
    should be ``exllamav2_last_module_idx(num_layers)`` for a complete measurement.  Written atomically
    (temporary file + rename)."""
    doc = {"measurement": {}, "last_module_idx": int(last_module_idx)}
    for key, rows in measured.items():
        opts = []
        for opt, total_bits, accuracy in pareto_rows(list(rows)):
            d = {"accuracy": float(accuracy), "total_bits": int(total_bits)}
            for name, qp in opt.layers:
                d[name] = qp.to_json()
            opts.append(d)
        doc["measurement"][key] = opts
    if gains is not None:
        doc[GAINS_KEY] = {k: float(v) for k, v in gains.items()}
    from ..container.publish import atomic_write

    data = json.dumps(doc, indent=4).encode("utf-8")
    # a new temp name (O_EXCL) next to the file, fsync, rename: never through a link planted at a guessable name
    atomic_write(Path(os.fspath(path)), lambda f: f.write(data))


#: measurement.json's top-level key of exl2fmt's block gains ({block key: factor}); absent in ExLlamaV2's files
GAINS_KEY = "exl2fmt_block_gains"
#: the range a stored gain must lie in: measured gains are normalised to a geometric mean of 1 and span ~0.3-4 on
#: real models; a factor outside this range is not a measurement, and squared in the solver it would overflow
GAIN_MIN, GAIN_MAX = 1e-6, 1e6


def read_measurement_gains(path: str | os.PathLike, keys) -> dict[str, float] | None:
    """The block gains stored in a ``measurement.json`` (``GAINS_KEY``) for the block ``keys``, or None when the
    file has none (ExLlamaV2's files, exl2fmt's before the gains): ``MEASUREMENT_INVALID`` when present but not a
    positive finite number for every one of ``keys``."""
    p = os.fspath(path)
    doc = jsonload.load_json(p, jsonload.MEASUREMENT)
    g = doc.get(GAINS_KEY) if isinstance(doc, dict) else None
    if g is None:
        return None
    if not isinstance(g, dict):
        raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{GAINS_KEY}: expected an object", file=p)
    out = {}
    for k in keys:
        v = g.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not GAIN_MIN <= v <= GAIN_MAX:
            raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{GAINS_KEY}: block {k} has no gain between "
                            f"{GAIN_MIN:g} and {GAIN_MAX:g} (got {str(v)[:40]})", file=p)
        out[k] = float(v)
    return out


_BLOCK_KEY = re.compile(r"^(.*)\.(\d+)\.(self_attn|mlp|block_sparse_moe)$")

#: A measured row's ``total_bits`` may differ from this model's cost of the same setting by this fraction
#: (ExLlamaV2 and exl2fmt count the same bits; the margin covers a bias counted once more or less).  A file
#: measured on other shapes is off by far more: a different hidden size, head count or MLP width changes the
#: cost of every option by tens of percent.
MEASUREMENT_COST_TOLERANCE = 0.02


def read_measurement(path: str | os.PathLike, layer_names: dict[str, tuple[str, ...]], *,
                     shapes: dict[str, tuple[int, int, bool]] | None = None, num_layers: int | None = None
                     ) -> dict[str, list[tuple[Option, int, float]]]:
    """Read ``measurement.json`` (ours or ExLlamaV2's, options in any order).  ``layer_names`` maps each
    expected block key to the names of its linear layers; every expected block must be present with at least
    one option, and every option must name exactly those layers.  Other keys (norms, head: ``null``) are
    ignored.  Rows come back in the file's order.

    With ``num_layers`` and ``shapes`` (linear name -> (K in, N out, has_bias) of this model, or a list of them
    for a name whose setting several linears take: a MoE block's ``w1`` for every expert's gate), a file measured on
    another model is refused with ``MEASUREMENT_MODEL_MISMATCH`` before any work: blocks of layers this model
    does not have, or ``total_bits`` that are not this model's cost of the row's setting (other shapes)."""
    p = os.fspath(path)
    if not os.path.lexists(p):
        raise Exl2Error(ErrorCode.PATH_NOT_FOUND, "measurement file not found", file=p)
    # regular file, size / value-count / depth caps, every parser error MEASUREMENT_INVALID (container.jsonload)
    doc = jsonload.load_json(p, jsonload.MEASUREMENT)
    meas = doc.get("measurement") if isinstance(doc, dict) else None
    if not isinstance(meas, dict):
        raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, "no 'measurement' object", file=p)
    if num_layers is not None:
        # a layer number of more than 9 digits is no layer of any model (and int() of 5000 digits raises)
        layers_in_file = {int(m.group(2)) for k in meas
                          if (m := _BLOCK_KEY.match(str(k))) and len(m.group(2)) <= 9}
        if layers_in_file and max(layers_in_file) + 1 != num_layers:
            raise Exl2Error(ErrorCode.MEASUREMENT_MODEL_MISMATCH, f"the file measures {max(layers_in_file) + 1} "
                            f"decoder layers, this model has {num_layers}: it was measured on another model",
                            file=p)
    out = {}
    for key, names in layer_names.items():
        rows = meas.get(key)
        if not isinstance(rows, list) or not rows:
            raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"block {key} is not measured (the file is for "
                            "another model, or the measurement was interrupted)", file=p)
        parsed = []
        for i, d in enumerate(rows):
            where = f"{key} option {i}"
            if not isinstance(d, dict) or set(d) - {"accuracy", "total_bits"} != set(names):
                raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{where}: expected layers {', '.join(names)}",
                                file=p)
            acc = d.get("accuracy")
            if not isinstance(acc, (int, float)) or not math.isfinite(acc):
                raise Exl2Error(ErrorCode.MEASUREMENT_INVALID, f"{where}: accuracy must be a finite number", file=p)
            try:
                opt = Option(tuple((n, QParams.from_json(d[n], f"{where} {n}")) for n in names))
            except Exl2Error as e:
                raise Exl2Error(e.code, e.message, file=p) from None
            tb = d.get("total_bits")
            tb_ok = (isinstance(tb, (int, float)) and not isinstance(tb, bool) and math.isfinite(tb)
                     and 0 <= tb < 2 ** 63)
            tb = int(tb) if tb_ok else -1
            if shapes is not None and tb > 0:
                ours = sum(qp.total_bits(*sh) for n, qp in opt.layers
                           for sh in (shapes[n] if isinstance(shapes[n], list) else [shapes[n]]))
                if abs(tb - ours) > MEASUREMENT_COST_TOLERANCE * ours:
                    raise Exl2Error(ErrorCode.MEASUREMENT_MODEL_MISMATCH, f"{where}: total_bits {tb} but this "
                                    f"model's layers cost {ours} bits with that setting: the file was measured "
                                    "on a model with other layer shapes", file=p)
            parsed.append((opt, tb, float(acc)))
        out[key] = parsed
    return out

