"""The options of ``convert`` / ``quantize``, one table per target, and the checks that need no file.

Each ``Option`` names its keyword, the command-line flag that sets it (messages name the flag a user typed) and
the targets it applies to.  The argument checks (``check_arguments``, ``no_quantizer_options``) and the
``exl2fmt convert`` command (``exl2fmt.cli.convert``: which parameters become ``quant=`` keys, and how) both read
these tables, so an option added here is refused by its own flag wherever it does not apply.

``check_bits`` is the one check of ``bits``; the allowed widths come from the layout table
(``layout.GPTQ_BITS``, ``layout.EXL2_BITS``).

Standard library only (the CLI reads the tables at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ErrorCode, Exl2Error
from ..layout import EXL2_BITS, GPTQ_BITS

__all__ = ["Option", "QUANTIZING", "DEFAULT_SHARD_SIZE", "CONVERT_OPTIONS", "QUANT_OPTIONS", "QUANT_FLAGS", "VERIFY_MODES", "ALIASES",
           "normalize_target", "check_arguments", "check_bits", "no_quantizer_options", "refusal", "convert_option"]

#: Default maximum tensor bytes per output shard (Hugging Face's "5GB").
DEFAULT_SHARD_SIZE = 5_000_000_000
#: the targets the quantizer writes (from an FP16/BF16 model; EXL2 <-> GPTQ re-pack)
QUANTIZING = ("exl2", "gptq")
#: ``convert(verify=...)``: ``auto`` (the default checks) or ``full`` (every unit decoded again from SRC)
VERIFY_MODES = ("auto", "full")
#: spellings of the targets and dtypes that mean the same
ALIASES = {"float16": "fp16", "half": "fp16", "f16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Option:
    """One option: ``key`` (the keyword; for the quantizer's options the ``quant=`` key), ``flag`` (the
    command-line flag), ``targets`` (where it applies), ``param`` (the ``convert`` command's parameter when its
    name differs from ``key``), ``from_cli`` (how that parameter's value becomes the option's; None: as it is),
    ``refused`` (the message for a target it does not apply to, when not the usual one)."""

    key: str
    flag: str
    targets: tuple[str, ...] = QUANTIZING
    param: str = ""
    from_cli: Callable | None = None
    refused: str = ""

    @property
    def parameter(self) -> str:
        return self.param or self.key


def _not(v):
    return not v


#: ``convert``'s own options (besides SRC, DST and the target) and where they apply
CONVERT_OPTIONS: tuple[Option, ...] = (
    Option("bits", "--bits"),
    Option("group_size", "--group-size"),
    Option("sym", "--sym/--asym", targets=("gptq",)),
    Option("dtype", "--dtype", refused="--dtype applies only to --to exl2 or gptq (the unquantized tensors); "
                                       "--to {target} already names the dtype"),
    Option("gguf_type", "--gguf-type", targets=("gguf",)),
    Option("shard_size", "--shard-size", targets=("fp16", "bf16", "gptq", "exl2"),
           refused="--shard-size does not apply to --to {target} (one file)"),
)

#: the quantizer's options (``quant=`` / ``quantize(**options)``): FP16/BF16 -> exl2 / gptq only
QUANT_OPTIONS: tuple[Option, ...] = (
    Option("head_bits", "--head-bits"),
    Option("calibration", "--calibration"),
    Option("rows", "--rows"),
    Option("length", "--length"),
    Option("measurement", "--measurement"),
    Option("save_measurement", "--save-measurement"),
    Option("device", "--device"),
    Option("seed", "--seed"),
    Option("resume", "--resume"),
    Option("act_order", "--act-order/--no-act-order"),
    Option("order", "--order"),
    Option("work_dir", "--work-dir"),
    Option("extended", "--upstream-tables", param="upstream_tables", from_cli=_not),
    Option("refine_scales", "--refine-scales/--upstream-scales"),
    Option("block_gain", "--block-gains", targets=("exl2",), param="block_gains"),
    Option("batch_tokens", "--batch-tokens"),
    Option("measure_rows", "--measure-rows"),
    Option("measure_search", "--measure-search"),
    Option("measure_precision", "--measure-precision"),
    # (EXL2: the measurement and the quantize pass's independent groups; GPTQ: its quantize pass's)
    Option("workers", "--workers"),
    Option("ray_address", "--ray-address"),
    Option("shared_fs", "--shared-fs/--no-shared-fs"),
)

#: the quantizer's options by the command-line flag that sets them, for messages
QUANT_FLAGS = {o.key: o.flag for o in QUANT_OPTIONS}
_CONVERT = {o.key: o for o in CONVERT_OPTIONS}


def _either(targets: tuple[str, ...]) -> str:
    return targets[0] if len(targets) == 1 else f"{', '.join(targets[:-1])} or {targets[-1]}"


def _widths(bits: tuple[int, ...]) -> str:
    b = sorted(bits)
    return f"{', '.join(map(str, b[:-1]))} or {b[-1]}"


def convert_option(key: str) -> Option:
    """The entry of ``CONVERT_OPTIONS`` for ``key``."""
    return _CONVERT[key]


def refusal(key: str, target: str) -> Exl2Error:
    """``Exl2Error(USAGE)`` for ``convert``'s option ``key`` given to a ``target`` it does not apply to."""
    o = _CONVERT[key]
    msg = (o.refused or "{flag} applies only to --to {targets}, not --to {target}").format(
        flag=o.flag, targets=_either(o.targets), target=target)
    return Exl2Error(ErrorCode.USAGE, msg)


