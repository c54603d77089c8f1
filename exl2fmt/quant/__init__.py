"""The quantizer: FP16/BF16 Hugging Face models -> EXL2 (and GPTQ), calibrated with GPTQ.

Needs the ``quant`` extra (torch, tokenizers).  Nothing here is imported by ``inspect`` / ``validate``.

The forward it calibrates with is the model runner, ``exl2fmt.runner`` (shared with ``validate --run``).

Modules:

* ``calib``     calibration data: text / jsonl / token-id files, tokenized with the model's tokenizer.json,
                and the built-in default set
* ``gptq``      Hessians, act-order, the GPTQ sweep with EXL2's per-group 4-bit scale search, GPTQ-format output
* ``qparams``   candidate settings per block, bits accounting, ExLlamaV2's ``measurement.json``
* ``solver``    picks one candidate per block under the exact bit budget
* ``pipeline``  ``quantize_model``: the sequence options -> measure -> optimize -> quantize -> compile -> verify,
                with checkpoints and resume; each phase a module of its own:
* ``options``   ``QuantOptions``, their defaults and resolution
* ``job``       the run's state in its work directory (job.json, snapshots, layer files), the disk preflight;
                ``workdir``: where the work directory is and whose it is (torch-free)
* ``common``    the model's blocks and linears in order, calibration batches, a block's error, memory release
* ``measure``   the EXL2 measurement and ``measurement.json``; ``candidates``: its candidate layers
* ``optimize``  one option per block within the bit budget, the slack spent
* ``gptq_pass`` the sequential GPTQ pass through the model and the head, calibration perplexities
* ``compile``   the output files and metadata, the self-verification of the staged output
* ``weight_only``  the path for architectures without a calibration forward
* ``report``    ``QuantReport``
* ``evaluate``  perplexity, KL divergence and top-1 agreement of a quantized model against its reference
"""
