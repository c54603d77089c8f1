"""The quantizer: FP16/BF16 Hugging Face models -> EXL2 (and GPTQ), calibrated with GPTQ.

Needs the ``quant`` extra (torch, tokenizers).  Nothing here is imported by ``inspect`` / ``validate``.

The forward it calibrates with is the model runner, ``exl2fmt.runner`` (shared with ``validate --run``).

Modules:

* ``calib``     calibration data: text / jsonl / token-id files, tokenized with the model's tokenizer.json,
                and the built-in default set
* ``gptq``      Hessians, act-order, the GPTQ sweep with EXL2's per-group 4-bit scale search, GPTQ-format output
* ``qparams``   candidate settings per block, bits accounting, ExLlamaV2's ``measurement.json``
* ``solver``    picks one candidate per block under the exact bit budget
* ``pipeline``  measure -> optimize -> quantize -> compile, with checkpoints and resume
* ``evaluate``  perplexity, KL divergence and top-1 agreement of a quantized model against its reference
"""