def normalize_target(to) -> str:
    """``to`` lower-cased, aliases resolved (``float16`` -> ``fp16``); not checked."""
    target = str(to).strip().lower()
    return ALIASES.get(target, target)


def check_bits(target: str, bits, source: str | None = None):
    """The one check of ``bits``; returns it (an int for a re-pack).  Without ``source`` (before SRC is read): a
    number, for a quantizing target, one of ``layout.GPTQ_BITS`` for GPTQ, within EXL2's [2, 8.5] bits per
    weight.  With the detected ``source`` of a re-pack (EXL2 / GPTQ -> exl2 / gptq): an integer, and one of
    ``layout.EXL2_BITS`` for -> exl2."""
    if bits is None:
        return None
    if source is not None:
        if not float(bits).is_integer():
            raise Exl2Error(ErrorCode.USAGE, f"bits must be an integer for {source} -> {target}, got {bits!r}")
        if target == "exl2" and int(bits) not in EXL2_BITS:
            raise Exl2Error(ErrorCode.USAGE, f"--bits for {source} -> exl2 must be {_widths(EXL2_BITS)}, got "
                            f"{bits!r}")
        return int(bits)
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise Exl2Error(ErrorCode.USAGE, f"bits must be a number, got {bits!r}")
    if target not in QUANTIZING:
        raise refusal("bits", target)
    if target == "gptq" and float(bits) not in {float(b) for b in GPTQ_BITS}:
        raise Exl2Error(ErrorCode.USAGE, f"--bits for --to gptq must be {_widths(GPTQ_BITS)}, got {bits!r}")
    if target == "exl2" and not (2.0 <= float(bits) <= 8.5):
        raise Exl2Error(ErrorCode.USAGE, f"--bits for --to exl2 must lie in [2, 8.5], got {bits!r}")
    return bits


def check_arguments(target: str, bits, group_size, sym, dtype, gguf_type) -> None:
    """The checks that need no file: types, ranges, and options that do not apply to ``target``."""
    check_bits(target, bits)
    if group_size is not None:
        if target not in _CONVERT["group_size"].targets:
            raise refusal("group_size", target)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or \
                (group_size != -1 and (group_size <= 0 or group_size % 32)) or (target == "exl2" and group_size == -1):
            raise Exl2Error(ErrorCode.USAGE, f"--group-size must be a positive multiple of 32"
                            f"{' or -1' if target == 'gptq' else ''}, got {group_size!r}")
    if sym is not None and target not in _CONVERT["sym"].targets:
        raise refusal("sym", target)
    if dtype is not None:
        d = ALIASES.get(str(dtype).lower(), str(dtype).lower())
        if d not in ("fp16", "bf16"):
            raise Exl2Error(ErrorCode.USAGE, f"dtype must be fp16 or bf16, got {dtype!r}")
        if target not in _CONVERT["dtype"].targets:
            raise refusal("dtype", target)
    if gguf_type not in (None, "auto") and target not in _CONVERT["gguf_type"].targets:
        raise refusal("gguf_type", target)


def no_quantizer_options(quant: dict | None, why: str) -> None:
    """``Exl2Error(USAGE)`` naming, by their flags, the quantizer options given (not None) where nothing is
    quantized (``why`` says what is done instead)."""
    given = sorted(k for k, v in (quant or {}).items() if v is not None)
    if given:
        flags = ", ".join(QUANT_FLAGS.get(k, k) for k in given)
        raise Exl2Error(ErrorCode.USAGE, f"{flags} only appl{'ies' if len(given) == 1 else 'y'} when quantizing an "
                        f"FP16/BF16 model (--to exl2 or gptq); {why}")
