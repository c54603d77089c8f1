"""The generation loop of ``exl2fmt generate``: any transformers causal LM and its tokenizer, batch 1.

``Generation(model, tokenizer, prompt_ids, options)`` is an iterator of text pieces: the prompt runs once
(prefill, filling the KV cache), then one token per step through the cache (decode).  Each piece is whole UTF-8
characters (``StreamDecoder``: a byte-level token that ends inside a character is held back until the character is
complete), so printing the pieces as they come prints the final text.  Its state is readable at any time:
``generation.summary()`` after the loop, after a stop on EOS, or after the caller interrupted it (Ctrl-C), with
the text so far, token counts and the prefill / decode timings.

Token choice (``GenerationOptions``), in transformers' order: repetition penalty (the CTRL rule: a logit of a token
already in the prompt or output is divided by the penalty when positive, multiplied when negative), then greedy
argmax, or sampling: temperature, top-k, top-p (nucleus, keeping at least one token), one draw from a
``torch.Generator`` seeded with ``seed`` (same seed, same model, same device -> same tokens).  Generation stops at
an end-of-sequence id (the tokenizer's, the generation config's and the model config's; ``ignore_eos`` gives
them no probability instead, like transformers' ``min_new_tokens`` and llama.cpp's ``--ignore-eos``),
after ``max_new_tokens``, or at the model's ``max_position_embeddings``.

Greedy output equals ``model.generate(ids, do_sample=False)`` token for token (tests/test_generate.py): the same
forward calls with a ``DynamicCache``, logits compared in float32.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..errors import ErrorCode, Exl2Error

__all__ = ["GenerationOptions", "Generation", "StreamDecoder", "eos_ids", "chat_prompt", "encode_prompt"]


@dataclass(frozen=True)
class GenerationOptions:
    """What ``Generation`` does; ``check()`` raises USAGE for values outside their range."""

    max_new_tokens: int = 128
    temperature: float = 0.0        # 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def check(self) -> "GenerationOptions":
        def bad(msg):
            raise Exl2Error(ErrorCode.USAGE, msg)

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad(f"--max-new-tokens must be a positive integer, not {self.max_new_tokens!r}")
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            bad(f"--temperature must be a finite number >= 0 (0: greedy), not {self.temperature!r}")
        if self.top_k < 0:
            bad(f"--top-k must be >= 0 (0: off), not {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            bad(f"--top-p must lie in (0, 1] (1: off), not {self.top_p!r}")
        if not (0 < self.repetition_penalty < float("inf")):
            bad(f"--repetition-penalty must be a finite number > 0 (1: off), not {self.repetition_penalty!r}")
        if self.seed is not None and not (0 <= self.seed < 2 ** 63):
            bad(f"--seed must lie in 0..2**63-1, not {self.seed!r}")
        return self


def eos_ids(model, tokenizer) -> list[int]:
    """Every end-of-sequence id: the tokenizer's, the generation config's and the model config's (int or list)."""
    found: list[int] = []
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(getattr(model, "config", None), "eos_token_id", None)):
        for v in (src if isinstance(src, (list, tuple)) else [src]):
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in found:
                found.append(v)
    return found


def chat_prompt(tokenizer, text: str) -> list[int]:
    """The token ids of ``text`` as one user turn in the tokenizer's chat template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise Exl2Error(ErrorCode.CHAT_TEMPLATE_MISSING, "--chat needs the tokenizer's chat template "
                        "(chat_template in tokenizer_config.json, or chat_template.jinja) and this model has none; "
                        "drop --chat to continue the prompt as plain text")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``text`` as token ids with the tokenizer's special tokens (a BOS where the tokenizer adds one)."""
    return [int(i) for i in tokenizer(text)["input_ids"]]


