"""The one exception type of exl2fmt and its closed set of stable error codes.

Every problem exl2fmt can find in a file, a layer or a model has an ``ErrorCode``.
The code's value is the string printed by the CLI and written to ``--json``; it
never changes once released (new problems get new members, old ones are never
renamed).  Each code belongs to a ``Category`` which decides the CLI exit code:

* ``Category.USAGE``       -> exit 2 (the command line itself is wrong)
* ``Category.UNREADABLE``  -> exit 3 (the input cannot be opened or is not a supported kind of file)
* ``Category.INVALID``     -> exit 1 (the input was read and breaks a rule of the format)

Library code never uses ``assert`` to check file contents: it raises
``Exl2Error`` (fatal) or returns ``Issue`` records (collected by validators).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Category", "ErrorCode", "Severity", "Exl2Error", "Issue", "escape_name", "ci_defuse", "json_ci_defuse"]


class Category(str, enum.Enum):
    USAGE = "usage"
    UNREADABLE = "unreadable"
    INVALID = "invalid"


class ErrorCode(str, enum.Enum):
    """Stable error codes.  ``code.category`` gives the exit-code class, ``code.rule`` a one-line rule."""

    def __new__(cls, value: str, category: Category, rule: str):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.category = category
        obj.rule = rule
        return obj

    # --- input / usage ---------------------------------------------------------------------------
    USAGE = ("USAGE", Category.USAGE, "the command line is not valid")
    PATH_NOT_FOUND = ("PATH_NOT_FOUND", Category.UNREADABLE, "the path must exist")
    IO_ERROR = ("IO_ERROR", Category.UNREADABLE, "the file must be readable")
    UNSUPPORTED_INPUT = ("UNSUPPORTED_INPUT", Category.UNREADABLE,
                         "the input must be a .safetensors file or a directory of them")
    NO_SAFETENSORS = ("NO_SAFETENSORS", Category.UNREADABLE, "a model directory must hold at least one .safetensors file")
    OUTPUT_EXISTS = ("OUTPUT_EXISTS", Category.USAGE, "an existing output is only replaced with --force")

    # --- safetensors container (one file) --------------------------------------------------------
    HEADER_TOO_SMALL = ("HEADER_TOO_SMALL", Category.INVALID, "a safetensors file starts with an 8-byte header length")
    HEADER_TOO_LARGE = ("HEADER_TOO_LARGE", Category.INVALID, "the JSON header must not exceed the size cap")
    HEADER_PAST_EOF = ("HEADER_PAST_EOF", Category.INVALID, "the declared header length must fit inside the file")
    HEADER_NOT_UTF8 = ("HEADER_NOT_UTF8", Category.INVALID, "the header must be UTF-8")
    HEADER_NOT_JSON = ("HEADER_NOT_JSON", Category.INVALID, "the header must be one JSON object starting with '{'")
    DUPLICATE_KEY = ("DUPLICATE_KEY", Category.INVALID, "a JSON object in the header must not repeat a key")
    METADATA_INVALID = ("METADATA_INVALID", Category.INVALID, "__metadata__ must map strings to strings")
    TENSOR_ENTRY_INVALID = ("TENSOR_ENTRY_INVALID", Category.INVALID,
                            "a tensor entry needs dtype (string), shape (list of ints), data_offsets ([begin, end])")
    DTYPE_UNKNOWN = ("DTYPE_UNKNOWN", Category.INVALID, "the dtype must be one safetensors defines")
    SHAPE_INVALID = ("SHAPE_INVALID", Category.INVALID, "shape entries must be non-negative integers, at most 8 dims")
    OFFSETS_INVALID = ("OFFSETS_INVALID", Category.INVALID, "data_offsets must be two integers with 0 <= begin <= end")
    OFFSETS_GAP = ("OFFSETS_GAP", Category.INVALID, "tensor data must be contiguous from offset 0: no holes")
    OFFSETS_OVERLAP = ("OFFSETS_OVERLAP", Category.INVALID, "tensor data ranges must not overlap")
    SIZE_OVERFLOW = ("SIZE_OVERFLOW", Category.INVALID, "shape x dtype size must stay below 2**64 bytes")
    SIZE_MISMATCH = ("SIZE_MISMATCH", Category.INVALID, "end - begin must equal shape x dtype size")
    MISALIGNED_SLICE = ("MISALIGNED_SLICE", Category.INVALID, "a sub-byte tensor must end on a byte boundary")
    TRUNCATED = ("TRUNCATED", Category.INVALID, "the data buffer must be complete (file truncated?)")
    TRAILING_BYTES = ("TRAILING_BYTES", Category.INVALID, "nothing may follow the last tensor's data")
    TENSOR_NOT_FOUND = ("TENSOR_NOT_FOUND", Category.INVALID, "the named tensor must exist")
    NAME_CONTROL_CHARS = ("NAME_CONTROL_CHARS", Category.INVALID, "tensor names must not contain control characters")
    TOO_MANY_TENSORS = ("TOO_MANY_TENSORS", Category.INVALID, "a safetensors file must not hold more than the tensor-count cap")

    # --- model directory / index / config --------------------------------------------------------
    INDEX_INVALID = ("INDEX_INVALID", Category.INVALID,
                     "model.safetensors.index.json must be JSON with a weight_map of tensor -> shard file")
    INDEX_MISSING_SHARD = ("INDEX_MISSING_SHARD", Category.INVALID, "every shard named by the index must exist")
    INDEX_MISSING_TENSOR = ("INDEX_MISSING_TENSOR", Category.INVALID, "every indexed tensor must exist in its shard")
    INDEX_UNLISTED_TENSOR = ("INDEX_UNLISTED_TENSOR", Category.INVALID, "every shard tensor must be in the index")
    INDEX_TOTAL_SIZE = ("INDEX_TOTAL_SIZE", Category.INVALID, "metadata.total_size must equal the sum of tensor bytes")
    DUPLICATE_TENSOR = ("DUPLICATE_TENSOR", Category.INVALID, "a tensor name must appear in only one shard")
    CONFIG_INVALID = ("CONFIG_INVALID", Category.INVALID, "config.json must be a JSON object")
    CONFIG_MISMATCH = ("CONFIG_MISMATCH", Category.INVALID, "config.json dimensions must match the tensor shapes")

    # --- layer structure (all formats) ------------------------------------------------------------
    LAYER_NOT_FOUND = ("LAYER_NOT_FOUND", Category.INVALID, "the layer key must name a linear layer in the model")
    FORMAT_AMBIGUOUS = ("FORMAT_AMBIGUOUS", Category.INVALID, "a layer must hold the tensors of exactly one format")
    SLOT_MISSING = ("SLOT_MISSING", Category.INVALID, "every required tensor of the layer's format must be present")
    SLOT_DTYPE = ("SLOT_DTYPE", Category.INVALID, "every layer tensor must have the dtype the layout table allows")
    SLOT_SHAPE = ("SLOT_SHAPE", Category.INVALID, "every layer tensor must have the shape the layout table derives")
    NONFINITE_VALUES = ("NONFINITE_VALUES", Category.INVALID, "floating-point tensors must be finite")

    # --- EXL2 -------------------------------------------------------------------------------------
    GROUPS_BITS = ("GROUPS_BITS", Category.INVALID, "q_groups bit widths must be in {2,3,4,5,6,8}")
    GROUPS_ORDER = ("GROUPS_ORDER", Category.INVALID, "q_groups bit widths must be non-increasing and contiguous")
    GROUPS_QROW = ("GROUPS_QROW", Category.INVALID,
                   "q_groups qrow offsets must start at 0, increase strictly and stay inside q_weight")
    GROUPS_ROWS = ("GROUPS_ROWS", Category.INVALID, "every group must hold a whole multiple of 32 input rows")
    GROUPS_LIMIT = ("GROUPS_LIMIT", Category.INVALID, "K <= 65536, qrow, G and group rows <= 32767")
    K_MISMATCH = ("K_MISMATCH", Category.INVALID, "the rows of all groups must add up to len(q_invperm)")
    N_PADDING = ("N_PADDING", Category.INVALID, "q_weight columns must be N padded to a multiple of 32")
    PERM_INVALID = ("PERM_INVALID", Category.INVALID, "q_invperm must be a permutation of 0..K-1")
    PERM_MISMATCH = ("PERM_MISMATCH", Category.INVALID, "q_perm, when present, must equal argsort(q_invperm)")
    SCALE_MAX_INVALID = ("SCALE_MAX_INVALID", Category.INVALID, "q_scale_max must be finite and > 0")

    # --- GPTQ -------------------------------------------------------------------------------------
    GPTQ_BITS = ("GPTQ_BITS", Category.INVALID, "GPTQ bits must be 2, 3, 4 or 8 and match the tensor shapes")
    GPTQ_G_IDX = ("GPTQ_G_IDX", Category.INVALID, "g_idx values must lie in 0..G-1")
    GPTQ_ZEROS_AMBIGUOUS = ("GPTQ_ZEROS_AMBIGUOUS", Category.INVALID,
                            "a v1 (gptq) zero field equal to 2**bits-1 is read differently by different tools")

    # --- model-level checks of inspect / validate (appended; see exl2fmt/validate/) ------------------
    FORMAT_MISMATCH = ("FORMAT_MISMATCH", Category.INVALID,
                       "config.json quantization_config.quant_method must name the format the tensors are in")
    FORMAT_UNKNOWN = ("FORMAT_UNKNOWN", Category.INVALID, "the tensors should form linear layers of a known format")
    # UNREADABLE (exit 3, "unsupported input", as the README assigns): a format or architecture exl2fmt recognises
    # but does not convert; validate reports it as a check, never as a fatal error
    FORMAT_UNSUPPORTED = ("FORMAT_UNSUPPORTED", Category.UNREADABLE,
                          "layers of a recognised-only format (AWQ data) or variant (EXL3's legacy per-tensor "
                          "scale, EXL3's quantized token embeddings) are named but not checked in depth or decoded")
    BITS_MISMATCH = ("BITS_MISMATCH", Category.INVALID,
                     "quantization_config.bits should match the measured average bpw of the decoder linears")
    INDEX_ABSENT = ("INDEX_ABSENT", Category.INVALID,
                    "a sharded model should ship model.safetensors.index.json (--fix-index writes one)")
    CONFIG_MISSING = ("CONFIG_MISSING", Category.INVALID, "a model directory should hold config.json")
    REFERENCE_MISMATCH = ("REFERENCE_MISMATCH", Category.INVALID,
                          "a dequantized layer must match the reference model within its bit width's threshold")
    GGUF_INVALID = ("GGUF_INVALID", Category.INVALID,
                    "a .gguf file must be well-formed GGUF v2/v3 with bounded counts, strings and arrays")

    # --- validate --kernel (appended; see exl2fmt/validate/) -------------------------------------------
    KERNEL_MISMATCH = ("KERNEL_MISMATCH", Category.INVALID,
                       "the Triton kernel must dequantize a layer bit for bit like the reference and keep every "
                       "output of x @ W within the documented fp32-accumulation bound")
    KERNEL_UNAVAILABLE = ("KERNEL_UNAVAILABLE", Category.UNREADABLE,
                          "validate --kernel needs torch and triton (pip install 'exl2fmt[kernels]') and the "
                          "requested device")

    # --- quantizer inputs (appended; see exl2fmt/runner/model.py and quant/calib.py) -------------------
    ARCH_UNSUPPORTED = ("ARCH_UNSUPPORTED", Category.UNREADABLE,
                        "the model runner drives decoder-only causal LMs that transformers implements (no remote "
                        "code) with nn.Linear layers")
    CALIBRATION_INVALID = ("CALIBRATION_INVALID", Category.INVALID,
                           "calibration data must be .txt, .jsonl with a text field or token ids, and hold at "
                           "least rows x length tokens")

    # --- the quantizer (appended; see exl2fmt/quant) ------------------------------------------------
    MEASUREMENT_INVALID = ("MEASUREMENT_INVALID", Category.UNREADABLE,
                           "a measurement file must be ExLlamaV2 measurement.json for this model's layers")
    BUDGET_INFEASIBLE = ("BUDGET_INFEASIBLE", Category.USAGE,
                         "the target bits per weight must lie within what the candidate settings can reach")
    QUANT_NUMERICS = ("QUANT_NUMERICS", Category.INVALID,
                      "calibration activations and Hessians must be finite and factorizable")
    CHECKPOINT_INVALID = ("CHECKPOINT_INVALID", Category.UNREADABLE,
                          "a resume checkpoint must come from the same source, options and version")

    # --- validate --run (appended; see exl2fmt/validate/run.py) ------------------------------------
    RUN_MISMATCH = ("RUN_MISMATCH", Category.INVALID,
                    "a forward pass through the Triton kernel must give the logits of the forward over the "
                    "dequantized weights within the documented tolerance")

    # --- the quantizer's preflight (appended; see exl2fmt/quant/job.py) ----------------------------
    DISK_SPACE = ("DISK_SPACE", Category.USAGE,
                  "the destination's filesystem must have room for the quantizer's work files and the output")

    # --- number sanity of configs and GGUF metadata (appended; issue 11) ---------------------------------
    CONFIG_VALUE_INVALID = ("CONFIG_VALUE_INVALID", Category.INVALID,
                            "numbers in config.json and quantization_config must be plain, finite and within the "
                            "format's and sane model limits")
    GGUF_METADATA_INVALID = ("GGUF_METADATA_INVALID", Category.INVALID,
                             "GGUF hyper-parameters (block_count, widths, heads, experts, vocab) must be in range "
                             "and agree with what the file's tensors can hold")
    # --- hf:// models read by range (appended; see exl2fmt/hub/) ---------------------------------------
    HUB_NOT_FOUND = ("HUB_NOT_FOUND", Category.UNREADABLE,
                     "the Hub repository, revision and file must exist (a missing revision lists the branches)")
    HUB_ACCESS_DENIED = ("HUB_ACCESS_DENIED", Category.UNREADABLE,
                         "a private or gated Hub repository needs a token with access (HF_TOKEN)")
    HUB_UNREACHABLE = ("HUB_UNREACHABLE", Category.UNREADABLE,
                       "the Hub endpoint (HF_ENDPOINT) must be reachable and answer in time")
    HUB_BAD_RESPONSE = ("HUB_BAD_RESPONSE", Category.UNREADABLE,
                        "a byte-range request must be answered with exactly that range (206, matching "
                        "Content-Range, bounded body) and redirects only to http(s)")
    HUB_FETCH_LIMIT = ("HUB_FETCH_LIMIT", Category.UNREADABLE,
                       "reading a Hub model fetches at most the per-file cap (headers and q_groups only)")
    # --- model directory files (appended; see exl2fmt/container/reader.py) --------------------------
    SHARD_OUTSIDE_MODEL = ("SHARD_OUTSIDE_MODEL", Category.INVALID,
                           "a shard should lie inside the model directory (a symlink out of it is read, with a "
                           "warning naming the target)")
    # --- measurement reuse (appended; see exl2fmt/quant/qparams.py) ------------------------------------
    MEASUREMENT_MODEL_MISMATCH = ("MEASUREMENT_MODEL_MISMATCH", Category.USAGE,
                                  "a reused measurement must have been measured on this model (same layer count "
                                  "and layer shapes)")

    # --- EXL3 (appended; issue 39, see exl2fmt/formats/exl3.py and spec/exl3.md) -------------------------
    EXL3_RATE = ("EXL3_RATE", Category.INVALID,
                 "the EXL3 trellis last dim must be 16 x rate for a rate exllamav3 reads (1..8, 1.5, 2.5, 3.5)")
    EXL3_HALF_RATE = ("EXL3_HALF_RATE", Category.INVALID,
                      "an EXL3 layer at a half rate (1.5, 2.5, 3.5) must carry the mul1 codebook marker")
    EXL3_MARKER = ("EXL3_MARKER", Category.INVALID,
                   "an EXL3 codebook marker (mcg, mul1) must be the I32 scalar exllamav3 checks, and a layer has at "
                   "most one")
    EXL3_PADDING = ("EXL3_PADDING", Category.INVALID,
                    "EXL3 padded sizes (16 x trellis tiles) must be multiples of 128 that exceed the layer's "
                    "features by less than 128")

    # --- the runtime (appended; issue 35, see exl2fmt/runtime/ and exl2fmt/validate/structural.py) ---------
    TOKENIZER_MISSING = ("TOKENIZER_MISSING", Category.UNREADABLE,
                         "exl2fmt generate needs the model's tokenizer (tokenizer.json, or tokenizer.model with "
                         "tokenizer_config.json) in the model directory")
    CHAT_TEMPLATE_MISSING = ("CHAT_TEMPLATE_MISSING", Category.USAGE,
                             "--chat needs a tokenizer with a chat template")
    HF_NEEDS_IMPORT = ("HF_NEEDS_IMPORT", Category.INVALID,
                       "a quant_method transformers has no quantizer for loads only after the import that "
                       "registers one (import exl2fmt.hf); without it from_pretrained leaves the quantized "
                       "linears randomly initialised")

    PLACEMENT_INFEASIBLE = ("PLACEMENT_INFEASIBLE", Category.USAGE,
                            "a device_map must place every module on a device this machine has (or on 'disk' "
                            "with an offload folder), within max_memory")

    # --- the distributed quantizer (appended; issue 36, see exl2fmt/quant/distributed.py) -----------------
    CLUSTER_UNREACHABLE = ("CLUSTER_UNREACHABLE", Category.UNREADABLE,
                           "--ray-address must name the head (HOST:PORT) of a running Ray cluster that this "
                           "machine reaches")
    CLUSTER_MISMATCH = ("CLUSTER_MISMATCH", Category.UNREADABLE,
                        "every worker must run the driver's Ray, Python, exl2fmt, torch, transformers, numpy and "
                        "numba, and compute the driver's FP16 reference bits")
    WORKER_OUT_OF_MEMORY = ("WORKER_OUT_OF_MEMORY", Category.USAGE,
                            "a worker must have memory for one layer's working set (fewer workers per machine, "
                            "or a smaller --batch-tokens)")
    WORKER_LOST = ("WORKER_LOST", Category.UNREADABLE,
                   "a layer's task is re-run when its worker is lost, at most a few times")

    @classmethod
    def _missing_(cls, value):  # pragma: no cover - enum protocol
        return None


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Issue:
    """One finding of a validator.  ``tensor`` is the (raw, unescaped) tensor or layer name, if any."""

    code: ErrorCode
    message: str
    tensor: str | None = None
    file: str | None = None
    severity: Severity = Severity.ERROR

    def to_error(self) -> "Exl2Error":
        return Exl2Error(self.code, self.message, file=self.file, tensor=self.tensor)

    def as_dict(self) -> dict:
        return {"code": self.code.value, "severity": self.severity.value, "message": self.message,
                "tensor": self.tensor, "file": self.file}


class Exl2Error(Exception):
    """The only exception exl2fmt raises on bad input.

    ``code``   the stable ``ErrorCode``
    ``file``   the file the problem is in, when known
    ``tensor`` the tensor or layer name, when known (raw; use ``escape_name`` before printing)
    """

    def __init__(self, code: ErrorCode, message: str, *, file: str | None = None, tensor: str | None = None):
        self.code = ErrorCode(code)
        self.message = message
        self.file = None if file is None else str(file)
        self.tensor = tensor
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = []
        if self.file:
            where.append(escape_name(self.file))
        if self.tensor is not None:
            where.append(f"tensor {escape_name(self.tensor)!s}")
        prefix = f"{': '.join(where)}: " if where else ""
        return f"[{self.code.value}] {prefix}{escape_name(self.message)}"

    def as_issue(self) -> Issue:
        return Issue(self.code, self.message, tensor=self.tensor, file=self.file)

    def __reduce__(self):
        # picklable (a worker process of the distributed quantizer raises it to the driver)
        return (_rebuild_error, (self.code.value, self.message, self.file, self.tensor))


def _rebuild_error(code: str, message: str, file: str | None, tensor: str | None) -> "Exl2Error":
    return Exl2Error(ErrorCode(code), message, file=file, tensor=tensor)


def _escape_char(ch: str) -> str:
    o = ord(ch)
    if o <= 0xFF:
        return f"\\x{o:02x}"
    if o <= 0xFFFF:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def escape_name(text: str) -> str:
    """Make any string read from a file safe to print on a terminal (and in markdown, junit, ... output).

    Every character that is not printable text becomes a visible escape (``\\x1b``, ``\\u202e``,
    ``\\U000e0001``): C0/C1 controls and DEL, Unicode format characters (category Cf: bidi embeddings,
    overrides and isolates U+202A-U+202E / U+2066-U+2069, zero-width spaces and joiners, the BOM, tag
    characters), line and paragraph separators (Zl, Zp), spaces other than U+0020 (Zs), surrogates,
    private-use and unassigned code points - exactly the characters for which ``str.isprintable()`` is false.
    So a name cannot move the cursor, clear the screen, forge an extra output line or reorder what the
    reader sees.  Rich markup is not this function's business: the CLI prints through ``rich.text.Text`` with
    markup off, so ``[bold]`` stays literal.  JSON output uses the raw string (``json.dumps`` escapes).

    Then CI workflow commands are defused (``ci_defuse``): the GitHub Actions runner takes a log line that starts
    with ``::`` after its leading whitespace as a command (``::error ...::``, ``::add-mask::``,
    ``::stop-commands::``) and ``##[`` anywhere in a line as a legacy one (``##[error]``), on stdout and stderr.
    A leading ``::`` becomes ``\\u003a\\u003a`` and every ``##[`` becomes ``\\u0023#[``, so a name from a file can
    neither start a command nor carry one (the result has no line break, so it starts at most one line).
    """
    text = str(text)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)
    if "##[" in text or ("::" in text and text.lstrip(" ").startswith("::")):
        return ci_defuse(text)
    return text  # the common case: two substring scans at C speed


#: what ``ci_defuse`` writes for the first colon of a leading ``::`` and the first ``#`` of ``##[``
CI_COLON = "\\u003a"
CI_HASH = "\\u0023"


def ci_defuse(text: str) -> str:
    """``text`` (one line, already free of line breaks) with what a CI runner reads as a workflow command made
    visible: a ``::`` at its start (after spaces) becomes ``\\u003a\\u003a``, each ``##[`` becomes ``\\u0023#[``.
    ``escape_name`` applies it; JSON output keeps strings exact and uses ``json_ci_defuse`` instead."""
    if "##[" in text:
        text = text.replace("##[", CI_HASH + "#[")
    body = text.lstrip(" ")
    if body.startswith("::"):
        text = text[:len(text) - len(body)] + CI_COLON + CI_COLON + body[2:]
    return text


def json_ci_defuse(doc: str) -> str:
    """A JSON document with every ``##[`` written ``\\u0023#[``: the same JSON value (``##[`` can only occur inside
    a string, where ``\\u0023`` is ``#``), but no line a CI runner takes for a legacy workflow command.  (No line
    of indented or compact JSON starts with ``::``.)"""
    return doc.replace("##[", CI_HASH + "#[") if "##[" in doc else doc
