"""A Hugging Face ``tokenizer.json`` as GGUF ``tokenizer.ggml.*`` metadata, and back.

To GGUF (``add_tokenizer``):

* byte-level BPE (``model.type == "BPE"`` without ``byte_fallback``; GPT-2, Llama 3, Qwen) -> ``"gpt2"``:
  tokens in id order, token types (NORMAL, CONTROL for special added tokens, USER_DEFINED for the other added
  tokens, UNUSED for padding), merges, and ``tokenizer.ggml.pre`` recognised from the pre-tokenizer's split
  regex (``llama-bpe``, ``qwen2``, ``gpt-2``; anything else is written as ``default`` with a warning: llama.cpp
  would then split text differently from the original tokenizer).
* BPE with ``byte_fallback`` (SentencePiece models exported by transformers: Llama 2, Mistral) -> ``"llama"``:
  tokens, types (UNKNOWN, BYTE for ``<0xNN>``, CONTROL, USER_DEFINED, NORMAL) and scores ``-id`` (SentencePiece
  BPE numbers pieces by descending score, which is what llama.cpp's merge order needs).
* anything else, or no ``tokenizer.json`` -> ``"none"`` with a warning: llama.cpp then runs token ids only.

Special token ids, ``add_bos_token``/``add_eos_token`` and the chat template come from the ``gguf`` package's
``SpecialVocab`` (tokenizer_config.json, tokenizer.json post-processor, config.json).  When the embedding has
more rows than the tokenizer has tokens, ``[PAD<i>]`` tokens of type UNUSED fill the gap (as llama.cpp's
converter does).

From GGUF (``rebuild_tokenizer``): a ``"gpt2"`` vocabulary becomes ``tokenizer.json`` (byte-level BPE with the
pre-tokenizer regex of its ``pre``) plus ``tokenizer_config.json``; a ``"llama"`` (SentencePiece) vocabulary is
rebuilt by transformers' own GGUF tokenizer builders (``rebuild_sentencepiece``); other models are reported as
missing.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from exl2fmt.container import jsonload
from exl2fmt.errors import Exl2Error

__all__ = ["add_tokenizer", "rebuild_tokenizer", "rebuild_sentencepiece", "PRE_PATTERNS", "tokenizer_issues",
           "split_merge", "check_tokenizer_file"]

#: bound on sum(len(token) ** 2) for rebuilding a SentencePiece vocabulary (Gemma's 256k tokens: ~10^7)
_MAX_MERGE_WORK = 1 << 28

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
#: tokenizer.ggml.pre -> the split regex of the Hugging Face pre-tokenizer it stands for (None: byte-level's own
#: GPT-2 regex; "digits": each digit split off first, then byte-level's GPT-2 regex, as SmolLM's tokenizer.json
#: and llama.cpp's ``smollm`` pre-tokenizer do)
PRE_PATTERNS = {"llama-bpe": _LLAMA3, "qwen2": _QWEN2, "gpt-2": None, "smollm": "digits"}
#: the tokenizer_config.json key that carries a GGUF's tokenizer.ggml.pre when no pre-tokenizer exl2fmt builds
#: stands for it (GGUF -> HF writes GPT-2's split then); HF -> GGUF writes it back while the split is unchanged
GGUF_PRE_KEY = "gguf_pre_tokenizer"

# gguf.TokenType values (kept as ints so this module imports nothing heavy)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _split_patterns(node) -> list[str]:
    out = []
    if isinstance(node, dict):
        if node.get("type") == "Split" and isinstance(node.get("pattern"), dict):
            p = node["pattern"].get("Regex", node["pattern"].get("String"))
            if isinstance(p, str):
                out.append(p)
        for v in node.values():
            if isinstance(v, (dict, list)):
                out += _split_patterns(v)
    elif isinstance(node, list):
        for v in node:
            out += _split_patterns(v)
    return out


def _byte_level(node) -> dict | None:
    if isinstance(node, dict):
        if node.get("type") == "ByteLevel":
            return node
        for v in node.values():
            r = _byte_level(v) if isinstance(v, (dict, list)) else None
            if r is not None:
                return r
    elif isinstance(node, list):
        for v in node:
            r = _byte_level(v)
            if r is not None:
                return r
    return None


def detect_pre(tj: dict) -> str | None:
    """The llama.cpp pre-tokenizer name for a byte-level BPE ``tokenizer.json``; None = not recognised."""
    pre = tj.get("pre_tokenizer")
    pats = _split_patterns(pre)
    if len(pats) == 1:
        for name, pat in PRE_PATTERNS.items():
            if pat is not None and pats[0] == pat:
                return name
        return None
    bl = _byte_level(pre)
    if not pats and bl is not None and bl.get("use_regex", True):
        if _individual_digits(pre):
            return "smollm"
        return "gpt-2"
    return None


def _individual_digits(pre) -> bool:
    """``pre`` is exactly ``Sequence[Digits(individual_digits), ByteLevel]`` (SmolLM's pre-tokenizer)."""
    if not isinstance(pre, dict) or pre.get("type") != "Sequence":
        return False
    parts = pre.get("pretokenizers")
    return (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], dict)
            and parts[0].get("type") == "Digits" and parts[0].get("individual_digits") is True
            and isinstance(parts[1], dict) and parts[1].get("type") == "ByteLevel")


