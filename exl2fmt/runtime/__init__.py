"""The runtime (issue 35): quantized models run packed in transformers, on any machine.

* ``loading``  ``load_model(path, device=None, dtype=None)`` / ``load_tokenizer(path)``: a model directory as a
               transformers ``*ForCausalLM`` whose EXL2 / GPTQ linears stay packed; dense directories load as
               plain transformers models
* ``linear``   ``Exl2PackedLinear`` / ``GptqPackedLinear`` (``PackedLinear``): the stored tensors as buffers under
               their checkpoint names, y = x W^T + b decoded on the fly; ``FusedLinear`` (Phi-3 qkv / gate_up)
* ``cpu``      the Numba kernels of the CPU path (GPU: the Triton kernels of ``exl2fmt.kernels``)
* ``exl3``     ``Exl3PackedLinear``: the trellis as stored, decoded in 128-row stripes per call (EXL3 codec)
* ``moe``      ``PackedExperts``: transformers 5's stacked experts as one packed linear per expert projection
* ``placement`` ``device_map`` / ``max_memory`` / disk offload of a packed model (accelerate)

``import exl2fmt.hf`` registers the same modules with transformers' quantizer API, so that
``AutoModelForCausalLM.from_pretrained`` loads EXL2, EXL3 (and, without optimum / gptqmodel, GPTQ) packed.
Importing this package imports torch (``exl2fmt`` itself reaches it lazily: ``exl2fmt.load_model``).
"""

from __future__ import annotations

from .linear import Exl2PackedLinear, FusedLinear, GptqPackedLinear, PackedLinear, packed_modules, weight_bytes
from .exl3 import Exl3PackedLinear
from .loading import default_dtype, load_model, load_tokenizer, model_format
from .moe import PackedExperts

__all__ = ["load_model", "load_tokenizer", "model_format", "default_dtype", "PackedLinear", "Exl2PackedLinear",
           "GptqPackedLinear", "Exl3PackedLinear", "FusedLinear", "PackedExperts", "packed_modules", "weight_bytes"]