def _forward_params(model) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class StreamDecoder:
    """Incremental detokenization: ``push(id)`` returns the new text, in whole characters.

    The ids are decoded from ``prefix`` (a few ids back, so that a tokenizer's spacing rules see context) to the
    end and compared with the decoding up to the last emitted id; a text ending in U+FFFD (an incomplete UTF-8
    sequence of byte-level tokens) is held back until a later token completes it.  ``flush()`` returns what is
    still held (a sequence that never completes, as the final decode prints it)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0   # decoding starts here
        self.read = 0     # text of ids[prefix:read] has been emitted

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if now.startswith(before) else ""


@dataclass
class Timings:
    load_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0      # forward passes of one token (the first new token comes from the prefill)


@dataclass
class _State:
    new_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    stop: str | None = None    # "eos", "max_new_tokens", "context", "interrupted"


class Generation:
    """Iterate for the text pieces; ``summary()`` for the result (also partial, after an interruption)."""

    def __init__(self, model, tokenizer, prompt_ids: list[int], options: GenerationOptions = GenerationOptions()):
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.options = options.check()
        if not self.prompt_ids:
            raise Exl2Error(ErrorCode.USAGE, "the prompt is empty (no tokens): give some text")
        self.eos = eos_ids(model, tokenizer)
        self.timings = Timings()
        self.state = _State()
        self.decoder = StreamDecoder(tokenizer)
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.context = limit if isinstance(limit, int) and limit > 0 else None
        if self.context is not None and len(self.prompt_ids) >= self.context:
            raise Exl2Error(ErrorCode.USAGE, f"the prompt has {len(self.prompt_ids)} tokens; the model's context "
                            f"(max_position_embeddings) is {self.context}")

    # --- token choice ------------------------------------------------------------------------------------
    def _choose(self, logits, generator):
        import torch

        o = self.options
        logits = logits.float()
        eos = [e for e in self.eos if e < logits.numel()] if o.ignore_eos else None
        if eos:   # as transformers' min_new_tokens and llama.cpp's --ignore-eos do
            logits = logits.index_fill(0, torch.tensor(eos, device=logits.device), float("-inf"))
        if o.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self.prompt_ids + self.state.new_ids)), device=logits.device)
            vals = logits.gather(0, seen)
            logits = logits.scatter(0, seen, torch.where(vals < 0, vals * o.repetition_penalty,
                                                         vals / o.repetition_penalty))
        if not o.sampling:
            return int(torch.argmax(logits))
        logits = logits / o.temperature
        if o.top_k > 0 and o.top_k < logits.numel():
            kth = torch.topk(logits, o.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if o.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= o.top_p   # mass before this token already >= p
            drop[0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))

    # --- the loop ------------------------------------------------------------------------------------------
    def __iter__(self):
        import torch

        from transformers import DynamicCache

        o = self.options
        st = self.state
        generator = None
        if o.sampling:
            generator = torch.Generator()
            generator.manual_seed(o.seed if o.seed is not None else torch.seed())
        device = next(self.model.parameters()).device
        cache = DynamicCache()
        params = _forward_params(self.model)
        # the KV cache's name: ``cache`` (transformers >= 5.25) or ``past_key_values``
        kw = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
        first = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        ids = torch.tensor([self.prompt_ids], dtype=torch.long, device=device)
        pos = len(self.prompt_ids)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, **first, **kw)
            tok = self._choose(out.logits[0, -1], generator)   # .item(): the device has finished
            self.timings.prefill_s = time.perf_counter() - t0
            while True:
                if tok in self.eos:
                    st.stop = "eos"
                    break
                st.new_ids.append(tok)
                piece = self.decoder.push(tok)
                if piece:
                    st.pieces.append(piece)
                    yield piece
                if len(st.new_ids) >= o.max_new_tokens:
                    st.stop = "max_new_tokens"
                    break
                if self.context is not None and pos >= self.context:
                    st.stop = "context"
                    break
                ts = time.perf_counter()
                out = self.model(input_ids=torch.tensor([[tok]], dtype=torch.long, device=device), **kw)
                pos += 1
                tok = self._choose(out.logits[0, -1], generator)
                self.timings.decode_s += time.perf_counter() - ts
                self.timings.decode_steps += 1
        rest = self.decoder.flush()
        if rest:
            st.pieces.append(rest)
            yield rest

    def interrupted(self) -> str:
        """Mark the generation as stopped by the caller (Ctrl-C; ``summary()`` then says so) and return the text
        the stream decoder still held back (already added to ``text``)."""
        if self.state.stop is None:
            self.state.stop = "interrupted"
        rest = self.decoder.flush()
        if rest:
            self.state.pieces.append(rest)
        return rest

    @property
    def text(self) -> str:
        return "".join(self.state.pieces)

    def summary(self) -> dict:
        """Text, token counts, timings and tokens/s; valid at any point of the loop."""
        t = self.timings
        n_prompt = len(self.prompt_ids)
        prefill_tps = n_prompt / t.prefill_s if t.prefill_s > 0 else None
        decode_tps = t.decode_steps / t.decode_s if t.decode_s > 0 else None
        return {
            "text": self.text,
            "stop": self.state.stop,
            "tokens": {"prompt": n_prompt, "generated": len(self.state.new_ids)},
            "token_ids": list(self.state.new_ids),
            "timings": {"load_s": t.load_s, "prefill_s": round(t.prefill_s, 6), "decode_s": round(t.decode_s, 6),
                        "decode_steps": t.decode_steps},
            "tokens_per_s": {"prefill": None if prefill_tps is None else round(prefill_tps, 3),
                             "decode": None if decode_tps is None else round(decode_tps, 3)},
            "options": asdict(self.options),
        }