def _load_json(path: Path) -> dict:
    """A tokenizer file (tokenizer.json, tokenizer_config.json, added_tokens.json) as a JSON object, through the
    guarded loader (regular file, byte / value-count / depth caps); its problems come back as ValueError, which
    the callers turn into a warning (the GGUF is then written without that part of the vocabulary)."""
    kind = jsonload.TOKENIZER.named(path.name)
    try:
        return jsonload.expect(jsonload.load_json(path, kind), "object", kind, file=str(path))
    except Exl2Error as e:
        raise ValueError(e.one_line()) from None


def looks_special(text: str) -> bool:
    """Added tokens that families mark non-special although they act as control tokens (llama.cpp's converter
    types them CONTROL too): ``<pad>``, ``<mask>``, ``<2mass>``, ``[@BOS@]``, ``<|...|>``, ``<｜...｜>``,
    ``<unused...>``."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def spm_vocab(src_dir: Path, n_vocab: int, variant: str | None = None
              ) -> tuple[list[str], list[float], list[int]] | None:
    """``(tokens, scores, types)`` of length ``n_vocab`` from a SentencePiece ``tokenizer.model`` (None when
    there is none or the ``sentencepiece`` package is missing).

    Every id below ``n_vocab`` starts as ``[PAD<i>]`` / score -10000 / UNUSED; the model's pieces overwrite them
    with their own score and type (UNKNOWN, CONTROL, UNUSED, BYTE, else NORMAL); ``added_tokens.json`` entries
    are USER_DEFINED with score -1000; ``tokenizer_config.json`` ``added_tokens_decoder`` entries are CONTROL
    when special (or ``looks_special``), else USER_DEFINED with ``\u2581`` shown as a space, score -1000.
    ``variant="phi3"`` (llama.cpp's Phi-3 converter): added tokens from ``added_tokens_decoder`` and then from
    ``tokenizer.json``'s ``added_tokens`` are CONTROL when special, else USER_DEFINED, text kept as is."""
    path = Path(src_dir) / "tokenizer.model"
    if not path.is_file():
        return None
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        return None
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(path))
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [UNUSED] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        typ = NORMAL
        if sp.IsUnknown(i):
            typ = UNKNOWN
        elif sp.IsControl(i):
            typ = CONTROL
        elif sp.IsUnused(i):
            typ = UNUSED
        elif sp.IsByte(i):
            typ = BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i), sp.GetScore(i), typ
    added = Path(src_dir) / "added_tokens.json"
    if added.is_file():
        for text, i in _load_json(added).items():
            if isinstance(i, int) and 0 <= i < n_vocab:
                tokens[i], scores[i], types[i] = text, -1000.0, USER_DEFINED
    tcp = Path(src_dir) / "tokenizer_config.json"
    if variant == "phi3":
        entries = []
        if tcp.is_file():
            entries += [(int(k), d) for k, d in (_load_json(tcp).get("added_tokens_decoder") or {}).items()]
        tjp = Path(src_dir) / "tokenizer.json"
        if tjp.is_file():
            entries += [(d.get("id"), d) for d in _load_json(tjp).get("added_tokens") or [] if isinstance(d, dict)]
        for i, d in entries:
            if isinstance(i, int) and 0 <= i < n_vocab and isinstance(d.get("content"), str):
                tokens[i], scores[i] = d["content"], -1000.0
                types[i] = CONTROL if d.get("special") else USER_DEFINED
        return tokens, scores, types
    if tcp.is_file():
        dec = _load_json(tcp).get("added_tokens_decoder") or {}
        for k, d in dec.items():
            i = int(k)
            if not 0 <= i < n_vocab or not isinstance(d, dict) or not isinstance(d.get("content"), str):
                continue
            text = d["content"]
            if d.get("special") or looks_special(text):
                types[i] = CONTROL
            else:
                text = text.replace("\u2581", " ")
                types[i] = USER_DEFINED
            tokens[i], scores[i] = text, -1000.0
    return tokens, scores, types


