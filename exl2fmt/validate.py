"""``validate_model(path)``: every check exl2fmt knows, as a list of PASS / WARN / FAIL results.

A ``Check`` has a stable ``check`` id (what was checked), a ``status`` and a stable ``code``: the
``ErrorCode`` value for WARN and FAIL, a ``PassCode`` value for PASS.  Passing items of the same kind are
reported once with a ``count`` (one line for 560 valid layers); every warning and failure is its own check.

Structural checks (headers only, plus each EXL2 layer's tiny ``q_groups``):

=============  ===============================================================================================
``container``  every shard header passes the hardened parser (size cap, UTF-8 JSON, duplicate keys,
               ``__metadata__``, offsets contiguous from 0, shape x dtype = bytes, no truncation, no
               trailing bytes); a failure here stops validation (the model cannot be read)
``index``      ``model.safetensors.index.json`` <-> shards both ways, ``total_size``, duplicates;
               a sharded model without an index is a warning (``INDEX_ABSENT``)
``names``      no control characters in tensor names (``NAME_CONTROL_CHARS``)
``format``     one format per layer and per model; ``quantization_config`` agrees with the tensors
``config``     config.json is a JSON object; hidden / intermediate / vocab / head sizes and the layer count
               agree with the tensor shapes (``CONFIG_MISMATCH``)
``layers``     every layer against the layout table: EXL2 invariants (slots, dtypes, shapes, q_groups
               bits/order/qrow/rows/limits, K), GPTQ (bits and group size vs shapes), AWQ shapes
``bits``       ``quantization_config.bits`` (the EXL2 target) vs the measured decoder bpw: a WARN outside
               +-``BITS_TOLERANCE``
=============  ===============================================================================================

``deep=True`` reads the data: ``q_invperm`` is a permutation, ``q_scale_max`` finite and > 0, ``g_idx`` in range,
v1 zero-point ambiguity counted, no NaN/Inf in any floating-point tensor (``finite``), every layer dequantizes
(``decode``) with its weight statistics in ``Report.layers``.  ``reference=DIR`` compares each dequantized
layer with the same layer of an FP16/BF16/FP32 model (``reference``): relative Frobenius error, max abs
error and cosine similarity; the layer FAILs (``REFERENCE_MISMATCH``) when the relative Frobenius error
exceeds its threshold (``reference_threshold``).

``kernel=True`` (``exl2fmt validate --kernel``, needs ``pip install 'exl2fmt[kernels]'``) runs every EXL2 layer (and
every 2/4/8-bit GPTQ layer, through the GPTQ kernels of the same family) that passed the structural checks through the bundled Triton kernels (``exl2fmt.kernels``) on seeded random inputs
and compares with the Numba reference (``kernel``): the kernel's dequantized W [K, N] must equal the reference
bit for bit, and for every M in ``kernel_ms`` (rows of x, fp16 unit-normal; one path per M,
``choose_path(M)``; GPTQ: fused up to ``GPTQ_FUSED_MAX_M``) every output of y = x @ W (+ bias) must lie within the fp32-accumulation bound
u_out |y_ref| + 2 (K + 1) 2^-24 (|x| @ |W_ref| + |bias|) of y_ref computed in float64 from the reference
weights; otherwise the layer FAILs (``KERNEL_MISMATCH``).  Results per layer in ``Report.layers[i].kernel``.
On ``device="cpu"`` the kernels run in Triton's interpreter (slow: small models only), with one column block
per layer (BLOCK_N = N_pad rounded up to a power of two, the interpreter's cost being per program); on CUDA
with the kernels' own launch heuristics.  torch and triton are imported only when ``kernel`` or ``run`` is set.

``run=True`` (``exl2fmt validate --run``; llama, mistral, qwen2, qwen3) runs one sequence of token ids
(``prompt_ids``, default ``exl2fmt.run_check.default_ids``) through the whole model twice, every EXL2 linear
(decoder and ``lm_head``) through the Triton kernel and, as the reference, over its dequantized float16 weights
in float32 (``run``): every kernel call within the fp32-accumulation bound on the forward's own activations
(else ``KERNEL_MISMATCH``), and the logits within a tolerance derived from a float16-I/O replay of the reference
(max |logit difference|, mean KL, top-1; else ``RUN_MISMATCH``).  Rules and numbers in ``exl2fmt.run_check``;
results in ``Report.run``.  An architecture without a forward raises ``ARCH_UNSUPPORTED``, ids outside the
vocabulary ``USAGE``, both before any data is read.

Exit status (``Report.exit_code``): 0 when nothing failed (warnings allowed unless ``strict``), 1 otherwise.
Inputs that cannot be read at all raise ``Exl2Error`` (exit 3 in the CLI); a malformed header is reported
as a failed ``container`` check.
"""

from __future__ import annotations

import enum
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import Category, ErrorCode, Exl2Error, Issue, Severity

__all__ = ["Status", "CheckId", "PassCode", "Check", "LayerResult", "Report", "validate_model", "fix_index",
           "REFERENCE_THRESHOLDS", "reference_threshold", "BITS_TOLERANCE", "weight_stats", "compare_weights",
           "KernelSetup", "load_kernels", "KERNEL_DEFAULT_MS"]


