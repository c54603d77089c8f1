"""The quantizer: FP16/BF16 Hugging Face models -> EXL2 (and GPTQ), calibrated with GPTQ.

Needs the ``quant`` extra (torch, tokenizers).  Nothing here is imported by ``inspect`` / ``validate``.

Modules:

* ``weights``   ``WeightSource`` (tensors by name, read lazily) and ``dense_linear``
* ``hf_engine``  the model runner: transformers' modeling code, one decoder layer materialized at a time, with
                substitute linears and captured linear inputs; the one forward of the project (calibration,
                ``validate --run``, ``evaluate``)
* ``calib``     calibration data: text / jsonl / token-id files, tokenized with the model's tokenizer.json,
                and the built-in default set
* ``gptq``      Hessians, act-order, the GPTQ sweep with EXL2's per-group 4-bit scale search, GPTQ-format output
* ``qparams``   candidate settings per block, bits accounting, ExLlamaV2's ``measurement.json``
* ``solver``    picks one candidate per block under the exact bit budget
* ``pipeline``  measure -> optimize -> quantize -> compile, with checkpoints and resume
* ``evaluate``  perplexity, KL divergence and top-1 agreement of a quantized model against its reference
"""
