"""``load_model`` / ``load_tokenizer``: a model directory as a transformers model and tokenizer.

Dense-only placeholder of the generate branch (issue 35); the packed EXL2 / GPTQ loader replaces this module."""

from __future__ import annotations

__all__ = ["load_model", "load_tokenizer"]


def load_model(path, device=None, dtype=None):
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` (dtype None: the checkpoint's), on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto" if dtype is None else dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def load_tokenizer(path):
    """``AutoTokenizer.from_pretrained(path)``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
