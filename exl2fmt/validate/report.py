"""The results of ``validate_model``: a ``Report`` of ``Check`` records (PASS / WARN / FAIL with a stable code)
and the per-layer ``LayerResult`` rows of the data passes.

A ``Check`` has a stable ``check`` id (``CheckId``: what was checked), a ``status`` and a stable ``code``: the
``ErrorCode`` value for WARN and FAIL, a ``PassCode`` value for PASS.  ``Report.as_dict`` is the ``--json``
document (``spec/`` documents its schema); nothing here reads a model.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable

from ..errors import Issue, Severity

__all__ = ["Status", "CheckId", "PassCode", "Check", "LayerResult", "Report", "Progress", "NOT_ESCALATED"]


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
    LOADER = "loader"


#: checks whose warnings ``--strict`` leaves warnings: they are about the software that reads the model, not about
#: the files (``loader``: the import transformers needs for a quant_method; a valid EXL2 model must pass --strict)
NOT_ESCALATED = frozenset({CheckId.LOADER.value})


class PassCode(str, enum.Enum):
    """The ``code`` of a passing check (one per check id, except ``loader``, which only warns; never an ErrorCode
    value)."""

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
    kernel: dict | None = None  # validate --kernel: see exl2fmt.validate.kernel

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
    run: dict | None = None  # validate --run: see exl2fmt.validate.run
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
            if c.status is Status.WARN and c.check not in NOT_ESCALATED:
                c.status = Status.FAIL
                c.escalated = True

    def as_dict(self) -> dict:
        from .. import __version__
        from ..inspect import SCHEMA_VERSION

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


#: ``progress(done, total, what)``: called during the data passes (bytes, or blocks for ``run``).
Progress = Callable[[int, int, str], None]