def add_tokenizer(w, src_dir: Path | None, n_vocab: int, warnings: list[str], variant: str | None = None) -> dict:
    """Add ``tokenizer.ggml.*`` to the GGUFWriter ``w`` from the tokenizer files in ``src_dir``.  Returns
    ``{"model", "pre", "tokens", "merges", "padded"}`` describing what was written; problems go to
    ``warnings`` (the GGUF is then written with ``tokenizer.ggml.model = "none"``)."""
    import gguf

    info = {"model": "none", "pre": None, "tokens": 0, "merges": 0, "padded": 0}

    def none(why: str) -> dict:
        warnings.append(f"tokenizer: {why}; the GGUF carries no vocabulary (tokenizer.ggml.model = none), so "
                        "llama.cpp can run token ids but not text")
        w.add_tokenizer_model("none")
        return info

    try:
        spm = None if src_dir is None else spm_vocab(Path(src_dir), n_vocab, variant)
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        warnings.append(f"tokenizer: tokenizer.model not read ({type(e).__name__}: {e}); trying tokenizer.json")
        spm = None
    if spm is not None:
        tokens, scores, types = spm
        info.update(model="llama", pre="default", tokens=n_vocab)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        _special(w, src_dir, n_vocab, False, info, warnings)
        return info
    path = None if src_dir is None else Path(src_dir) / "tokenizer.json"
    if path is None or not path.is_file():
        return none("no tokenizer.json next to the model")
    try:
        tj = _load_json(path)
        model = tj["model"]
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            return none(f"tokenizer.json model type {model.get('type')!r} is not supported (BPE only)")
        vocab: dict[str, int] = model["vocab"]
        byte_fallback = bool(model.get("byte_fallback", False))
        added = [a for a in tj.get("added_tokens") or [] if isinstance(a, dict)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return none(f"cannot read tokenizer.json ({type(e).__name__}: {e})")
    if not all(type(i) is int for i in vocab.values()):
        return none("tokenizer.json model.vocab maps a token to something other than an integer id")
    by_id: dict[int, tuple[str, int]] = {}
    for text, i in vocab.items():
        by_id[i] = (text, NORMAL)
    for a in added:
        i, text = a.get("id"), a.get("content")
        if isinstance(i, int) and isinstance(text, str):
            by_id[i] = (text, CONTROL if a.get("special") else USER_DEFINED)
    n_tok = max(by_id) + 1 if by_id else 0
    if n_tok > n_vocab:
        return none(f"the tokenizer has ids up to {n_tok - 1} but the embedding only {n_vocab} rows")
    holes = [i for i in range(n_tok) if i not in by_id]
    if holes:
        warnings.append(f"tokenizer: {len(holes)} ids below {n_tok} have no token (filled as [PAD<i>], UNUSED)")
    tokens, types, scores = [], [], []
    unk = model.get("unk_token")
    for i in range(n_vocab):
        text, typ = by_id.get(i, (f"[PAD{i}]", UNUSED))
        if byte_fallback:
            if typ == NORMAL and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
                typ = BYTE
            elif text == unk:
                typ = UNKNOWN
        tokens.append(text)
        types.append(typ)
        scores.append(-float(i) if typ == NORMAL else 0.0)
    info.update(tokens=n_tok, padded=n_vocab - n_tok)
    if byte_fallback:
        info["model"] = "llama"
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        warnings.append("tokenizer: SentencePiece-style (byte_fallback) vocabulary written with scores -id, the "
                        "piece order; check generation against the original tokenizer")
        load_merges = False
    else:
        pre = detect_pre(tj)
        if pre == "gpt-2":  # GGUF -> HF wrote GPT-2's split for a pre-tokenizer it could not build: its name
            recorded = _recorded_pre(Path(src_dir))
            if recorded is not None:
                pre = recorded
        if pre is None:
            warnings.append("tokenizer: the pre-tokenizer regex is not one llama.cpp names; written as 'default', "
                            "so llama.cpp may split text differently")
            pre = "default"
        info.update(model="gpt2", pre=pre)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        load_merges = True
    _special(w, src_dir, n_vocab, load_merges, info, warnings)
    if load_merges and not info["merges"]:
        warnings.append("tokenizer: a BPE vocabulary without merges; llama.cpp will not tokenize it usefully")
    return info


def _recorded_pre(src_dir: Path) -> str | None:
    """``tokenizer_config.json``'s ``GGUF_PRE_KEY`` (a short plain name), or None."""
    path = src_dir / "tokenizer_config.json"
    try:
        v = _load_json(path).get(GGUF_PRE_KEY) if path.is_file() else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return v if isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}", v) else None


