"""EXL2 / GPTQ / dense Hugging Face models (the architectures of ``gguf_arch``) -> one GGUF file that llama.cpp runs.

``convert_to_gguf(src, dst, gguf_type=...)`` (reached through ``exl2fmt.converters.convert(..., to="gguf")``):

1. Plan: every source tensor gets its GGUF name from the ``gguf`` package's table (``converters.gguf_map``)
   and a GGUF type: 1-D tensors (norms, biases) F32; 2-D weights the chosen type (``f32``, ``f16``, ``bf16``,
   ``q8_0``, ``q6_k``, ``q5_k``, ``q5_1``, ``q5_0``, ``q4_k``, ``q4_1``, ``q4_0``, ``iq4_nl``, ``q3_k``, ``q2_k``; a quantized
   type falls back to F16 for a row length that is not a multiple of 32, as llama.cpp's converter does, and a
   K-quant to a 32-weight type for one that is not a multiple of 256, as llama.cpp's quantizer does).  ``auto`` (the default) keeps a dense model's dtype
   (BF16 stays BF16, the rest F16); for a GPTQ model it picks Q4_0 when every quantized layer's integers fit
   Q4_0 (GPTQ symmetric <= 4 bits, groups a multiple of 32 rows, no act-order), Q8_0 when they fit Q8_0.  Any
   other quantized model (EXL2, other GPTQ) is written near its own size (issue 40): each quantized layer gets
   ``sized_type`` of its stored bits per weight, the cheapest type whose bits per weight are >= the layer's:
   a K-quant (Q2_K .. Q6_K, then Q8_0) for rows of 256k weights, else IQ4_NL / Q4_1 / Q5_0 / Q5_1 / Q8_0, F16
   above 8.5 or for a row length no block divides; an EXL2 layer that repacks exactly into Q4_0 keeps Q4_0.
   Those blocks are fitted by the scale search of ``codec.ggml_quant`` (``q2_k`` .. ``q6_k``, ``iq4_nl`` too).  ``f16``
   is the exact path (F16 holds any EXL2/GPTQ reconstruction exactly).  Unquantized tensors of a quantized
   model stay F16/BF16 under ``auto``.
2. Write, tensor by tensor (memory: about one layer): the header, metadata and tensor table are written first
   (``GGUFWriter.add_tensor_info``: every shape and type is known), then each tensor's data as soon as it is
   produced.  Q/K rows are permuted for the ``llama`` arch (``gguf_map.permute_qk``).
3. Quantized layers to Q8_0 / Q4_0 are *repacked* where the math allows: a 32-element block (one output row,
   32 consecutive input features) whose source weights share one fp16 scale ``d`` and whose integers fit the
   target (Q8_0: -128..127; Q4_0: -8..7) is stored as exactly those integers and ``d``.  Its float32 decode is
   then ``d * q``, exactly the real value the source encodes, and its fp16 rounding equals the source's fp16
   reconstruction bit for bit (EXL2 and GPTQ both compute ``fp16(q * d)`` with ``q`` exact).  Every other block
   is quantized with ``gguf.quants`` from the source's fp16 reconstruction.  A layer is reported *exact* when
   every element of its decode, rounded to fp16, equals the source reconstruction; otherwise its relative and
   max error are reported.  GPTQ symmetric 4-bit with groups of 32k rows and trivial ``g_idx`` -> Q4_0, and
   GPTQ symmetric 8-bit (or <= 7-bit) -> Q8_0, are exact.  EXL2 layers are exact only where a block lies in
   one group of one scale, which EXL2's input permutation rarely allows.  Stacked experts (``[E, N, K]``) are
   repacked the same way, expert by expert, and each quantized expert is a layer of the report.
4. Verify: the temporary file (in ``.<name>.exl2fmt-partial-<hex>/`` next to DST) is re-read through exl2fmt's
   bounded GGUF reader (``exl2fmt.gguf_scan``; ``gguf.GGUFReader`` too with ``verify="full"``); names, types and
   shapes must be the planned ones, every tensor's bytes must
   match the CRC-32 of what was produced, and the key hyper-parameters must read back.  ``verify="full"``
   also decodes every layer from the file again and compares it with a fresh decode of SRC.  Then the file is
   renamed to DST (an existing DST only with ``force``).  SRC is only read.

Metadata: the hyper-parameters from ``config.json`` (block count, context length, widths, heads, rms eps,
rope base and dimension, key/value length when ``head_dim`` is explicit, vocab size, linear rope scaling) and
the tokenizer (``converters.gguf_vocab``).

The modules: ``gguf_plan`` (step 1: names, types, the per-tensor producers), ``gguf_blocks`` (the block numerics
of steps 1 and 3), ``gguf_meta`` (the metadata), ``gguf_check`` (step 4), and this one (the entry point and the
write, in a staged output: ``exl2fmt.container.staging``).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np

from ..container import SourceReader
from ..container.publish import check_paths
from ..container.staging import staged_output
from ..errors import ErrorCode, Exl2Error
from .base import ConversionReport
from .gguf_check import Digest, verify_gguf
from .gguf_io import ggml_type
from .gguf_map import arch_of
from .gguf_meta import staged_inputs, write_metadata
from .gguf_plan import SIZED, auto_type, hparams, plan_items, sized_summary

__all__ = ["convert_to_gguf", "GGUF_TYPES"]

#: --gguf-type values
GGUF_TYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "iq4_nl",
              "q3_k", "q2_k")

def convert_to_gguf(src, dst, *, gguf_type: str = "auto", force: bool = False, progress=None,
                    verify: str = "auto", _fail_after: int | None = None) -> ConversionReport:
    """Convert the model directory (or .safetensors file) ``src`` into the GGUF file ``dst``; see the module
    docstring.  Returns a ``ConversionReport`` (target ``gguf``); raises ``Exl2Error``."""
    import gguf

    from ..container import open_model
    from ..detect import detect_model
    from ..layout import Format

    t_start = time.perf_counter()
    gt = str(gguf_type or "auto").lower()
    if gt not in GGUF_TYPES:
        raise Exl2Error(ErrorCode.USAGE, f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    src_p, dst_p = Path(os.fspath(src)), Path(os.fspath(dst))
    model = open_model(src)
    reader = SourceReader(model)
    try:
        check_paths(src_p, dst_p, force, kind="gguf")
        if dst_p.is_dir():
            raise Exl2Error(ErrorCode.USAGE, "the GGUF destination is a directory; name a .gguf file",
                            file=str(dst_p))
        cfg = model.config
        arch, permute = arch_of(cfg, file=str(src_p))
        det = detect_model(model.tensors, cfg, root=model.root)
        fatal = [i for i in det.issues if i.code is ErrorCode.FORMAT_AMBIGUOUS]
        if fatal:
            raise fatal[0].to_error()
        if det.format not in (Format.EXL2, Format.GPTQ, Format.EXL3, Format.DENSE):
            raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, f"{det.format.value} models cannot be converted to GGUF",
                            file=str(src_p))
        report = ConversionReport(source=str(src), destination=str(dst), source_format=det.format.value,
                                  target="gguf", options={"gguf_type": gt, "force": force, "verify": verify})
        for i in det.issues:
            report.warnings.append(f"detect: [{i.code.value}] {i.message}")
        if det.format is Format.DENSE:   # cast as tensors: count them as inspect does (issue 12)
            report.linear_layers = len(det.layers)
        from .gguf_arch import router_semantics_warning

        w_router = router_semantics_warning(cfg)
        if w_router:
            report.warnings.append(w_router)
        hp = hparams(cfg)
        if gt == "auto":
            layer_t, plain_t = auto_type(det, cfg, model, reader)
        else:
            layer_t = plain_t = gt.upper()
        report.options["layer_type"], report.options["plain_type"] = layer_t, plain_t
        items = plan_items(model, reader, det, cfg, arch, permute, hp, layer_t, plain_t, report)
        if layer_t == SIZED:
            layer_t = sized_summary(items, report)
        report.seconds["plan"] = time.perf_counter() - t_start
        _write_and_publish(items, model, src_p, dst_p, arch, hp, layer_t, report, force, progress, verify,
                           _fail_after)
    finally:
        reader.close()
    report.seconds["total"] = time.perf_counter() - t_start
    return report

def _write_and_publish(items, model, src_p, dst_p, arch, hp, layer_t, report, force, progress, verify,
                       _fail_after) -> None:
    import gguf

    t0 = time.perf_counter()
    # a marked partial directory, so a killed run's leftover is removed by the next; the file inside it is DST's name
    with staged_output(dst_p, force, warnings=report.warnings, file=True) as stage:
        tmp = stage.path
        w = gguf.GGUFWriter(None, arch)
        try:
            total = _write_file(w, tmp, items, model, src_p, arch, hp, layer_t, report, progress, _fail_after)
            w.close()
        except BaseException:
            with contextlib.suppress(Exception):  # cleanup only
                w.close()
            raise
        report.bytes_written = os.path.getsize(tmp)
        report.files_written = [dst_p.name]
        report.shards = [dst_p.name]
        report.seconds["write"] = time.perf_counter() - t0
        stage.written()
        t0 = time.perf_counter()
        verify_gguf(tmp, items, hp, arch, report, progress, total, verify)
        report.seconds["verify"] = time.perf_counter() - t0
        stage.publish()


def _write_file(w, tmp: Path, items, model, src_p: Path, arch, hp, layer_t, report, progress,
                _fail_after) -> int:
    """The header, the metadata, the tensor table and every tensor's data (its digest kept in ``it.sum``), then
    flushed and fsync-ed.  Returns the tensor bytes written."""
    for it in items:  # the tensor table first: the parameter count (size label) is read from it
        bshape = it.byte_shape
        dt = {"F32": np.float32, "F16": np.float16}.get(it.gtype, np.uint8)
        w.add_tensor_info(it.gguf_name, bshape, np.dtype(dt), it.nbytes,
                          raw_dtype=None if it.gtype in ("F32", "F16") else ggml_type(it.gtype))
    from .gguf_vocab import add_tokenizer

    from .gguf_arch import spec_for_model_type

    spec = spec_for_model_type(model.config.get("model_type"))
    tok_dir = src_p if src_p.is_dir() else src_p.parent
    # the card, configs and tokenizer files that go into the metadata are read from gated, bounded copies
    # (container.sidefiles: no link out of the source, no FIFO, no multi-GB README read whole)
    with staged_inputs(tok_dir, report) as safe_dir:
        write_metadata(w, arch, hp, model.config, layer_t, model, items, report,
                       card_dir=safe_dir if Path(str(model.root)).is_dir() else None)
        n_vocab = next((it.shape[0] for it in items if it.gguf_name == "token_embd.weight"), hp["vocab"])
        tok = add_tokenizer(w, safe_dir, n_vocab, report.warnings, spec.extra.get("vocab"))
        report.options["tokenizer"] = tok
        if spec.tokenizer is not None and tok.get("model") != "none":
            spec.tokenizer(w, safe_dir)
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(it.nbytes for it in items)
    done = 0
    for ui, it in enumerate(items):
        if _fail_after is not None and ui >= _fail_after:
            raise RuntimeError("injected failure (test hook)")
        produced = it.produce()
        chunks = [produced] if isinstance(produced, np.ndarray) else produced
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())  # the data of each tensor starts aligned, as write_tensor_data
        cs, n = Digest(), 0
        for arr in chunks:
            b = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
            cs.update(b)
            fout.write(b)
            n += b.nbytes
            del arr, b
        if n != it.nbytes:  # pragma: no cover - converter bug
            raise RuntimeError(f"{it.gguf_name}: produced {n} bytes, planned {it.nbytes}")
        w.write_padding(fout, it.nbytes)
        it.sum = cs.digest()
        done += it.nbytes
        if progress is not None:
            progress(done, 2 * total, it.src)
    for f in w.fout or []:
        f.flush()
        os.fsync(f.fileno())
    return total