class Status(str, enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


class CheckId(str, enum.Enum):
    """Stable ids of the kinds of check."""

    CONTAINER = "container"
    INDEX = "index"
    NAMES = "names"
    FORMAT = "format"
    CONFIG = "config"
    LAYERS = "layers"
    BITS = "bits"
    FINITE = "finite"
    DECODE = "decode"
    REFERENCE = "reference"
    KERNEL = "kernel"
    RUN = "run"


class PassCode(str, enum.Enum):
    """The ``code`` of a passing check (one per check id; never an ErrorCode value)."""

    CONTAINER_OK = "CONTAINER_OK"
    INDEX_OK = "INDEX_OK"
    NAMES_OK = "NAMES_OK"
    FORMAT_OK = "FORMAT_OK"
    CONFIG_OK = "CONFIG_OK"
    LAYERS_OK = "LAYERS_OK"
    BITS_OK = "BITS_OK"
    FINITE_OK = "FINITE_OK"
    DECODE_OK = "DECODE_OK"
    REFERENCE_OK = "REFERENCE_OK"
    KERNEL_OK = "KERNEL_OK"
    RUN_OK = "RUN_OK"


#: Per-bit-width ceilings on the relative Frobenius error ||W_deq - W_ref||_F / ||W_ref||_F of one layer
#: (data, not code).  About 1.5x what round-to-nearest with ExLlamaV2's scale search gives on heavy-tailed
#: Gaussian weights with 128-row groups (2b 0.55, 3b 0.32, 4b 0.17, 5b 0.09, 6b 0.044, 8b 0.011), leaving room
#: for GPTQ, whose error feedback trades weight error for output error.  16 = a dense layer (fp16 rounding of
#: a bf16/fp32 original only).
REFERENCE_THRESHOLDS: dict[int, float] = {2: 0.80, 3: 0.45, 4: 0.25, 5: 0.13, 6: 0.07, 8: 0.02, 16: 0.005}

#: |quantization_config.bits - measured decoder bpw| above this is a BITS_MISMATCH warning (anchors §4.6).
BITS_TOLERANCE = 0.05


def reference_threshold(fractions: dict[int, float]) -> float:
    """Threshold of a layer whose rows are split over bit widths as ``{bits: fraction of rows}``.

    Rule: the RMS combination sqrt(sum_b fraction_b * T_b^2) of the per-width thresholds T_b of
    ``REFERENCE_THRESHOLDS``: the squared error of a mixed layer is (about) the row-weighted mix of its tiers'
    squared errors.  A single-width layer gets exactly T_b.  Widths missing from the table use the next lower
    listed width (a stricter bound is never applied to fewer bits).
    """
    total = sum(fractions.values())
    if total <= 0:
        return 0.0
    acc = 0.0
    keys = sorted(REFERENCE_THRESHOLDS)
    for b, f in fractions.items():
        k = max([x for x in keys if x <= b] or [keys[0]])
        acc += (f / total) * REFERENCE_THRESHOLDS[k] ** 2
    return math.sqrt(acc)


# ------------------------------------------------------------------------------------------------ records


@dataclass
class Check:
    check: str
    status: Status
    code: str
    message: str
    tensor: str | None = None
    file: str | None = None
    count: int = 1
    escalated: bool = False

    def as_dict(self) -> dict:
        return {"check": self.check, "status": self.status.value, "code": self.code, "message": self.message,
                "tensor": self.tensor, "file": self.file, "count": self.count, "escalated": self.escalated}


@dataclass
class LayerResult:
    """Per-layer data of a deep run: weight statistics of the dequantized weight, reference metrics."""

    key: str
    format: str
    shape: list[int] | None = None
    stats: dict | None = None
    reference: dict | None = None
    kernel: dict | None = None  # validate --kernel: see _kernel_layer

    def as_dict(self) -> dict:
        ref = None if self.reference is None else {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.reference.items()}
        return {"key": self.key, "format": self.format, "shape": self.shape, "stats": self.stats, "reference": ref,
                "kernel": self.kernel}


@dataclass
class Report:
    path: str
    deep: bool = False
    reference: str | None = None
    strict: bool = False
    format: str | None = None
    checks: list[Check] = field(default_factory=list)
    layers: list[LayerResult] = field(default_factory=list)
    index_written: dict | None = None
    kernel: dict | None = None  # validate --kernel: {"device", "interpreter", "ms", "seed"}
    run: dict | None = None  # validate --run: see _run_pass
    seconds: float = 0.0
    bytes_read: int = 0

    # --- building -------------------------------------------------------------------------------------
    def add(self, check: CheckId, status: Status, code, message: str, *, tensor=None, file=None, count=1) -> Check:
        c = Check(check.value, status, code.value if isinstance(code, enum.Enum) else str(code), message,
                  tensor, None if file is None else str(file), count)
        self.checks.append(c)
        return c

    def add_issue(self, check: CheckId, issue: Issue) -> Check:
        st = Status.WARN if issue.severity is Severity.WARNING else Status.FAIL
        return self.add(check, st, issue.code, issue.message, tensor=issue.tensor, file=issue.file)

    def ok(self, check: CheckId, code: PassCode, message: str, count: int = 1, file=None) -> Check:
        return self.add(check, Status.PASS, code, message, count=count, file=file)

    # --- results --------------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "warn": 0, "fail": 0}
        for c in self.checks:
            out[c.status.value.lower()] += 1
        return out

    @property
    def failed(self) -> bool:
        return any(c.status is Status.FAIL for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def apply_strict(self) -> None:
        if not self.strict:
            return
        for c in self.checks:
            if c.status is Status.WARN:
                c.status = Status.FAIL
                c.escalated = True

    def as_dict(self) -> dict:
        from . import __version__
        from .inspect import SCHEMA_VERSION

        return {
            "report": "validate",
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "exl2fmt", "version": __version__},
            "path": self.path,
            "format": self.format,
            "deep": self.deep,
            "reference": self.reference,
            "strict": self.strict,
            "result": "FAIL" if self.failed else "PASS",
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "checks": [c.as_dict() for c in self.checks],
            "layers": [l.as_dict() for l in self.layers],
            "index_written": self.index_written,
            "kernel": self.kernel,
            "run": self.run,
            "seconds": round(self.seconds, 3),
            "bytes_read": self.bytes_read,
        }


Progress = Callable[[int, int, str], None]


# ------------------------------------------------------------------------------------------------ numerics


def _to_f32(a, st_dtype: str):
    import numpy as np

    from .container import bf16_bits_to_f32

    if st_dtype == "BF16":
        return bf16_bits_to_f32(a)
    return np.asarray(a).astype(np.float32)


_CHUNK_ELEMS = 1 << 22


def _nonfinite_count(a, st_dtype: str) -> int:
    """NaN/Inf count of a float tensor, chunked (bounded memory), on bit patterns where possible."""
    import numpy as np

    flat = np.asarray(a).reshape(-1)
    n = 0
    if st_dtype in ("F16", "BF16"):
        mask = np.uint16(0x7C00 if st_dtype == "F16" else 0x7F80)
        u = flat.view(np.uint16)
        for i in range(0, u.size, _CHUNK_ELEMS):
            c = u[i:i + _CHUNK_ELEMS]
            n += int(np.count_nonzero((c & mask) == mask))
        return n
    for i in range(0, flat.size, _CHUNK_ELEMS):
        c = flat[i:i + _CHUNK_ELEMS]
        n += int(c.size - np.count_nonzero(np.isfinite(c)))
    return n


def weight_stats(w) -> dict:
    """{"mean", "std", "absmax", "nonfinite", "numel"} of a float array; NaN/Inf are counted, not averaged.

    float16 (every dequantized weight) goes through one parallel Numba pass on the bit patterns
    (``exl2fmt._stats``); other dtypes through chunked NumPy with float64 accumulation.
    """
    import numpy as np

    if np.asarray(w).dtype == np.float16:
        from ._stats import f16_stats

        return f16_stats(w)
    flat = np.asarray(w).reshape(-1)
    n = flat.size
    s = ss = 0.0
    amax = 0.0
    bad = 0
    for i in range(0, n, _CHUNK_ELEMS):
        c = flat[i:i + _CHUNK_ELEMS].astype(np.float32)
        fin = np.isfinite(c)
        nb = int(c.size - np.count_nonzero(fin))
        if nb:
            bad += nb
            c = c[fin]
        if c.size:
            s += float(c.sum(dtype=np.float64))
            ss += float(np.dot(c, c))
            amax = max(amax, float(np.abs(c).max()))
    m = n - bad
    mean = s / m if m else 0.0
    var = max(ss / m - mean * mean, 0.0) if m else 0.0
    return {"mean": mean, "std": math.sqrt(var), "absmax": amax, "nonfinite": bad, "numel": int(n)}


def compare_weights(w, ref) -> dict:
    """Relative Frobenius error, max abs error and cosine similarity of ``w`` against ``ref`` (same shape),
    accumulated in float64, chunk by chunk."""
    import numpy as np

    a = np.asarray(w).reshape(-1)
    b = np.asarray(ref).reshape(-1)
    ee = rr = ww = wr = 0.0
    mx = 0.0
    for i in range(0, a.size, _CHUNK_ELEMS):
        x = a[i:i + _CHUNK_ELEMS].astype(np.float64)
        y = b[i:i + _CHUNK_ELEMS].astype(np.float64)
        d = x - y
        ee += float(np.dot(d, d))
        rr += float(np.dot(y, y))
        ww += float(np.dot(x, x))
        wr += float(np.dot(x, y))
        if d.size:
            mx = max(mx, float(np.abs(d).max()))
    rel = math.sqrt(ee / rr) if rr > 0 else (0.0 if ee == 0 else math.inf)
    cos = wr / math.sqrt(ww * rr) if ww > 0 and rr > 0 else (1.0 if ww == rr == 0 else 0.0)
    return {"rel_fro": rel, "max_abs": mx, "cosine": cos}


# ------------------------------------------------------------------------------------------------ helpers


def _layer_bits_fractions(layer, fmt: str) -> dict[int, float]:
    if fmt == "exl2":
        per = layer.groups.rows_per_bits()
        k = sum(per.values())
        return {b: r / k for b, r in per.items()} if k else {}
    if fmt == "gptq":
        return {int(layer.bits): 1.0}
    return {16: 1.0}


_CONFIG_FIELDS = {
    "q_proj": ("hidden_size", "num_attention_heads x head_dim"),
    "k_proj": ("hidden_size", "num_key_value_heads x head_dim"),
    "v_proj": ("hidden_size", "num_key_value_heads x head_dim"),
    "o_proj": ("num_attention_heads x head_dim", "hidden_size"),
    "gate_proj": ("hidden_size", "intermediate_size"),
    "up_proj": ("hidden_size", "intermediate_size"),
    "down_proj": ("intermediate_size", "hidden_size"),
    "qkv_proj": ("hidden_size", "(num_attention_heads + 2 x num_key_value_heads) x head_dim"),
    "gate_up_proj": ("hidden_size", "2 x intermediate_size"),
    "w1": ("hidden_size", "intermediate_size"),
    "w3": ("hidden_size", "intermediate_size"),
    "w2": ("intermediate_size", "hidden_size"),
    "c_fc": ("hidden_size", "intermediate_size"),
    "c_proj": ("intermediate_size", "hidden_size"),
    "lm_head": ("hidden_size", "vocab_size"),
}


def _config_fields(key: str) -> tuple[str, str]:
    """The config.json fields that ``expected_features`` used for ``key`` (named in messages)."""
    f_in, f_out = _CONFIG_FIELDS.get(key.rsplit(".", 1)[-1], ("in_features", "out_features"))
    for part, field in ((".experts.", "moe_intermediate_size"), (".shared_expert.", "shared_expert_intermediate_size"),
                        (".shared_experts.", "moe_intermediate_size x n_shared_experts")):
        if part in key:
            f_in, f_out = (x.replace("intermediate_size", field) if "intermediate_size" in x and
                           "moe_" not in x else x for x in (f_in, f_out))
    return f_in, f_out
_EMBED = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings")


def _config_issues(config: dict, det, tensors, config_file: str) -> tuple[list[Issue], int]:
    """config.json <-> tensor shapes.  Returns (issues, number of comparisons made)."""
    from .arch import expected_features
    from .inspect import block_of
    from .layout import pad32

    issues: list[Issue] = []
    n = 0
    cfg = dict(config)
    if isinstance(config.get("text_config"), dict):
        cfg.update(config["text_config"])

    def cint(name):
        v = cfg.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    hidden, vocab, nl = cint("hidden_size"), cint("vocab_size"), cint("num_hidden_layers")
    for name, t in tensors.items():
        leaf_key = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and len(t.shape) == 2 and any(leaf_key.endswith(e) for e in _EMBED):
            rows, cols = t.shape
            if vocab is not None:
                n += 1
                if rows != vocab:
                    issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"embedding has {rows} rows but config.json "
                                        f"vocab_size is {vocab}", tensor=name, file=config_file))
            if hidden is not None:
                n += 1
                if cols != hidden:
                    issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"embedding has {cols} columns but config.json "
                                        f"hidden_size is {hidden}", tensor=name, file=config_file))
    for key, info in det.layers.items():
        k_exp, n_exp = expected_features(config, key)
        f_in, f_out = _config_fields(key)
        if k_exp is not None and info.in_features is not None:
            n += 1
            if info.in_features != k_exp:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"in_features {info.in_features} but config.json "
                                    f"{f_in} = {k_exp}", tensor=key, file=config_file))
        if n_exp is not None and info.out_features is not None:
            n += 1
            if info.format.value == "exl2":
                if info.out_features != pad32(n_exp):
                    issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"{info.out_features} stored columns (N_pad) but "
                                        f"config.json {f_out} = {n_exp} pads to {pad32(n_exp)}", tensor=key,
                                        file=config_file))
            elif info.out_features != n_exp:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"out_features {info.out_features} but config.json "
                                    f"{f_out} = {n_exp}", tensor=key, file=config_file))
    if nl is not None:
        blocks = {block_of(k) for k in det.layers if block_of(k) is not None}
        if blocks:
            n += 1
            if len(blocks) != nl:
                issues.append(Issue(ErrorCode.CONFIG_MISMATCH, f"the tensors hold {len(blocks)} decoder blocks but "
                                    f"config.json num_hidden_layers = {nl}", file=config_file))
    return issues, n