def _special(w, src_dir, n_vocab: int, load_merges: bool, info: dict, warnings: list[str]) -> None:
    """Special token ids, add_bos/add_eos, chat template (and merges) through the gguf package's SpecialVocab."""
    import gguf

    log = logging.getLogger("gguf")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        # SpecialVocab json.load()s these with no caps: the guarded loader checks them first (ValueError here)
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            if src_dir is not None and (Path(src_dir) / name).is_file():
                _load_json(Path(src_dir) / name)
        sv = gguf.SpecialVocab(src_dir, load_merges=load_merges, n_vocab=n_vocab)
        sv.add_to_gguf(w, quiet=True)
        info["merges"] = len(sv.merges)
        info["special"] = dict(sv.special_token_ids)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        warnings.append(f"tokenizer: special tokens / merges not read ({type(e).__name__}: {e})")
    finally:
        log.setLevel(level)


def _field(reader, key):
    f = reader.get_field(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a field that cannot be decoded counts as absent
        return None


# GGUF value types (gguf_scan / the GGUF spec)
_INTS = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 10: "UINT64", 11: "INT64"}
_FLOATS = {6: "FLOAT32", 12: "FLOAT64"}
_TYPE_NAMES = {**_INTS, **_FLOATS, 7: "BOOL", 8: "STRING", 9: "ARRAY"}
#: the special-token id keys llama.cpp reads
_ID_KEYS = ("bos", "eos", "unknown", "padding", "separator", "cls", "mask", "eot", "eom")


def _shown(f) -> str:
    if f.types[0] == 9:
        return f"an array of {f.count} {_TYPE_NAMES.get(f.types[-1], f'type-{f.types[-1]}')}"
    return f"a {_TYPE_NAMES.get(f.types[0], f'type-{f.types[0]}')}"


