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
``loader``     a WARN (``HF_NEEDS_IMPORT``) when ``quantization_config.quant_method`` is one transformers has no
               quantizer for (``exl2``, ``exl3``), naming the import that registers one (``import exl2fmt.hf``);
               ``--strict`` does not escalate it (it is about the runtime, not the files)
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

``run=True`` (``exl2fmt validate --run``; every decoder-only architecture transformers implements, through the
model runner ``exl2fmt.runner.model``) runs one sequence of token ids (``prompt_ids``, default
``exl2fmt.validate.run.default_ids``) through the whole model three times, layer by layer side by side: every EXL2 linear (decoder and ``lm_head``) through the Triton kernel; as the reference, over its
dequantized float16 weights in float32; and a float16-I/O replay of the reference (``run``): every kernel call
within the fp32-accumulation bound on the forward's own activations (else ``KERNEL_MISMATCH``), and the logits
within a tolerance derived from the float16-I/O replay (max |logit difference|, mean KL, top-1; else
``RUN_MISMATCH``).  Rules and numbers in ``exl2fmt.validate.run``; results in ``Report.run``.  An architecture the runner cannot drive raises ``ARCH_UNSUPPORTED``, ids outside
the vocabulary ``USAGE``, both before any tensor data is read.

Exit status (``Report.exit_code``): 0 when nothing failed (warnings allowed unless ``strict``), 1 otherwise.
Inputs that cannot be read at all raise ``Exl2Error`` (exit 3 in the CLI); a malformed header is reported
as a failed ``container`` check.

Rooms of this package (each imports ``report`` and the core, never the CLI):

=================  ==========================================================================================
``report``         ``Status``, ``CheckId``, ``PassCode``, ``Check``, ``LayerResult``, ``Report`` (the ``--json`` doc)
``structural``     container, index, names, config, format, layers and bits checks (headers only)
``config_checks``  config.json sizes vs tensor shapes; ``awq``: AWQ shapes
``statistics``     NaN/Inf counts, weight statistics, error metrics (NumPy, chunked)
``deep``           ``deep`` / ``reference``: the data pass and its per-bit-width thresholds
``kernel``         ``kernel``: the Triton kernels against the reference (``load_kernels``)
``run``            ``run``: the whole-model forward (imports torch; loaded only when ``run`` is set)
``write_index``    ``fix_index``: the one function here that writes a file
``oracle``         ``compare_with_oracle``: Numba codec vs the NumPy oracle, bit for bit
``remote``         ``validate_hub`` / ``reference_shape_checks``: hf:// models and ``--reference hf://``
                   (headers read by ``exl2fmt.hub``)
=================  ==========================================================================================

Example (the bundled sample model, structural checks only)::

    >>> import tempfile
    >>> from exl2fmt.sample import write_sample
    >>> from exl2fmt.validate import validate_model
    >>> d = tempfile.mkdtemp()
    >>> _ = write_sample(d)
    >>> report = validate_model(d)
    >>> report.exit_code, report.format, report.counts()["fail"]
    (0, 'exl2', 0)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import Category, ErrorCode, Exl2Error
from .deep import REFERENCE_THRESHOLDS, reference_threshold
from .kernel import KERNEL_DEFAULT_MS, KernelSetup, check_ms, load_kernels
from .oracle import compare_with_oracle
from .report import Check, CheckId, LayerResult, PassCode, Progress, Report, Status
from .statistics import compare_weights, weight_stats
from .structural import BITS_TOLERANCE, container_check_for, structural_checks
from .write_index import fix_index

__all__ = ["Status", "CheckId", "PassCode", "Check", "LayerResult", "Report", "validate_model", "fix_index",
           "REFERENCE_THRESHOLDS", "reference_threshold", "BITS_TOLERANCE", "weight_stats", "compare_weights",
           "KernelSetup", "load_kernels", "KERNEL_DEFAULT_MS", "check_ms", "compare_with_oracle", "Progress"]


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
    from ..container import open_model
    from ..inspect import is_gguf

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
        ms = kernels.default_ms if kernel_ms is None else check_ms(kernel_ms)
        rep.kernel = {"device": kernels.device, "interpreter": kernels.interpreted, "ms": list(ms),
                      "seed": int(kernel_seed)}
    try:
        model = open_model(path)
    except Exl2Error as e:
        if e.code.category is not Category.INVALID:
            raise
        rep.add(container_check_for(e.code), Status.FAIL, e.code, e.message, tensor=e.tensor, file=e.file)
        rep.apply_strict()
        rep.seconds = time.perf_counter() - t0
        return rep
    try:
        run_spec = None
        if run:
            from .run import run_preflight

            run_spec = run_preflight(model, prompt_ids, kernels.device)
        _validate_open(rep, model, Path(os.fspath(path)), deep, reference, progress,
                       kernels if kernel else None, run_spec, kernels if run else None)
    finally:
        model.close()
    rep.apply_strict()
    rep.seconds = time.perf_counter() - t0
    return rep


def _validate_open(rep: Report, model, path: Path, deep: bool, reference, progress, kernels=None, run_spec=None,
                   run_kernels=None) -> None:
    """The structural checks, then the data, kernel and run passes that were asked for, in that order."""
    det, loaded = structural_checks(rep, model, path, deep)
    if deep:
        from .deep import deep_pass

        deep_pass(rep, model, det, loaded, reference, progress)
    if kernels is not None:
        from .kernel import kernel_pass

        kernel_pass(rep, det, loaded, deep, kernels, progress)
    if run_kernels is not None:
        from .run import run_pass

        run_pass(rep, model, det, loaded, deep, run_kernels, run_spec, progress)