def _build_layer(model, info, config):
    """The layer object of a detected EXL2 / GPTQ / dense layer (lazy memory maps), with the hints config.json
    gives.  Like ``exl2fmt.model.load_layer`` but with the config already read (it may be invalid: None)."""
    from .arch import expected_features, gptq_config
    from .layers import layer_from_tensors
    from .layout import Format

    fmt = Format(info.format.value)
    tensors = {s: model.get(t.name) for s, t in info.slots.items()}
    dtypes = {s: t.dtype for s, t in info.slots.items()}
    files = {str(t.file) for t in info.slots.values()}
    file = files.pop() if len(files) == 1 else str(model.root)
    hints = {}
    if fmt is Format.EXL2:
        hints["out_features"] = expected_features(config, info.key)[1]
    elif fmt is Format.GPTQ:
        gc = gptq_config(config)
        hints.update(bits=gc.bits, v2=gc.v2, group_size=gc.group_size)
    return layer_from_tensors(info.key, tensors, dtypes, fmt=fmt, file=file, **hints)


def _awq_issues(info, file) -> list[Issue]:
    from .layout import RECOGNISED_LAYOUTS, AwqGeometry, SlotStatus

    issues = []
    slots = RECOGNISED_LAYOUTS["awq"]
    for s in slots:
        t = info.slots.get(s.name)
        if t is None:
            if s.status is SlotStatus.REQUIRED:
                issues.append(Issue(ErrorCode.SLOT_MISSING, f"required awq tensor '{s.name}' is missing",
                                    tensor=f"{info.key}.{s.name}", file=file))
        elif t.dtype not in s.dtypes:
            issues.append(Issue(ErrorCode.SLOT_DTYPE, f"dtype {t.dtype}; expected {' or '.join(s.dtypes)}",
                                tensor=t.name, file=t.file))
    if issues:
        return issues
    if info.bits not in (2, 3, 4, 8) or not info.groups or not info.in_features or info.in_features % info.groups:
        return [Issue(ErrorCode.SLOT_SHAPE, f"shapes give {info.bits} bits and {info.groups} groups for "
                      f"K = {info.in_features}; expected 4 bits (AWQ GEMM) and G dividing K",
                      tensor=f"{info.key}.qweight", file=file)]
    g = AwqGeometry(K=info.in_features, N=info.out_features, bits=info.bits, G=info.groups)
    for s in slots:
        t = info.slots.get(s.name)
        if t is not None and tuple(t.shape) != tuple(s.shape(g)):
            issues.append(Issue(ErrorCode.SLOT_SHAPE, f"shape {list(t.shape)}; expected {list(s.shape(g))} "
                                f"{s.shape_text}", tensor=t.name, file=t.file))
    return issues


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot write: {e.strerror or e}", file=str(path)) from None


# ------------------------------------------------------------------------------------------------ fix-index


def fix_index(path: str | os.PathLike) -> dict:
    """Write a correct ``model.safetensors.index.json`` for the model directory ``path``, atomically.

    The weight map is built from the headers of every ``*.safetensors`` file in the directory (what ExLlamaV2
    loads); ``metadata.total_size`` is the sum of tensor bytes.  Tensor files are never touched.  Raises
    ``DUPLICATE_TENSOR`` when a name occurs in two shards (no correct index exists), or the header error of a
    broken shard.  Returns {"path", "tensors", "shards", "total_size", "replaced"}.
    """
    from .container import INDEX_NAME, read_header

    d = Path(os.fspath(path))
    if not d.is_dir():
        raise Exl2Error(ErrorCode.USAGE, "--fix-index needs a model directory, not a file", file=str(d))
    try:
        files = sorted(q for q in d.glob("*.safetensors") if q.is_file())
    except OSError as e:
        raise Exl2Error(ErrorCode.IO_ERROR, f"cannot list the directory: {e.strerror or e}", file=str(d)) from None
    if not files:
        raise Exl2Error(ErrorCode.NO_SAFETENSORS, "expected at least one .safetensors file, found none", file=str(d))
    weight_map: dict[str, str] = {}
    total = 0
    for f in files:
        hdr = read_header(f)
        for name, t in hdr.tensors.items():
            if name in weight_map:
                raise Exl2Error(ErrorCode.DUPLICATE_TENSOR, f"in both {weight_map[name]} and {f.name}; remove one "
                                "copy before writing an index", tensor=name, file=str(f))
            weight_map[name] = f.name
            total += t.nbytes
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    out = d / INDEX_NAME
    replaced = out.exists()
    _atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    return {"path": str(out), "tensors": len(weight_map), "shards": len(files), "total_size": total,
            "replaced": replaced}


