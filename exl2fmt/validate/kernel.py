"""``validate --kernel``: every EXL2 (and 2/4/8-bit GPTQ) layer through the bundled Triton kernels against the
Numba reference (rules in ``exl2fmt.validate``'s docstring).  torch and triton are imported by ``load_kernels``
only, never at import time."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ErrorCode, Exl2Error, Severity
from .report import CheckId, LayerResult, PassCode, Report, Status

__all__ = ["KERNEL_DEFAULT_MS", "KERNEL_MAX_M", "KernelSetup", "load_kernels", "check_ms", "kernel_pass"]

#: Rows of x per device when ``kernel_ms`` is not given: on the CPU interpreter M = 1 (gemv path) and 16 (dot
#: path) keep the 15-layer sample model quick on a small CPU; on CUDA also 128 (dense path).
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
        from ..kernels import available, load_triton

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


def check_ms(ms) -> tuple[int, ...]:
    """``ms`` (kernel M values) as a tuple without repeats, or ``Exl2Error(USAGE)`` naming the bad value."""
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
    from ..formats import GptqLinear

    check = ks.module.check_gptq_layer if isinstance(layer, GptqLinear) else ks.module.check_layer
    return check(layer, ks.device, ms=ms, seed=seed)


#: GPTQ widths the kernels handle (codes that never straddle an int32 word); without importing the kernels.
_KERNEL_GPTQ_BITS = (2, 4, 8)


def kernel_pass(rep: Report, det, loaded: dict, deep: bool, ks: KernelSetup, progress) -> None:
    """Every EXL2 layer, and every 2/4/8-bit GPTQ layer, that passed the structural checks through the kernels
    (``exl2fmt.validate``'s docstring)."""
    from ..layout import Format
    from ..names import layer_order_key

    ms = tuple(rep.kernel["ms"])
    seed = rep.kernel["seed"]

    def runnable(k) -> bool:
        f = det.layers[k].format
        return f is Format.EXL2 or (f is Format.GPTQ and k in loaded and
                                         getattr(loaded[k], "bits", None) in _KERNEL_GPTQ_BITS)

    order = [k for k in sorted(loaded, key=layer_order_key) if runnable(k)]
    n_quant = sum(1 for k, l in det.layers.items() if l.format is Format.EXL2 or
                  (l.format is Format.GPTQ and (k not in loaded or runnable(k))))
    other: dict[str, int] = {}
    for k in loaded:
        f = det.layers[k].format
        if f is not Format.DENSE and not runnable(k):
            name = f"{loaded[k].bits}-bit gptq" if f is Format.GPTQ else f.value
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