def split_merge(m: str) -> tuple[str, str] | None:
    """A ``tokenizer.ggml.merges`` entry ``"a b"`` as ``(a, b)``, split at the first space after the first
    character (as llama.cpp splits it); None when there is no such space or a side is empty."""
    pos = m.find(" ", 1)
    if pos < 1 or pos == len(m) - 1:
        return None
    return m[:pos], m[pos + 1:]


def tokenizer_issues(reader) -> list[tuple[str, str]]:
    """``[(key, rule broken)]`` for the ``tokenizer.ggml.*`` metadata, checked before GGUF -> HF does any work:
    every key has its type (model / pre / chat template strings, flags booleans, special-token ids integers,
    tokens and merges arrays of strings, token_type an array of integers 0..6, scores an array of finite
    numbers); for the vocabularies that are rebuilt (``gpt2``, ``llama``) tokens are present and unique,
    token_type and scores have one entry per token, and every merge is ``"a b"`` with ``a``, ``b`` and ``ab``
    tokens (what the ``tokenizers`` library needs to load the rebuilt tokenizer.json).  Linear in the size of
    the arrays."""
    out: list[tuple[str, str]] = []
    get = reader.get_field

    def want(key: str, ok, rule: str):
        f = get(key)
        if f is not None and not ok(f.types):
            out.append((key, f"expected {rule}, found {_shown(f)}"))
            return None
        return f

    for k in ("model", "pre"):
        want(f"tokenizer.ggml.{k}", lambda t: t == [8], "a string")
    want("tokenizer.chat_template", lambda t: t == [8], "a string")
    for k in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        want(f"tokenizer.ggml.{k}", lambda t: t == [7], "a boolean")
    for k in _ID_KEYS:
        want(f"tokenizer.ggml.{k}_token_id", lambda t: len(t) == 1 and t[0] in _INTS, "an integer token id")
    tok_f = want("tokenizer.ggml.tokens", lambda t: t == [9, 8], "an array of strings")
    merge_f = want("tokenizer.ggml.merges", lambda t: t == [9, 8], "an array of strings")
    type_f = want("tokenizer.ggml.token_type", lambda t: len(t) == 2 and t[0] == 9 and t[1] in _INTS,
                  "an array of integers")
    score_f = want("tokenizer.ggml.scores", lambda t: len(t) == 2 and t[0] == 9 and t[1] in {**_INTS, **_FLOATS},
                   "an array of numbers")
    if out:
        return out
    mf = get("tokenizer.ggml.model")
    model = mf.contents() if mf is not None else None
    if model not in ("gpt2", "llama"):
        return out  # not rebuilt (reported as a warning); its arrays are never read
    if tok_f is None or tok_f.count == 0:
        return [("tokenizer.ggml.tokens", f"a {model!r} vocabulary needs its tokens: the key is missing or empty")]
    n = tok_f.count
    for key, f in (("tokenizer.ggml.token_type", type_f), ("tokenizer.ggml.scores", score_f)):
        if f is not None and f.count != n:
            out.append((key, f"expected one entry per token ({n}), found {f.count}"))
    if out:
        return out
    tokens = tok_f.contents()
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        j = first.setdefault(t, i)
        if j != i:
            return [("tokenizer.ggml.tokens", f"token ids {j} and {i} are both {t[:40]!r}; every token must be "
                     "unique (a vocabulary maps each text to one id)")]
    if type_f is not None:
        bad = next(((i, v) for i, v in enumerate(type_f.contents()) if not 0 <= v <= BYTE), None)
        if bad is not None:
            out.append(("tokenizer.ggml.token_type", f"entry {bad[0]} is {bad[1]}; token types are 0..{BYTE}"))
    if score_f is not None:
        bad = next(((i, v) for i, v in enumerate(score_f.contents()) if not math.isfinite(v)), None)
        if bad is not None:
            out.append(("tokenizer.ggml.scores", f"entry {bad[0]} is {bad[1]}; scores must be finite"))
    if merge_f is not None:
        for i, m in enumerate(merge_f.contents()):
            ab = split_merge(m)
            if ab is None:
                out.append(("tokenizer.ggml.merges", f"entry {i} {m[:40]!r} is not two tokens separated by a space"))
                break
            missing = next((x for x in (ab[0], ab[1], ab[0] + ab[1]) if x not in first), None)
            if missing is not None:
                out.append(("tokenizer.ggml.merges", f"entry {i} {m[:40]!r}: {missing[:40]!r} is not a token; both "
                            "sides of a merge and their concatenation must be in the vocabulary"))
                break
    return out