# ------------------------------------------------------------------------------------------------ validate


def _container_check_for(code: ErrorCode) -> CheckId:
    v = code.value
    if v.startswith("INDEX_") or v == "DUPLICATE_TENSOR":
        return CheckId.INDEX
    if v.startswith("CONFIG_"):
        return CheckId.CONFIG
    return CheckId.CONTAINER


def validate_model(path: str | os.PathLike, deep: bool = False, reference: str | os.PathLike | None = None,
                   strict: bool = False, progress: Progress | None = None, *, kernel: bool = False,
                   device: str | None = None, kernel_ms: tuple[int, ...] | None = None,
                   kernel_seed: int = 0, run: bool = False, prompt_ids: list[int] | None = None) -> Report:
    """Validate a ``.safetensors`` file or model directory; see the module docstring for the checks.

    ``reference`` implies ``deep``.  ``progress(done_bytes, total_bytes, what)`` is called during the data
    pass (and again, from 0, during the kernel pass).  ``kernel`` runs the EXL2 and 2/4/8-bit GPTQ layers through the Triton
    kernels on ``device`` ("cpu" = Triton's interpreter, "cuda", "cuda:N"; None = cuda when torch sees one, else
    cpu) with ``kernel_ms`` rows of x (default ``KERNEL_DEFAULT_MS`` of the device) drawn from ``kernel_seed``.
    ``run`` adds the forward pass of the module docstring on ``prompt_ids`` (None = the default sequence).
    Raises ``Exl2Error`` for inputs that cannot be read at all (missing path, not safetensors, I/O errors:
    category UNREADABLE), for an unreadable reference model, and ``KERNEL_UNAVAILABLE`` (before reading
    anything) when ``kernel`` or ``run`` is set but torch, triton or the device is missing; with ``run``,
    ``ARCH_UNSUPPORTED`` for a model type without a forward and ``USAGE`` for ids outside the vocabulary.
    """
    from .container import open_model
    from .inspect import is_gguf

    t0 = time.perf_counter()
    deep = bool(deep or reference is not None)
    rep = Report(path=str(path), deep=deep, reference=None if reference is None else str(reference), strict=strict)
    if is_gguf(path):
        raise Exl2Error(ErrorCode.UNSUPPORTED_INPUT, "validate checks safetensors models; this is a GGUF file "
                        "(exl2fmt inspect summarises it)", file=str(path))
    kernels = None
    if kernel or run:
        kernels = load_kernels(device, "--kernel" if kernel else "--run")
    if prompt_ids is not None and not run:
        raise Exl2Error(ErrorCode.USAGE, "prompt ids only apply with run (--run)")
    if kernel:
        ms = kernels.default_ms if kernel_ms is None else _check_ms(kernel_ms)
        rep.kernel = {"device": kernels.device, "interpreter": kernels.interpreted, "ms": list(ms),
                      "seed": int(kernel_seed)}
    try:
        model = open_model(path)
    except Exl2Error as e:
        if e.code.category is not Category.INVALID:
            raise
        rep.add(_container_check_for(e.code), Status.FAIL, e.code, e.message, tensor=e.tensor, file=e.file)
        rep.apply_strict()
        rep.seconds = time.perf_counter() - t0
        return rep
    try:
        run_spec = _run_preflight(model, prompt_ids) if run else None
        _validate_open(rep, model, Path(os.fspath(path)), deep, reference, progress,
                       kernels if kernel else None, run_spec, kernels if run else None)
    finally:
        model.close()
    rep.apply_strict()
    rep.seconds = time.perf_counter() - t0
    return rep


