"""The quantizer: FP16/BF16 Hugging Face models -> EXL2 (and GPTQ), calibrated with GPTQ.

Needs the ``quant`` extra (torch, tokenizers).  Nothing here is imported by ``inspect`` / ``validate``.

Modules:

* ``forward``   a torch forward for the Llama family (llama, mistral, qwen2, qwen3), block by block, with the
                intermediate inputs of every linear layer exposed for Hessians
* ``calib``     calibration data: text / jsonl / token-id files, tokenized with the model's tokenizer.json,
                and the built-in default set
* ``gptq``      Hessians, act-order, the GPTQ sweep with EXL2's per-group 4-bit scale search, GPTQ-format output
* ``qparams``   candidate settings per block, bits accounting, ExLlamaV2's ``measurement.json``
* ``solver``    picks one candidate per block under the exact bit budget
* ``pipeline``  measure -> optimize -> quantize -> compile, with checkpoints and resume
* ``evaluate``  perplexity, KL divergence and top-1 agreement of a quantized model against its reference
"""