def check_tokenizer_file(path: Path, tokens: list[str] | None) -> None:
    """Load a written ``tokenizer.json`` with the ``tokenizers`` library (when it is installed; skipped
    otherwise) and check that it maps every GGUF token to its own id: the converter's verification of its
    tokenizer output.  ``Exl2Error(REFERENCE_MISMATCH)`` naming the file when it does not."""
    from ..errors import ErrorCode, Exl2Error

    try:
        from tokenizers import Tokenizer
    except ImportError:
        return
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library's own error types vary by version
        raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the rebuilt tokenizer.json does not load in the tokenizers "
                        f"library ({type(e).__name__}: {str(e)[:200]})", file=str(path)) from None
    if tokens is None:
        return
    for i, t in enumerate(tokens):
        got = tok.token_to_id(t)
        if got != i and " " in t:
            # a SentencePiece vocabulary written with literal spaces (Gemma 3's GGUF: id 138 is two spaces) is
            # rebuilt in SentencePiece's own spelling, U+2581 for a space, behind a Replace normalizer
            got = tok.token_to_id(t.replace(" ", "\u2581"))
        if got != i:
            raise Exl2Error(ErrorCode.REFERENCE_MISMATCH, f"the rebuilt tokenizer.json maps token {t[:40]!r} to "
                            f"{got}, not to its GGUF id {i}", file=str(path))