def _validate_open(rep: Report, model, path: Path, deep: bool, reference, progress, kernels=None, run_spec=None,
                   run_kernels=None) -> None:
    from .detect import ModelFormat, detect_model

    tensors = model.tensors
    first_file = str(model.files[0]) if model.files else str(path)
    rep.ok(CheckId.CONTAINER, PassCode.CONTAINER_OK,
           f"{len(model.files)} file(s), {len(tensors)} tensors: every header passes the hardened parser "
           "(size cap, UTF-8 JSON, no duplicate keys, contiguous in-range offsets, shape x dtype = bytes, "
           "complete data, no trailing bytes)", count=len(model.files))

    # --- index ------------------------------------------------------------------------------------------
    idx_issues = [i for i in model.index_issues() if i.code is not ErrorCode.SHARD_OUTSIDE_MODEL]
    for i in model.index_issues():
        if i.code is ErrorCode.SHARD_OUTSIDE_MODEL:  # where the bytes come from: a container matter
            rep.add_issue(CheckId.CONTAINER, i)
    for i in idx_issues:
        rep.add_issue(CheckId.INDEX, i)
    if model.index_path is not None:
        if not idx_issues:
            rep.ok(CheckId.INDEX, PassCode.INDEX_OK, f"index matches the shards both ways ({len(tensors)} tensors, "
                   f"{len(model.files)} shard(s), total_size right)", file=model.index_path)
    elif len(model.files) > 1:
        rep.add(CheckId.INDEX, Status.WARN, ErrorCode.INDEX_ABSENT, f"{len(model.files)} shards and no "
                "model.safetensors.index.json (third-party loaders need one; --fix-index writes it)",
                file=model.root)
    elif not idx_issues:
        rep.ok(CheckId.INDEX, PassCode.INDEX_OK, "single file: no index needed", file=first_file)

    # --- names ------------------------------------------------------------------------------------------
    from .inspect import has_control_chars

    bad_names = [n for n in tensors if has_control_chars(n)]
    for n in bad_names:
        rep.add(CheckId.NAMES, Status.FAIL, ErrorCode.NAME_CONTROL_CHARS,
                "tensor name contains control characters (shown escaped)", tensor=n, file=tensors[n].file)
    if not bad_names:
        rep.ok(CheckId.NAMES, PassCode.NAMES_OK, f"{len(tensors)} tensor names free of control characters",
               count=len(tensors))

    # --- config -----------------------------------------------------------------------------------------
    config = None
    config_file = str(model.config_path)
    try:
        config = model.config
    except Exl2Error as e:
        if e.code.category is Category.UNREADABLE:  # a FIFO, device or directory: exit 3 like any input
            raise
        rep.add(CheckId.CONFIG, Status.FAIL, e.code, e.message, tensor=e.tensor, file=e.file)
    else:
        if config is None and path.is_dir():
            rep.add(CheckId.CONFIG, Status.WARN, ErrorCode.CONFIG_MISSING,
                    "no config.json: architecture and sizes cannot be cross-checked", file=config_file)
    from .config_values import config_value_issues
    from .detect import quantization_config

    _qc, _qc_src = quantization_config(config, model.root)
    for i in config_value_issues(config, _qc, config_file if _qc_src in (None, "config.json") else
                                 str(Path(model.root) / _qc_src)):
        rep.add_issue(CheckId.CONFIG, i)

    # --- format -----------------------------------------------------------------------------------------
    det = detect_model(tensors, config, root=model.root, file=first_file)
    rep.format = det.format.value
    for i in det.issues:
        rep.add_issue(CheckId.FORMAT, i)
    if det.format is ModelFormat.UNKNOWN:
        rep.add(CheckId.FORMAT, Status.WARN, ErrorCode.FORMAT_UNKNOWN,
                "no linear layer of a known format (q_weight, qweight, trellis or a 2-D weight) found",
                file=first_file)
    elif det.format is ModelFormat.EXL3:
        rep.add(CheckId.FORMAT, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED,
                f"EXL3 model ({len(det.layers)} layers): recognised, but exl2fmt does not check EXL3 layers",
                file=first_file)
    elif not det.issues:
        rep.ok(CheckId.FORMAT, PassCode.FORMAT_OK, f"{det.label}: {len(det.layers)} linear layers, one format each",
               count=len(det.layers))
    if deep and any(l.format is ModelFormat.AWQ for l in det.layers.values()):
        rep.add(CheckId.FORMAT, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED,
                "AWQ layers are checked for shapes only: exl2fmt does not decode AWQ data", file=first_file)

    # --- config <-> shapes ------------------------------------------------------------------------------
    if isinstance(config, dict):
        issues, n = _config_issues(config, det, tensors, config_file)
        for i in issues:
            rep.add_issue(CheckId.CONFIG, i)
        if not issues and n:
            rep.ok(CheckId.CONFIG, PassCode.CONFIG_OK, f"config.json sizes (hidden, intermediate, vocab, heads, "
                   f"layers) match the tensor shapes ({n} comparisons)", count=n, file=config_file)

    # --- layers -----------------------------------------------------------------------------------------
    from .arch import gptq_config

    gc = gptq_config(config)
    passed: dict[str, int] = {}
    loaded = {}
    for key in sorted(det.layers, key=_natural):
        info = det.layers[key]
        fmt = info.format
        if fmt is ModelFormat.EXL3:
            continue
        layer = None
        if info.marker not in info.slots:
            issues = [Issue(ErrorCode.SLOT_MISSING, f"required {fmt.value} tensor '{info.marker}' is missing (the "
                            f"layer's other tensors are present)", tensor=f"{key}.{info.marker}",
                            file=next(iter(info.slots.values())).file)]
        elif fmt is ModelFormat.AWQ:
            issues = _awq_issues(info, first_file)
        else:
            try:
                layer = _build_layer(model, info, config)
                issues = layer.validate(deep=deep)
            except Exl2Error as e:
                issues, layer = [e.as_issue()], None
            if layer is not None and fmt is ModelFormat.GPTQ and not any(
                    i.severity is Severity.ERROR for i in issues) and gc.group_size is not None:
                want_g = 1 if gc.group_size == -1 else math.ceil(layer.K / gc.group_size)
                if layer.G != want_g:
                    issues.append(Issue(ErrorCode.SLOT_SHAPE, f"{layer.G} groups in qzeros/scales but config "
                                        f"group_size {gc.group_size} with K = {layer.K} gives {want_g}",
                                        tensor=f"{key}.scales", file=layer.file))
            if layer is not None and not any(i.severity is Severity.ERROR for i in issues):
                loaded[key] = layer
        for i in issues:
            rep.add_issue(CheckId.LAYERS, i)
        if not any(i.severity is Severity.ERROR for i in issues):
            passed[fmt.value] = passed.get(fmt.value, 0) + 1
    if passed:
        what = ", ".join(f"{n} {f}" for f, n in sorted(passed.items()))
        rules = "slots, dtypes, shapes"
        if "exl2" in passed:
            rules += ", q_groups bits/order/qrow/rows/limits, K"
            if deep:
                rules += ", q_invperm permutation, q_scale_max finite and >= 0"
        if "gptq" in passed:
            rules += ", GPTQ bits and groups" + (", g_idx range, v1 zeros" if deep else "")
        rep.ok(CheckId.LAYERS, PassCode.LAYERS_OK, f"{what} layer(s) valid ({rules})", count=sum(passed.values()))
    if (not deep and det.format is ModelFormat.GPTQ and det.variant.get("sym") is False
            and det.variant.get("version") == 1):
        rep.add(CheckId.LAYERS, Status.WARN, ErrorCode.GPTQ_ZEROS_AMBIGUOUS, "asymmetric GPTQ in the v1 zero "
                "convention: a zero field of 2**bits-1 is read differently by different tools (--deep counts them)",
                file=first_file)

    # --- bits -------------------------------------------------------------------------------------------
    if det.format is ModelFormat.EXL2:
        target = det.variant.get("target_bits")
        from .inspect import block_of

        dec = [l for l in det.layers.values() if l.format is ModelFormat.EXL2 and block_of(l.key) is not None
               and l.in_features and l.out_features]
        numel = sum(l.in_features * l.out_features + (l.out_features if l.has_bias else 0) for l in dec)
        if target is not None and numel:
            measured = sum(l.stored_bytes * 8 for l in dec) / numel
            if abs(measured - target) > BITS_TOLERANCE:
                rep.add(CheckId.BITS, Status.WARN, ErrorCode.BITS_MISMATCH, f"quantization_config.bits = {target} but "
                        f"the decoder linears measure {measured:.4f} bpw (overhead included; tolerance "
                        f"{BITS_TOLERANCE})", file=config_file)
            else:
                rep.ok(CheckId.BITS, PassCode.BITS_OK, f"quantization_config.bits = {target}; decoder linears "
                       f"measure {measured:.4f} bpw", file=config_file)

    if deep:
        _deep_pass(rep, model, det, loaded, reference, progress)
    if kernels is not None:
        _kernel_pass(rep, det, loaded, deep, kernels, progress)
    if run_kernels is not None:
        _run_pass(rep, model, det, loaded, deep, run_kernels, run_spec, progress)


def _natural(key: str):
    from .inspect import layer_order_key

    return layer_order_key(key)


