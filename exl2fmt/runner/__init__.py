"""The model runner: transformers' own modeling code driven one decoder layer at a time, over weights read by name.

The project's one forward: the quantizer's calibration, ``validate --run`` and the perplexity report run through
it (and the runtime that runs quantized models in transformers is to).  Needs torch (``model`` also transformers:
the ``quant`` extra); importing this package imports neither, so ``validate`` stays torch-free at start-up.

Modules:

* ``weights``  ``WeightSource`` (tensors by name, read lazily) and ``Linear`` / ``dense_linear`` /
               ``widened_linear`` (a linear layer as a function)
* ``model``    ``HFModel``: the skeleton transformers builds for a config.json, the linears and structure of its
               decoder layers, the inputs transformers passes them, embedding, final norm, head, whole forward
* ``layer``    ``LayerRunner`` (one decoder layer with real weights: substitute linears, captured inputs) and
               ``LayerBlock`` (the attention or MLP half of a layer over all calibration rows, as the quantizer
               sweeps it)
* ``moe``      mixture-of-experts blocks: the fused expert parameters, routed expert linears, Hessian padding
* ``hooks``    what the stand-ins and hooks inside transformers' forward share (ending a forward early, meta
               parameters, a module's result taken apart)
"""