def rebuild_tokenizer(reader, warnings: list[str]) -> dict[str, str]:
    """Tokenizer files (name -> text) rebuilt from a GGUF's ``tokenizer.ggml.*``; an empty dict (and a warning)
    when the vocabulary type cannot be rebuilt."""
    model = _field(reader, "tokenizer.ggml.model")
    if model == "llama":
        return rebuild_sentencepiece(reader, warnings)
    if model != "gpt2":
        warnings.append(f"tokenizer: tokenizer.ggml.model = {model!r}; only 'gpt2' (byte-level BPE) and 'llama' "
                        "(SentencePiece) vocabularies are rebuilt as tokenizer.json. The output has no tokenizer "
                        "files: copy them from the original model")
        return {}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges = _field(reader, "tokenizer.ggml.merges") or []
    pre = _field(reader, "tokenizer.ggml.pre") or "default"
    pattern = PRE_PATTERNS.get(pre, "unknown")
    keep_pre = None
    if pattern == "unknown":
        warnings.append(f"tokenizer: pre-tokenizer {pre!r} is not one exl2fmt can rebuild; GPT-2's split is used "
                        f"(tokenizer_config.json {GGUF_PRE_KEY} keeps the name for a conversion back to GGUF)")
        pattern, keep_pre = None, pre
    vocab, added = {}, []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": ty != CONTROL, "special": ty == CONTROL})
        vocab[t] = i
    if pattern is None:
        pre_tok = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    elif pattern == "digits":
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    else:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    flags = {typ: _field(reader, f"tokenizer.ggml.add_{typ}_token") for typ in ("bos", "eos")}
    ids = {typ: _field(reader, f"tokenizer.ggml.{key}_token_id")
           for typ, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    ids = {k: v for k, v in ids.items() if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(tokens)}
    post = post_processor(tokens, ids, flags, warnings)
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
          "pre_tokenizer": pre_tok, "post_processor": post,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": vocab, "merges": [list(split_merge(m)) for m in merges]}}
    tc: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if keep_pre is not None:
        tc[GGUF_PRE_KEY] = keep_pre
    special_map: dict = {}
    for typ in ("bos", "eos", "unk", "pad"):
        tc[f"{typ}_token"] = tokens[ids[typ]] if typ in ids else None
        if typ in ids:
            special_map[f"{typ}_token"] = tokens[ids[typ]]
    for typ in ("bos", "eos"):
        tc[f"add_{typ}_token"] = flags[typ] is True
    ct = _field(reader, "tokenizer.chat_template")
    if isinstance(ct, str):
        tc["chat_template"] = ct
    if flags["bos"] is not True and "bos_token" not in (ct if isinstance(ct, str) else ""):
        # Qwen style: the GGUF's bos id is only config.json's (often <|endoftext|>); the tokenizer has none
        tc["bos_token"] = None
        special_map.pop("bos_token", None)
    return {"tokenizer.json": json.dumps(tj, ensure_ascii=False) + "\n",
            "tokenizer_config.json": json.dumps(tc, indent=2, ensure_ascii=False) + "\n",
            "special_tokens_map.json": json.dumps(special_map, indent=2, ensure_ascii=False) + "\n"}


def post_processor(tokens: list[str], ids: dict[str, int], flags: dict, warnings: list[str]) -> dict:
    """The ``tokenizer.json`` post-processor that adds what the GGUF's ``add_bos_token`` / ``add_eos_token``
    say: a ``TemplateProcessing`` ``[BOS] $A [EOS]`` (each part only when its flag is true; pairs ``$A`` then
    ``[BOS] $B`` as Llama 3 does) or, with neither flag, byte-level offsets only (Qwen style)."""
    parts = []
    for typ in ("bos", "eos"):
        if flags.get(typ) is True:
            if typ not in ids:
                warnings.append(f"tokenizer: add_{typ}_token is set but the GGUF names no {typ} token; not added")
                continue
            parts.append(typ)
    if not parts:
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}

    def seq(letter: str, type_id: int) -> list:
        out = []
        if "bos" in parts:
            out.append({"SpecialToken": {"id": tokens[ids["bos"]], "type_id": type_id}})
        out.append({"Sequence": {"id": letter, "type_id": type_id}})
        if "eos" in parts:
            out.append({"SpecialToken": {"id": tokens[ids["eos"]], "type_id": type_id}})
        return out

    specials = {tokens[ids[t]]: {"id": tokens[ids[t]], "ids": [ids[t]], "tokens": [tokens[ids[t]]]} for t in parts}
    return {"type": "TemplateProcessing", "single": seq("A", 0), "pair": seq("A", 0) + seq("B", 1),
            "special_tokens": specials}


#: GGUF architecture -> the transformers tokenizer class whose layout (pre-tokenizer, decoder) its SentencePiece
#: vocabulary takes in transformers 5; written as ``tokenizer_class`` so a reload builds the same layout.  Phi-3
#: keeps transformers' normalizer-based layout (``PreTrainedTokenizerFast`` loads tokenizer.json as written).
_SP_CLASS = {"gemma": "GemmaTokenizer", "gemma2": "GemmaTokenizer", "gemma3": "GemmaTokenizer",
             "phi3": "PreTrainedTokenizerFast"}