def _deep_pass(rep: Report, model, det, loaded: dict, reference, progress) -> None:
    # tensors not belonging to a layer that was checked in depth: scan every float tensor for NaN/Inf
    # (the float tensors of EXL2 / GPTQ / dense layers are checked by the layers' own deep validation)
    from .detect import ModelFormat

    in_layers = set()
    for info in det.layers.values():
        if info.format in (ModelFormat.EXL2, ModelFormat.GPTQ, ModelFormat.DENSE):
            in_layers.update(t.name for t in info.slots.values())
    floats = [t for n, t in model.tensors.items() if n not in in_layers and t.dtype in ("F16", "BF16", "F32", "F64")]
    layer_bytes = {k: det.layers[k].stored_bytes for k in loaded}
    total = sum(t.nbytes for t in floats) + sum(layer_bytes.values())
    done = 0
    ref_model = None
    if reference is not None:
        from .container import open_model

        ref_model = open_model(reference)

    def tick(n, what):
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total, what)

    if progress is not None:
        progress(0, total, "")
    n_finite = 0
    for t in floats:
        try:
            bad = _nonfinite_count(model.get(t.name), t.dtype)
        except Exl2Error as e:
            rep.add(CheckId.FINITE, Status.FAIL, e.code, e.message, tensor=e.tensor, file=e.file)
        else:
            if bad:
                rep.add(CheckId.FINITE, Status.FAIL, ErrorCode.NONFINITE_VALUES, f"{bad} of {t.numel} values are "
                        "NaN or Inf", tensor=t.name, file=t.file)
            else:
                n_finite += 1
        tick(t.nbytes, t.name)
    if n_finite:
        rep.ok(CheckId.FINITE, PassCode.FINITE_OK, f"{n_finite} other floating-point tensor(s) (embeddings, norms, "
               "...) hold no NaN or Inf", count=n_finite)

    n_dec = n_ref = 0
    order = sorted(loaded, key=_natural)
    ahead = _Prefetcher()
    if order:
        ahead.want(det.layers[order[0]].slots.values())
    for idx, key in enumerate(order):
        if idx + 1 < len(order):  # let the kernel read the next layer while this one decodes
            ahead.want(det.layers[order[idx + 1]].slots.values())
        layer = loaded[key]
        fmt = det.layers[key].format.value
        res = LayerResult(key, fmt)
        rep.layers.append(res)
        # Without a reference to compare against, an EXL2 layer is decoded straight into statistics (same
        # values, no fp16 weight materialized: several times faster, so --deep keeps up with the disk).
        fused = ref_model is None and hasattr(layer, "stats")
        try:
            if fused:
                w = None
                res.stats = layer.stats()
                res.shape = [int(layer.out_features), int(layer.in_features)]
            else:
                w = layer.dequantize()
                res.shape = [int(x) for x in w.shape]
                res.stats = weight_stats(w)
        except Exl2Error as e:
            rep.add(CheckId.DECODE, Status.FAIL, e.code, e.message, tensor=e.tensor or key, file=e.file)
            tick(layer_bytes[key], key)
            continue
        if res.stats["nonfinite"]:
            rep.add(CheckId.DECODE, Status.FAIL, ErrorCode.NONFINITE_VALUES, f"the dequantized weight holds "
                    f"{res.stats['nonfinite']} NaN/Inf of {res.stats['numel']}", tensor=key, file=layer.file)
        else:
            n_dec += 1
        if ref_model is not None:
            n_ref += _compare_reference(rep, res, layer, fmt, w, ref_model, key)
        del w
        tick(layer_bytes[key], key)
    if n_dec:
        rep.ok(CheckId.DECODE, PassCode.DECODE_OK, f"{n_dec} layer(s) dequantize to finite float16 [out, in] "
               "(statistics in the layer list)", count=n_dec)
    if n_ref:
        rep.ok(CheckId.REFERENCE, PassCode.REFERENCE_OK, f"{n_ref} layer(s) within the per-bit-width error "
               f"threshold of the reference {reference}", count=n_ref)
    rep.bytes_read = done
    ahead.close()
    if ref_model is not None:
        ref_model.close()


