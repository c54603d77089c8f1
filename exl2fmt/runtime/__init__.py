"""Run models in transformers: ``load_model`` / ``load_tokenizer`` (``exl2fmt.runtime.loading``) and the
generation loop behind ``exl2fmt generate`` (``exl2fmt.runtime.generate``, imported on first use)."""

from __future__ import annotations

from .loading import load_model, load_tokenizer

__all__ = ["load_model", "load_tokenizer"]