def rebuild_sentencepiece(reader, warnings: list[str]) -> dict[str, str]:
    """``tokenizer.json`` / ``tokenizer_config.json`` / ``special_tokens_map.json`` for a GGUF whose
    ``tokenizer.ggml.model`` is ``"llama"`` (SentencePiece: Llama 2, Mistral v0.1, Gemma 1-3, Phi-3).

    The vocabulary is handed to transformers' GGUF tokenizer builders (``transformers.integrations.gguf``,
    transformers >= 5): a byte-fallback BPE over the tokens in id order, merges recovered from the vocabulary and
    the scores (Gemma: from the file order), CONTROL tokens special and USER_DEFINED ones added whole, the layout
    of ``LlamaTokenizer`` / ``GemmaTokenizer`` / Phi-3.  Where that builder is not what llama.cpp runs, this fixes
    it: it ignores ``tokenizer.ggml.add_space_prefix`` (false: no prefix space, as llama.cpp tokenizes then) for
    the Llama layout, and its post-processor does not follow ``add_bos_token`` / ``add_eos_token``; both are set
    here from the metadata (``add_bos_token`` absent: true, as llama.cpp assumes for SentencePiece).  Special
    token names (BOS/EOS/UNK/PAD) come from the ``*_token_id`` keys.  Without transformers' builders (older
    transformers) the output has no tokenizer files, with a warning."""
    arch = _field(reader, "general.architecture")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    if not tokens or scores is None or types is None or not len(tokens) == len(scores) == len(types):
        warnings.append("tokenizer: the SentencePiece vocabulary needs tokenizer.ggml.tokens, scores and token_type "
                        "of one length; no tokenizer files written")
        return {}
    if not all(isinstance(t, str) for t in tokens) or sum(len(t) ** 2 for t in tokens) > _MAX_MERGE_WORK:
        # recovering merges tries every split of every token: work grows with the square of a token's length
        warnings.append("tokenizer: the SentencePiece tokens are too long to recover merges from (sum of squared "
                        f"lengths above {_MAX_MERGE_WORK}); no tokenizer files written")
        return {}
    try:
        from tokenizers import decoders, pre_tokenizers
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError as e:
        warnings.append(f"tokenizer: rebuilding a SentencePiece vocabulary needs transformers >= 5 ({e}); the output "
                        "has no tokenizer files: copy them from the original model")
        return {}
    prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    tdict = {"tokenizer_type": "llama", "tokens": list(tokens), "scores": list(scores), "token_type": list(types)}
    merges = _field(reader, "tokenizer.ggml.merges")
    if merges:
        tdict["merges"] = list(merges)
    ids = {typ: _field(reader, f"tokenizer.ggml.{key}_token_id")
           for typ, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    ids = {k: v for k, v in ids.items() if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(tokens)}
    try:
        backend, _ = convert_gguf_tokenizer(arch, tdict)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        warnings.append(f"tokenizer: transformers could not build the SentencePiece tokenizer ({type(e).__name__}: "
                        f"{e}); no tokenizer files written")
        return {}
    cls = _SP_CLASS.get(arch, "LlamaTokenizer")
    if cls == "LlamaTokenizer" and prefix is False:
        # transformers' Llama builder always prepends the SentencePiece space; llama.cpp does not when told so
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
    flags = {typ: _field(reader, f"tokenizer.ggml.add_{typ}_token") for typ in ("bos", "eos")}
    flags["bos"] = flags["bos"] is not False
    flags["eos"] = flags["eos"] is True
    tj = json.loads(backend.to_str())
    tj["post_processor"] = post_processor(tokens, ids, flags, warnings)
    if tj["post_processor"].get("type") == "ByteLevel":  # neither flag: no post-processing at all
        tj["post_processor"] = None
    tc: dict = {"tokenizer_class": cls, "add_bos_token": flags["bos"], "add_eos_token": flags["eos"],
                "clean_up_tokenization_spaces": False}
    if cls == "LlamaTokenizer":
        tc["legacy"] = False
        if prefix is False:  # only then: transformers 4's LlamaTokenizerFast rebuilds from tokenizer.model when set
            tc["add_prefix_space"] = False
    special_map: dict = {}
    for typ in ("bos", "eos", "unk", "pad"):
        tc[f"{typ}_token"] = tokens[ids[typ]] if typ in ids else None
        if typ in ids:
            special_map[f"{typ}_token"] = tokens[ids[typ]]
    ct = _field(reader, "tokenizer.chat_template")
    if isinstance(ct, str):
        tc["chat_template"] = ct
    return {"tokenizer.json": json.dumps(tj, ensure_ascii=False) + "\n",
            "tokenizer_config.json": json.dumps(tc, indent=2, ensure_ascii=False) + "\n",
            "special_tokens_map.json": json.dumps(special_map, indent=2, ensure_ascii=False) + "\n"}