class _Prefetcher:
    """Asks the kernel to read tensors ahead (posix_fadvise WILLNEED) so that disk reads overlap decoding.
    A no-op where posix_fadvise does not exist."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._ok = hasattr(os, "posix_fadvise")

    def want(self, infos) -> None:
        if not self._ok:
            return
        for t in infos:
            try:
                fd = self._fds.get(str(t.file))
                if fd is None:
                    fd = self._fds[str(t.file)] = os.open(t.file, os.O_RDONLY)
                if t.nbytes:
                    os.posix_fadvise(fd, t.abs_begin, t.nbytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # a hint only

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


def _compare_reference(rep: Report, res: LayerResult, layer, fmt: str, w, ref_model, key: str) -> int:
    from .layout import Format, marker_slot

    name = f"{key}.{marker_slot(Format.DENSE)}"
    ref_file = str(ref_model.root)
    if name not in ref_model:
        rep.add(CheckId.REFERENCE, Status.WARN, ErrorCode.LAYER_NOT_FOUND, f"the reference has no {name}; layer "
                "not compared", tensor=key, file=ref_file)
        return 0
    info = ref_model.info(name)
    if info.dtype not in ("F16", "BF16", "F32") or tuple(info.shape) != tuple(w.shape):
        rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"reference {info.dtype} "
                f"{list(info.shape)} cannot be compared with the dequantized float16 {list(w.shape)}",
                tensor=key, file=info.file)
        return 0
    ref = _to_f32(ref_model.get(name), info.dtype)
    m = compare_weights(w, ref)
    fr = _layer_bits_fractions(layer, fmt)
    thr = reference_threshold(fr)
    m["threshold"] = thr
    m["bits"] = {str(b): round(f, 6) for b, f in sorted(fr.items(), reverse=True)}
    res.reference = m
    if not (m["rel_fro"] <= thr):
        rep.add(CheckId.REFERENCE, Status.FAIL, ErrorCode.REFERENCE_MISMATCH, f"relative Frobenius error "
                f"{m['rel_fro']:.4f} exceeds the threshold {thr:.4f} for its bit widths (max abs "
                f"{m['max_abs']:.4g}, cosine {m['cosine']:.5f})", tensor=key, file=layer.file)
        return 0
    return 1


# ------------------------------------------------------------------------------------------------ kernel

#: Rows of x per device when ``kernel_ms`` is not given: on the CPU interpreter M = 1 (gemv path) and 16 (dot
#: path) keep the 15-layer sample model well under 30 s on 2 cores; on CUDA also 128 (dense path).
KERNEL_DEFAULT_MS: dict[str, tuple[int, ...]] = {"cpu": (1, 16), "cuda": (1, 16, 128)}
#: Largest M accepted (rows of the random x).
KERNEL_MAX_M = 4096
_DEVICE_RE = r"cpu|cuda(:[0-9]+)?"


@dataclass(frozen=True)
class KernelSetup:
    """The loaded Triton kernel module and where it runs (``load_kernels``)."""

    module: object
    device: str
    interpreted: bool

    @property
    def default_ms(self) -> tuple[int, ...]:
        return KERNEL_DEFAULT_MS["cpu" if self.interpreted else "cuda"]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_kernels(device: str | None = None, what: str = "--kernel") -> KernelSetup:
    """Import the Triton kernels for ``device`` ("cpu", "cuda", "cuda:N" or None = cuda when torch sees a CUDA
    device, else cpu); "cpu" selects Triton's interpreter (``exl2fmt.kernels.load_triton``), so call this before
    anything in the process imports triton (``what`` names the option in messages).  Raises ``Exl2Error``: USAGE for a malformed device name,
    KERNEL_UNAVAILABLE when torch or triton is missing, no CUDA device is visible, or triton is already loaded
    in the other mode."""
    import re

    dev = None if device is None else str(device).strip().lower()
    if dev is not None and not re.fullmatch(_DEVICE_RE, dev):
        raise Exl2Error(ErrorCode.USAGE, f"--device must be cpu, cuda or cuda:N, not {device!r}")
    try:
        from .kernels import available, load_triton

        missing = [k for k, ok in available().items() if not ok]
        if missing:
            raise Exl2Error(ErrorCode.KERNEL_UNAVAILABLE, f"{what} needs torch and triton "
                            f"({' and '.join(missing)} not installed): pip install 'exl2fmt[kernels]'")
        if dev is not None and dev.startswith("cuda"):
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            idx = int(dev.split(":")[1]) if ":" in dev else 0
            if idx >= n:
                raise Exl2Error(ErrorCode.KERNEL_UNAVAILABLE, f"--device {dev}: torch {torch.__version__} sees "
                                f"{n} CUDA device(s); --device cpu runs the kernels in Triton's interpreter (slow)")
        kt = load_triton(dev)
    except ImportError as e:
        raise Exl2Error(ErrorCode.KERNEL_UNAVAILABLE, f"{what} needs torch and triton, and importing them "
                        f"failed ({_one_line(e)}): pip install 'exl2fmt[kernels]'") from None
    except RuntimeError as e:
        raise Exl2Error(ErrorCode.KERNEL_UNAVAILABLE, _one_line(e)) from None
    interp = bool(kt.interpreted())
    if dev is None:
        dev = "cpu" if interp else "cuda"
    return KernelSetup(kt, dev, interp)


def _check_ms(ms) -> tuple[int, ...]:
    out = []
    for m in ms:
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= KERNEL_MAX_M:
            raise Exl2Error(ErrorCode.USAGE, f"kernel M values must be integers in 1..{KERNEL_MAX_M}, got {m!r}")
        if m not in out:
            out.append(m)
    if not out:
        raise Exl2Error(ErrorCode.USAGE, "give at least one kernel M value")
    return tuple(out)


def _kernel_layer(ks: KernelSetup, layer, ms: tuple[int, ...], seed: int) -> dict:
    """One EXL2 or GPTQ layer through the kernels against the Numba reference (``exl2fmt.kernels``'
    ``check_layer`` / ``check_gptq_layer``)."""
    from .layers import GptqLinear

    check = ks.module.check_gptq_layer if isinstance(layer, GptqLinear) else ks.module.check_layer
    return check(layer, ks.device, ms=ms, seed=seed)


#: GPTQ widths the kernels handle (codes that never straddle an int32 word); without importing the kernels.
_KERNEL_GPTQ_BITS = (2, 4, 8)


def _kernel_pass(rep: Report, det, loaded: dict, deep: bool, ks: KernelSetup, progress) -> None:
    """Every EXL2 layer, and every 2/4/8-bit GPTQ layer, that passed the structural checks through the kernels
    (module docstring)."""
    from .detect import ModelFormat

    ms = tuple(rep.kernel["ms"])
    seed = rep.kernel["seed"]

    def runnable(k) -> bool:
        f = det.layers[k].format
        return f is ModelFormat.EXL2 or (f is ModelFormat.GPTQ and k in loaded and
                                         getattr(loaded[k], "bits", None) in _KERNEL_GPTQ_BITS)

    order = [k for k in sorted(loaded, key=_natural) if runnable(k)]
    n_quant = sum(1 for k, l in det.layers.items() if l.format is ModelFormat.EXL2 or
                  (l.format is ModelFormat.GPTQ and (k not in loaded or runnable(k))))
    other: dict[str, int] = {}
    for k in loaded:
        f = det.layers[k].format
        if f is not ModelFormat.DENSE and not runnable(k):
            name = f"{loaded[k].bits}-bit gptq" if f is ModelFormat.GPTQ else f.value
            other[name] = other.get(name, 0) + 1
    for f, n in sorted(other.items()):
        rep.add(CheckId.KERNEL, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED, f"{n} {f} layer(s) not run: --kernel "
                f"covers EXL2 and {'/'.join(map(str, _KERNEL_GPTQ_BITS))}-bit GPTQ layers")
    if not n_quant:
        if not other:
            rep.add(CheckId.KERNEL, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED, "no EXL2 or GPTQ layer to run "
                    "through the kernels")
        return
    by_key = {l.key: l for l in rep.layers}
    sizes = {k: det.layers[k].stored_bytes for k in order}
    total = sum(sizes.values())
    done = 0
    if progress is not None:
        progress(0, total, "")
    n_ok = 0
    worst = 0.0
    seen: dict[int, set] = {}                      # M -> the kernel paths that ran
    where = f"{ks.device}" + (" (Triton interpreter)" if ks.interpreted else "")
    for key in order:
        layer = loaded[key]
        res = by_key.get(key)
        if res is None:
            res = LayerResult(key, det.layers[key].format.value, shape=[int(layer.out_features),
                                                                         int(layer.in_features)])
            rep.layers.append(res)
        run = True
        if not deep:  # the data invariants the kernels rely on (permutation, finite scales) were not checked yet
            for i in layer.validate(deep=True):
                if i.severity is Severity.ERROR:
                    rep.add(CheckId.KERNEL, Status.FAIL, i.code, f"not run through the kernels: {i.message}",
                            tensor=i.tensor or key, file=i.file)
                    run = False
        if run:
            try:
                kr = _kernel_layer(ks, layer, ms, seed)
            except Exl2Error as e:
                rep.add(CheckId.KERNEL, Status.FAIL, e.code, e.message, tensor=e.tensor or key, file=e.file)
            except (ValueError, RuntimeError) as e:  # the kernel wrapper or the device refused the layer
                rep.add(CheckId.KERNEL, Status.FAIL, ErrorCode.KERNEL_MISMATCH, f"the kernels failed on this "
                        f"layer ({where}): {type(e).__name__}: {_one_line(e)}", tensor=key, file=layer.file)
            else:
                res.kernel = kr
                for r in kr["results"]:
                    seen.setdefault(r["M"], set()).add(r["path"])
                bad = []
                if not kr["dequant_exact"]:
                    bad.append(f"dequantization differs from the reference in {kr['mismatches']} of "
                               f"{layer.in_features * layer.out_features} fp16 weights")
                for r in kr["results"]:
                    if not r["within_bound"]:
                        rel = "not finite" if r["max_rel_err"] is None else f"{r['max_rel_err']:.3e}"
                        bad.append(f"M={r['M']} ({r['path']}): {r['outside']} of {r['M'] * layer.out_features} "
                                   f"outputs outside the bound ({r['nonfinite']} NaN/Inf), max rel err {rel}")
                    elif r["max_rel_err"] is not None:
                        worst = max(worst, r["max_rel_err"])
                if bad:
                    rep.add(CheckId.KERNEL, Status.FAIL, ErrorCode.KERNEL_MISMATCH, f"Triton kernels on {where}: "
                            + "; ".join(bad), tensor=key, file=layer.file)
                else:
                    n_ok += 1
        done += sizes[key]
        if progress is not None:
            progress(done, total, key)
    if n_ok:
        paths = ", ".join(f"M={m} ({'/'.join(sorted(seen.get(m, ())))})" for m in ms)
        skipped = n_quant - len(order)
        note = f"; {skipped} layer(s) skipped: they failed the structural checks" if skipped else ""
        kinds = " and ".join(sorted({det.layers[k].format.value.upper() for k in order}))
        rep.ok(CheckId.KERNEL, PassCode.KERNEL_OK, f"{n_ok} {kinds} layer(s) through the Triton kernels on {where}: "
               f"dequantization bit-exact with the reference, every output of {paths} within the fp32-accumulation "
               f"bound; max rel err {worst:.2e}{note}", count=n_ok)


# ------------------------------------------------------------------------------------------------ run


def _run_preflight(model, prompt_ids) -> dict:
    """validate --run before any data is read: the architecture has a forward (else ``ARCH_UNSUPPORTED`` is
    raised) and the ids lie in the vocabulary (else ``USAGE``).  A config that cannot be read or is invalid is
    not raised here: it becomes a failed ``run`` check (the structural checks report it as well)."""
    from . import run_check as rc
    from .quant import forward as fw

    where = str(model.config_path)
    try:
        config = model.config
    except Exl2Error as e:
        return {"spec": None, "ids": None, "error": e}
    if not isinstance(config, dict):
        return {"spec": None, "ids": None, "error": Exl2Error(
            ErrorCode.CONFIG_MISSING, "--run needs config.json (architecture and sizes)", file=where)}
    try:
        spec = fw.ModelSpec.from_config(config)
    except Exl2Error as e:
        if e.code is ErrorCode.ARCH_UNSUPPORTED:
            raise Exl2Error(ErrorCode.ARCH_UNSUPPORTED, f"--run has no forward for this model: {e.message}",
                            file=e.file if e.file and e.file != "config.json" else where) from None
        return {"spec": None, "ids": None, "error": Exl2Error(e.code, e.message, file=where, tensor=e.tensor)}
    ids = rc.default_ids(spec.vocab_size) if prompt_ids is None else rc.check_ids(list(prompt_ids), spec)
    return {"spec": spec, "ids": ids, "source": "default" if prompt_ids is None else "prompt-ids", "error": None}


def _run_inputs(rep: Report, model, det, loaded: dict, deep: bool, spec) -> dict | None:
    """The layer objects the forward substitutes (EXL2 and GPTQ), after checking that every tensor it reads is
    present with the shape config.json implies; None (and FAIL checks) when the forward cannot run."""
    from .detect import ModelFormat
    from .layout import Format, marker_slot

    linear_keys = {spec.linear_key(i, n) for i in range(spec.num_layers)
                   for n in spec.attn_linears + spec.mlp_linears} | {"lm_head"}
    quant: dict = {}
    problems: list[tuple[ErrorCode, str, str]] = []
    wsuf = "." + marker_slot(Format.DENSE)
    for name, shape in spec.expected_tensors(None).items():
        key = name[: -len(wsuf)] if name.endswith(wsuf) else None
        if key in linear_keys and key in det.layers:
            info = det.layers[key]
            if info.format in (ModelFormat.EXL2, ModelFormat.GPTQ):
                layer = loaded.get(key)
                if layer is None:
                    problems.append((ErrorCode.LAYER_NOT_FOUND, "the forward needs this layer and it failed the "
                                     "structural checks (see the layers check)", key))
                    continue
                if (int(layer.out_features), int(layer.in_features)) != tuple(shape):
                    problems.append((ErrorCode.CONFIG_MISMATCH, f"config.json implies [out, in] = {list(shape)}, the "
                                     f"layer is [{layer.out_features}, {layer.in_features}]", key))
                    continue
                quant[key] = layer
                continue
            if info.format is not ModelFormat.DENSE:
                problems.append((ErrorCode.FORMAT_UNSUPPORTED, f"{info.format.value} layers cannot run in the "
                                 "forward (exl2fmt decodes EXL2, GPTQ and dense layers)", key))
                continue
        if name not in model:
            problems.append((ErrorCode.TENSOR_NOT_FOUND, f"the {spec.arch} forward needs this tensor", name))
        elif tuple(model.info(name).shape) != tuple(shape):
            problems.append((ErrorCode.CONFIG_MISMATCH, f"config.json implies shape {list(shape)}, found "
                             f"{list(model.info(name).shape)}", name))
    head = loaded.get("lm_head")
    if "lm_head" not in quant and head is not None and det.layers["lm_head"].format in (
            ModelFormat.EXL2, ModelFormat.GPTQ) and (int(head.out_features), int(head.in_features)) == (
            spec.vocab_size, spec.hidden_size):
        quant["lm_head"] = head  # tied embeddings but a quantized head stored: run the head that ships
    for key, layer in quant.items():
        if deep:
            continue  # the data invariants (permutation, finite scales, g_idx) were checked by the deep pass
        for i in layer.validate(deep=True):
            if i.severity is Severity.ERROR:
                problems.append((i.code, i.message, i.tensor or key))
    for code, msg, tensor in problems:
        rep.add(CheckId.RUN, Status.FAIL, code, f"forward not run: {msg}", tensor=tensor, file=model.root)
    return None if problems else quant


def _run_pass(rep: Report, model, det, loaded: dict, deep: bool, ks: KernelSetup, pre: dict, progress) -> None:
    """validate --run (module docstring; rules in ``exl2fmt.run_check``)."""
    where = f"{ks.device}" + (" (Triton interpreter)" if ks.interpreted else "")
    rep.run = {"device": ks.device, "interpreter": ks.interpreted, "activation_dtype": "float16",
               "ids_source": pre.get("source"), "arch": None}
    if pre["error"] is not None:
        e = pre["error"]
        rep.add(CheckId.RUN, Status.FAIL, e.code, f"forward not run: {e.message}", tensor=e.tensor, file=e.file)
        return
    spec = pre["spec"]
    rep.run["arch"] = spec.arch
    quant = _run_inputs(rep, model, det, loaded, deep, spec)
    if quant is None:
        return
    from . import run_check as rc
    from .quant import forward as fw

    total = sum(det.layers[k].stored_bytes for k in quant) or 1
    cb = None if progress is None else (lambda done, n, what: progress(int(total * done / n), total, what))
    if progress is not None:
        progress(0, total, "")
    try:
        res = rc.run_forward(spec, fw.WeightSource(model), quant, pre["ids"], kernels=ks.module, device=ks.device,
                             progress=cb)
    except rc.KernelCallError as e:
        rep.add(CheckId.RUN, Status.FAIL, ErrorCode.KERNEL_MISMATCH, f"the kernel failed on this layer during the "
                f"forward ({where}): {e}", tensor=e.key, file=model.root)
        return
    except Exl2Error as e:
        rep.add(CheckId.RUN, Status.FAIL, e.code, f"forward not run: {e.message}", tensor=e.tensor, file=e.file)
        return
    m = rc.run_metrics(res)
    rep.run.update(m)
    n = m["linears"]
    if n["gptq"]:
        rep.add(CheckId.RUN, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED, f"{n['gptq']} GPTQ layer(s) ran over their "
                "dequantized weights in both passes: the Triton kernel covers EXL2 only", file=model.root)
    if not n["exl2"]:
        rep.add(CheckId.RUN, Status.WARN, ErrorCode.FORMAT_UNSUPPORTED, "no EXL2 linear in the forward: the kernel "
                "was not exercised", file=model.root)
    bad = rc.verdict(m)
    for code, msg, key in bad:
        rep.add(CheckId.RUN, Status.FAIL, code, f"{msg} ({where}, {m['length']} ids)", tensor=key, file=model.root)
    k = m["kernel"]
    if not bad and n["exl2"] and k is not None:
        th = m["thresholds"]
        paths = sorted({c["path"] for c in m["calls"]})
        rep.ok(CheckId.RUN, PassCode.RUN_OK, f"{spec.arch} forward on {m['length']} ids, {n['exl2']} EXL2 linear(s) "
               f"through the Triton kernel ({'/'.join(paths)} path, {where}) vs the dequantized weights in float32: "
               f"max |logit diff| {k['max_abs_logit_diff']:.3g} (tolerance {th['max_abs_logit_diff']:.3g}; float16 "
               f"activations alone {m['fp16io']['max_abs_logit_diff']:.3g}), mean KL {k['mean_kl']:.3g} nats, "
               f"top-1 agreement {k['top1_agree']:.4g}; every kernel call within the fp32-accumulation bound",
               count=n["exl2"], file=model.root)


# ------------------------------------------------------------------------------------------------ oracle


def compare_with_oracle(path: str | os.PathLike, keys: list[str] | None = None) -> list[dict]:
    """Dequantize every EXL2 layer of a model with the Numba codec and with the slow NumPy oracle
    (``exl2fmt.codec.oracle``, no shared code) and compare the float16 results bit for bit.

    Returns one row per layer: {"key", "shape", "plan", "mismatches", "bit_exact", "seconds_fast",
    "seconds_oracle"}.  Meant for small models (the oracle is pure Python per element).
    """
    import numpy as np

    from .codec import oracle
    from .container import open_model
    from .detect import ModelFormat, detect_layers
    from .model import load_layer

    model = open_model(path)
    rows = []
    try:
        layers = detect_layers(model.tensors)
        todo = [k for k, l in layers.items() if l.format is ModelFormat.EXL2] if keys is None else list(keys)
        for key in sorted(todo, key=_natural):
            layer = load_layer(model, key)
            t0 = time.perf_counter()
            fast = layer.dequantize()
            t1 = time.perf_counter()
            t = layer.tensors
            slow = oracle.dequantize(np.asarray(t["q_weight"]), np.asarray(t["q_scale"]),
                                     np.asarray(t["q_scale_max"]), layer.groups.bits_rows(),
                                     np.asarray(t["q_invperm"]), out_features=layer.out_features)
            t2 = time.perf_counter()
            same_shape = fast.shape == slow.shape
            mism = int(np.count_nonzero(fast.view(np.uint16) != slow.view(np.uint16))) if same_shape else int(fast.size)
            rows.append({"key": key, "shape": [int(x) for x in fast.shape], "plan": layer.plan(),
                         "mismatches": mism, "bit_exact": same_shape and mism == 0,
                         "seconds_fast": t1 - t0, "seconds_oracle": t2 - t1})
    finally:
        model.close()
    return rows
