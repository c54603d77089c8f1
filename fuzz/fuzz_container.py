#!/usr/bin/env python3
"""Fuzz target: arbitrary bytes -> safetensors header parser -> every layer's validators and decoder.

Only ``exl2fmt.errors.Exl2Error`` may escape from exl2fmt on any input.  Anything else - an ``IndexError``,
``ValueError``, ``MemoryError``, a ``RecursionError``, a Numba bounds fault, a hang, a multi-GB allocation - is
a bug, and so is a broken invariant (``FuzzInvariantError``, see ``check_bytes``).

Three ways to run it (see fuzz/README.md):

    python fuzz/fuzz_container.py fuzz/corpus -max_total_time=120          # coverage-guided, needs atheris
    python fuzz/fuzz_container.py --hypothesis 300 [--seed N]              # CI mode: hypothesis, no atheris
    python fuzz/fuzz_container.py --make-corpus fuzz/corpus                # write the seed corpus
    python fuzz/fuzz_container.py --reproduce fuzz/crashes/crash-...       # re-run one input, show the error

The target (``check_bytes``):

1. ``parse_header(data, file_size=len(data))``: an ``Exl2Error`` ends the run (the input was rejected).
2. Otherwise the bytes are written to a temp file (in /dev/shm when available) and opened with
   ``open_model`` - the same code path as a real file, memory maps included.  It must accept what
   ``parse_header`` accepted, with the same tensors.
3. Every tensor is read with ``get`` (dtype/shape as the header says); ``find_layers`` groups the names and
   for every layer ``load_layer``, ``validate(deep=False)``, ``validate(deep=True)``, ``plan()``, ``bpw()``
   and ``dequantize()`` run.  A layer with no error-severity issue after ``validate(deep=True)`` must
   dequantize to float16 ``[out_features, in_features]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))


#: Library bugs already reported (reproducers in fuzz/crashes/, replayed by tests/test_fuzz_smoke.py as strict
#: xfails).  While TOLERATE_KNOWN is true (the default) an input that hits one of them is counted in KNOWN_HITS
#: and the run goes on, so the fuzzer can look for new bugs; --strict (or EXL2FMT_FUZZ_STRICT=1) reports them.
#: Remove an entry once its bug is fixed.
KNOWN_BUGS: dict[str, str] = {
    # bug id -> description; reproducers in fuzz/crashes/<id>--*.  Fixed bugs are removed from here and
    # their reproducers then replay as ordinary regression inputs.
}
TOLERATE_KNOWN = os.environ.get("EXL2FMT_FUZZ_STRICT", "0") in ("", "0")
KNOWN_HITS: dict[str, int] = {}


class FuzzInvariantError(AssertionError):
    """exl2fmt broke one of its own guarantees on this input (a bug, like an unexpected exception)."""


# exl2fmt is imported by _load(): under atheris the pure-Python modules are imported inside
# atheris.instrument_imports() (coverage feedback), while the Numba codecs are imported afterwards,
# uninstrumented (Numba compiles from bytecode and must see the original).
_M = {}


def _load(instrument: bool = False) -> None:
    if _M:
        return
    ctx = contextlib.nullcontext()
    if instrument:
        import atheris

        ctx = atheris.instrument_imports(include=["exl2fmt"], exclude=["exl2fmt.codec"])
    with ctx:
        import exl2fmt.arch  # noqa: F401
        import exl2fmt.groups  # noqa: F401
        import exl2fmt.layout  # noqa: F401
        from exl2fmt.container import open_model, parse_header
        from exl2fmt.errors import ErrorCode, Exl2Error, Issue, Severity
        from exl2fmt.formats import layer_from_tensors
        from exl2fmt.model import find_layers, load_layer
    import numpy as np

    import exl2fmt.codec.exl2  # noqa: F401  (uninstrumented, see above)
    import exl2fmt.codec.gptq  # noqa: F401
    _M.update(np=np, open_model=open_model, parse_header=parse_header, ErrorCode=ErrorCode, Exl2Error=Exl2Error,
              Issue=Issue, Severity=Severity, find_layers=find_layers, load_layer=load_layer,
              layer_from_tensors=layer_from_tensors)


def _check_error(e) -> None:
    """Every Exl2Error carries a closed-enum code and prints as one escaped line."""
    if not isinstance(e.code, _M["ErrorCode"]):
        raise FuzzInvariantError(f"Exl2Error with a code outside ErrorCode: {e.code!r}")
    line = e.one_line()
    if any(c in line for c in "\n\r\x1b\x07\x00"):
        raise FuzzInvariantError(f"Exl2Error message is not one escaped line: {line!r}")


def _check_issue(i) -> None:
    if not isinstance(i, _M["Issue"]) or not isinstance(i.code, _M["ErrorCode"]):
        raise FuzzInvariantError(f"validate() returned a non-Issue: {i!r}")
    _check_error(i.to_error())


#: config.json variants (text, or None for none): load_layer reads out_features, GPTQ bits/group size from it.
CONFIGS: list[str | None] = [
    None, None, None,
    json.dumps({"hidden_size": 128, "intermediate_size": 40, "vocab_size": 40, "num_attention_heads": 4}),
    json.dumps({"hidden_size": 33, "intermediate_size": 1, "vocab_size": 1, "num_attention_heads": 0,
                "head_dim": -8}),
    json.dumps({"text_config": {"hidden_size": 64, "intermediate_size": 7}, "vocab_size": 2**40}),
    json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}),
    json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": -1, "desc_act": True}}),
    json.dumps({"quantization_config": {"bits": 8, "group_size": 7, "checkpoint_format": "gptq_v2"}}),
    json.dumps({"quantization_config": {"bits": 5, "group_size": 0}}),
    json.dumps({"quantization_config": {"bits": 2, "group_size": 2**40, "meta": {"quantizer": ["x", 1]}}}),
    json.dumps({"quantization_config": "exl2", "text_config": [1, 2], "hidden_size": True}),
    "[1, 2, 3]",
    "{not json",
]


class Target:
    """The fuzz target; one temp file, rewritten for each input."""

    def __init__(self, tmp_dir: str | None = None, configs: list[str | None] | None = None):
        _load()
        self.configs = CONFIGS if configs is None else configs
        base = tmp_dir or ("/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
        self.dir = tempfile.mkdtemp(prefix="exl2fmt-fuzz-", dir=base)
        self.path = os.path.join(self.dir, "fuzz.safetensors")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)

    def _write(self, data: bytes) -> None:
        # unlink first: arrays of the previous input may still map the old inode (no SIGBUS on rewrite)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with open(self.path, "wb") as f:
            f.write(data)
        # a config.json chosen by the input's CRC (so an input always replays with the same config)
        cfg_path = os.path.join(self.dir, "config.json")
        cfg = self.configs[zlib.crc32(data) % len(self.configs)]
        if cfg is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg_path)
        else:
            with open(cfg_path, "w", encoding="utf-8") as f:
                f.write(cfg)

    def __call__(self, data: bytes) -> None:
        check_bytes(data, self)


def check_bytes(data: bytes, target: Target) -> None:
    """Run one input through the container and the layer validators (see the module docstring)."""
    Exl2Error = _M["Exl2Error"]
    try:
        hdr = _M["parse_header"](data, file_size=len(data), path="fuzz.safetensors")
    except Exl2Error as e:
        _check_error(e)
        return
    target._write(data)
    try:
        model = _M["open_model"](target.path)
    except Exl2Error as e:
        raise FuzzInvariantError(f"parse_header accepted the bytes, open_model rejected the file: {e}") from None
    try:
        names = model.names()
        if sorted(names) != sorted(hdr.tensors):
            raise FuzzInvariantError("open_model lists other tensors than parse_header")
        shapes = {}
        for n in names:
            info = model.info(n)
            try:
                a = model.get(n)
            except Exl2Error as e:  # e.g. a zero-size tensor numpy cannot shape ([0, 2**64-1])
                _check_error(e)
                continue
            packed = info.dtype in ("F4", "F6_E2M3", "F6_E3M2")  # returned as their packed bytes, 1-D
            if tuple(a.shape) != ((info.nbytes,) if packed else tuple(info.shape)):
                raise FuzzInvariantError(f"get({n!r}) has shape {a.shape}, header says {info.shape}")
            shapes[n] = info.shape
        for key in _M["find_layers"](names, shapes):
            _exercise_layer(model, key)
    finally:
        model.close()


def _exercise_layer(model, key: str) -> None:
    Exl2Error, Severity, np = _M["Exl2Error"], _M["Severity"], _M["np"]
    try:
        layer = _M["load_layer"](model, key)
    except Exl2Error as e:
        _check_error(e)
        return
    except ValueError:
        if any(_huge_zero_dim(model.info(n).shape) for n in model.names() if n.startswith(key + ".")) \
                and _known("get-huge-zero-dim"):
            return
        raise
    errors = shallow_errors = None
    for deep in (False, True):
        try:
            issues = layer.validate(deep=deep)
        except Exl2Error as e:
            _check_error(e)
            errors = [e]
        except ZeroDivisionError:
            if type(layer).__name__ == "GptqLinear" and _zero_size(layer) and _known("gptq-validate-k0"):
                return
            raise
        else:
            for i in issues:
                _check_issue(i)
            errors = [i for i in issues if i.severity is Severity.ERROR]
        if not deep:
            shallow_errors = errors
    for method in ("plan", "bpw"):
        try:
            getattr(layer, method)()
        except Exl2Error as e:
            _check_error(e)
        except (KeyError, IndexError, ZeroDivisionError):
            if shallow_errors and _known("introspect-invalid"):
                continue
            if method == "bpw" and not shallow_errors and _zero_size(layer) and _known("bpw-zero-size"):
                continue
            raise
    try:
        w = layer.dequantize()
    except Exl2Error as e:
        _check_error(e)
        if not errors and type(layer).__name__ == "GptqLinear" and _gptq_groups(layer) == 0 \
                and _known("gptq-no-groups"):
            return
        if not errors:
            raise FuzzInvariantError(f"layer {key!r} passed validate(deep=True) but dequantize raised: {e}") from None
        return
    want = (layer.out_features, layer.in_features)
    if not isinstance(w, np.ndarray) or w.dtype != np.float16 or tuple(w.shape) != want:
        raise FuzzInvariantError(f"dequantize({key!r}) gave {type(w).__name__} "
                                 f"{getattr(w, 'dtype', '?')} {getattr(w, 'shape', '?')}, expected float16 {want}")


def _known(bug: str) -> bool:
    if not TOLERATE_KNOWN or bug not in KNOWN_BUGS:
        return False
    KNOWN_HITS[bug] = KNOWN_HITS.get(bug, 0) + 1
    return True


def _huge_zero_dim(shape) -> bool:
    """A zero-size shape numpy cannot represent (a dim, or the product of the other dims x 8, >= 2**63)."""
    nonzero = 1
    for d in shape:
        nonzero *= d or 1
    return 0 in shape and nonzero * 8 >= 2**63


def _zero_size(layer) -> bool:
    try:
        return 0 in (int(layer.in_features), int(layer.out_features))
    except Exception:  # noqa: BLE001 - only a classifier for a known bug
        return False


def _gptq_groups(layer) -> int | None:
    qz = layer.tensors.get("qzeros")
    return int(qz.shape[0]) if qz is not None and len(qz.shape) == 2 else None


# ---------------------------------------------------------------------------------------------------------
# seeds
# ---------------------------------------------------------------------------------------------------------

def builtin_seeds() -> list[bytes]:
    """Small valid files built in memory: an EXL2 layer (3 tiers, act-order, bias, q_perm), a GPTQ layer and a
    dense layer in one file; and each alone.  Valid inputs let mutations reach the layer validators."""
    _load()
    np = _M["np"]
    from exl2fmt.codec.gptq import pack_qweight, pack_qzeros
    from exl2fmt.container import serialize
    from exl2fmt.formats.exl2 import exl2_tensors

    K, N = 128, 40
    bits_rows = [(8, 32), (4, 64), (2, 32)]
    codes = np.concatenate([(np.arange(r * 64) * 7 % (1 << b)).reshape(r, 64) for b, r in bits_rows]).astype(np.uint8)
    scale_codes = (np.arange(3 * 64) % 16).reshape(3, 64).astype(np.uint8)
    invperm = np.argsort((np.arange(K) * 37) % K).astype(np.int32)
    exl2 = exl2_tensors(codes, scale_codes, np.array([0.02, 0.01, 0.005], dtype=np.float16), bits_rows, invperm,
                        bias=np.linspace(-1, 1, N).astype(np.float16))
    exl2["q_perm"] = np.argsort(invperm).astype(np.int32)
    gk, gn = 64, 32
    gptq = {"qweight": pack_qweight((np.arange(gk * gn) % 16).reshape(gk, gn).astype(np.uint8), 4),
            "qzeros": pack_qzeros(np.full((2, gn), 7, dtype=np.uint8), 4),
            "scales": np.full((2, gn), 0.01, dtype=np.float16),
            "g_idx": (np.arange(gk) // 32).astype(np.int32)}
    dense = {"weight": np.linspace(-1, 1, 16 * 32).reshape(16, 32).astype(np.float16)}
    parts = {
        "model.layers.0.mlp.down_proj": exl2,
        "model.layers.0.self_attn.q_proj": gptq,
        "model.layers.0.self_attn.o_proj": dense,
    }
    flat = {f"{k}.{s}": a for k, slots in parts.items() for s, a in slots.items()}
    out = [serialize(flat, {"format": "pt"})]
    out += [serialize({f"{k}.{s}": a for s, a in slots.items()}) for k, slots in parts.items()]
    return out


def file_seeds(include_sample: bool = True) -> list[tuple[str, bytes]]:
    """spec/malformed/**, spec/vectors/** (*.safetensors) and the sample model's output.safetensors."""
    out = []
    for sub in ("spec/malformed", "spec/vectors"):
        for p in sorted((ROOT / sub).rglob("*.safetensors")):
            if p.is_file() and p.stat().st_size <= 1 << 20:
                out.append((p.relative_to(ROOT).as_posix(), p.read_bytes()))
    if include_sample:
        from exl2fmt.sample import write_sample

        with tempfile.TemporaryDirectory() as d:
            write_sample(d)
            out.append(("sample/output.safetensors", (Path(d) / "output.safetensors").read_bytes()))
    return out


def make_corpus(directory: str | os.PathLike) -> int:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    n = 0
    for i, data in enumerate(builtin_seeds()):
        (d / f"builtin-{i}.safetensors").write_bytes(data)
        n += 1
    for name, data in file_seeds():
        (d / name.replace("/", "__")).write_bytes(data)
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------------
# mutations (hypothesis mode)
# ---------------------------------------------------------------------------------------------------------

_EDGE_INTS = [0, 1, -1, 2, 3, 5, 7, 8, 9, 31, 32, 33, 255, 256, 32767, 32768, -32768, 65535, 65536, 65537,
              2**31 - 1, 2**31, -2**31, 2**32, 2**53, 2**63, 2**64 - 1, 2**64, 10**30]
_DTYPES = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64", "U64", "F64", "C64", "F4",
           "F6_E2M3", "F8_E4M3", "Q4_K", "", "f16"]
_SAME_WIDTH = {1: ["U8", "I8", "BOOL", "F8_E4M3", "F8_E5M2"], 2: ["I16", "U16", "F16", "BF16"],
               4: ["I32", "U32", "F32"], 8: ["I64", "U64", "F64", "C64"]}
_WIDTH = {d: w for w, ds in _SAME_WIDTH.items() for d in ds}
_SLOTS = ["q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_perm", "bias", "q_group_map", "qweight",
          "qzeros", "scales", "g_idx", "weight"]


def _split(data: bytes):
    """(header dict, data bytes) of a parseable file, else None."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        return None
    try:
        hdr = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(hdr, dict):
        return None
    return hdr, data[8 + n:]


def _join(hdr: dict, body: bytes) -> bytes:
    hb = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    return struct.pack("<Q", len(hb)) + hb + body


def _tensors(hdr: dict) -> list[str]:
    return sorted(k for k, v in hdr.items() if k != "__metadata__" and isinstance(v, dict))


def mutate(data: bytes, op: tuple) -> bytes:
    """Apply one mutation ``(kind, a, b, c)`` (ints choose positions/values) to a file's bytes."""
    kind, a, b, c = op
    if kind == "flip":  # flip bits of one byte anywhere
        if not data:
            return data
        i = a % len(data)
        return data[:i] + bytes([data[i] ^ (b % 255 + 1)]) + data[i + 1:]
    if kind == "truncate":
        return data[: a % (len(data) + 1)]
    if kind == "append":
        return data + bytes([b % 256]) * (a % 64 + 1)
    if kind == "set_len":
        if len(data) < 8:
            return data
        return struct.pack("<Q", _EDGE_INTS[a % len(_EDGE_INTS)] % 2**64 if b % 2 else
                           max(0, struct.unpack("<Q", data[:8])[0] + (c % 17) - 8)) + data[8:]
    split = _split(data)
    if split is None:
        return data
    hdr, body = split
    names = _tensors(hdr)
    if not names:
        return data
    name = names[a % len(names)]
    ent = hdr[name]
    if kind == "write_value":  # overwrite one element of a tensor's data with an edge value (container stays valid)
        try:
            begin, end = ent["data_offsets"]
            width = _WIDTH.get(ent["dtype"], 1)
        except (KeyError, TypeError, ValueError):
            return data
        if not (isinstance(begin, int) and isinstance(end, int)) or begin < 0 or end - begin < width \
                or end > len(body):
            return data
        pos = begin + (b % ((end - begin) // width)) * width
        v = _EDGE_INTS[c % len(_EDGE_INTS)]
        if ent["dtype"] in ("F16", "BF16") and c % 3 == 0:
            raw = struct.pack("<H", [0x7E00, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001][c % 6])
        else:
            raw = (v % 2 ** (8 * width)).to_bytes(width, "little")
        return data[: len(data) - len(body)] + body[:pos] + raw + body[pos + width:]
    if kind == "flip_data":  # flip a byte inside one tensor (container stays valid)
        try:
            begin, end = ent["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return data
        if not (isinstance(begin, int) and isinstance(end, int)) or not 0 <= begin < end <= len(body):
            return data
        i = begin + b % (end - begin)
        return data[: len(data) - len(body)] + body[:i] + bytes([body[i] ^ (c % 255 + 1)]) + body[i + 1:]
    if kind == "retype":  # same element width: container stays valid, layer sees another dtype
        w = _WIDTH.get(ent.get("dtype"))
        if w is None:
            return data
        ent["dtype"] = _SAME_WIDTH[w][b % len(_SAME_WIDTH[w])]
        return _join(hdr, body)
    if kind == "reshape":  # same element count: container stays valid, layer sees another shape
        shape = ent.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            return data
        numel = 1
        for d in shape:
            numel *= d
        choices = [[numel], list(reversed(shape)), shape + [1], [1] + shape, shape[:-1]]
        if numel and numel % 2 == 0:
            choices.append([2, numel // 2])
        if numel and numel % 32 == 0:
            choices += [[numel // 32, 32], [32, numel // 32]]
        new = choices[b % len(choices)]
        n2 = 1
        for d in new:
            n2 *= d
        if n2 != numel:
            return data
        ent["shape"] = new
        return _join(hdr, body)
    if kind == "rename":  # move a tensor to another slot name (possibly another layer format)
        key, _, _ = name.rpartition(".")
        new = f"{key}.{_SLOTS[b % len(_SLOTS)]}" if key else _SLOTS[b % len(_SLOTS)]
        if new in hdr:
            return data
        hdr[new] = hdr.pop(name)
        return _join(hdr, body)
    if kind in ("drop", "zero_dim"):
        # drop: remove a tensor entry and its bytes; zero_dim: set one dim to 0 and remove its bytes.  Later
        # offsets shift down, so the container stays valid.
        try:
            begin, end = ent["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return data
        if not (isinstance(begin, int) and isinstance(end, int)) or not 0 <= begin <= end <= len(body):
            return data
        if kind == "drop":
            del hdr[name]
        else:
            shape = ent.get("shape")
            if not isinstance(shape, list) or not shape:
                return data
            shape[b % len(shape)] = 0
            ent["data_offsets"] = [begin, begin]
        for other in _tensors(hdr):
            off = hdr[other].get("data_offsets")
            if other != name and isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) for x in off) \
                    and off[0] >= end and end > begin:
                hdr[other]["data_offsets"] = [off[0] - (end - begin), off[1] - (end - begin)]
        return _join(hdr, body[:begin] + body[end:])
    if kind == "edit":  # header JSON edit: one field of one entry gets an odd value
        field = ["dtype", "shape", "data_offsets", "shape", "data_offsets"][b % 5]
        v = _EDGE_INTS[c % len(_EDGE_INTS)]
        if field == "dtype":
            ent["dtype"] = _DTYPES[c % len(_DTYPES)] if c % 7 else v
        elif field == "shape":
            shape = list(ent.get("shape") or [0]) if isinstance(ent.get("shape"), list) else [0]
            pick = c % 6
            if pick == 0:
                shape[(c // 6) % len(shape)] = v
            elif pick == 1:
                shape.append(v)
            elif pick == 2:
                shape = [True] + shape
            elif pick == 3:
                shape = shape[:-1]
            elif pick == 4:
                shape = [1] * (c % 12)
            else:
                shape = [v, v]
            ent["shape"] = shape
        else:
            off = ent.get("data_offsets")
            off = list(off) if isinstance(off, list) and len(off) == 2 else [0, 0]
            off[c % 2] = v if c % 3 else off[c % 2] + (c % 5) - 2
            ent["data_offsets"] = off
        return _join(hdr, body)
    return data


MUTATION_KINDS = ("flip", "truncate", "append", "set_len", "write_value", "write_value", "flip_data", "flip_data",
                  "retype", "reshape", "rename", "drop", "zero_dim", "edit", "edit")


#: mutations that keep a valid file valid (they change what the layer validators see, not the container)
PRESERVING_KINDS = ("write_value", "flip_data", "retype", "reshape", "rename", "drop", "zero_dim")


def hypothesis_strategy(seeds: list[bytes]):
    from hypothesis import strategies as st

    from exl2fmt.container import parse_header
    from exl2fmt.errors import Exl2Error

    valid = []
    for s in seeds:
        try:
            parse_header(s, file_size=len(s), path="seed")
            valid.append(s)
        except Exl2Error:
            pass
    ints = st.integers(0, 2**31 - 1)
    op = st.tuples(st.sampled_from(MUTATION_KINDS), ints, ints, ints)
    mutated = st.tuples(st.integers(0, len(seeds) - 1), st.lists(op, min_size=1, max_size=4)).map(
        lambda t: _apply(seeds[t[0]], t[1]))
    if valid:
        pop = st.tuples(st.sampled_from(PRESERVING_KINDS), ints, ints, ints)
        structural = st.tuples(st.integers(0, len(valid) - 1), st.lists(pop, min_size=1, max_size=5)).map(
            lambda t: _apply(valid[t[0]], t[1]))
        mutated = st.one_of(mutated, structural, structural)
    entry = st.fixed_dictionaries({
        "dtype": st.sampled_from(_DTYPES),
        "shape": st.lists(st.one_of(st.integers(-2, 70), st.sampled_from(_EDGE_INTS)), max_size=3),
        "data_offsets": st.lists(st.one_of(st.integers(0, 64), st.sampled_from(_EDGE_INTS)), min_size=2, max_size=2)})
    names = st.one_of(st.sampled_from(["a", "lm_head.weight", "x.q_weight", "x.q_groups", "x.q_invperm",
                                       "x.qweight", "x.qzeros", "x.scales", "x.weight"]), st.text(max_size=8))
    built = st.tuples(st.dictionaries(names, entry, max_size=4), st.binary(max_size=128)).map(
        lambda t: _join(t[0], t[1]))
    return st.one_of(mutated, mutated, mutated, built, st.binary(max_size=256))


def _apply(data: bytes, ops) -> bytes:
    for o in ops:
        data = mutate(data, o)
    return data


def run_hypothesis(n: int, *, seed: int | None = None, include_sample: bool = True, derandomize: bool = False,
                   seeds: list[bytes] | None = None) -> None:
    """Run the target on ``n`` hypothesis examples (raises the first failure, shrunk)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    if seeds is None:
        seeds = builtin_seeds() + [d for _, d in file_seeds(include_sample)]
    target = Target()

    @settings(max_examples=n, deadline=None, database=None, derandomize=derandomize, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(hypothesis_strategy(seeds))
    def fuzz_one(data):
        target(data)

    if seed is not None:
        fuzz_one = hseed(seed)(fuzz_one)
    try:
        fuzz_one()
    finally:
        target.close()


# ---------------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--hypothesis", type=int, metavar="N")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--no-sample", action="store_true")
    ap.add_argument("--make-corpus", metavar="DIR")
    ap.add_argument("--reproduce", metavar="FILE", nargs="+")
    ap.add_argument("--no-config", action="store_true", help="with --reproduce: no config.json beside the input")
    ap.add_argument("--strict", action="store_true", help="report the KNOWN_BUGS too")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv[1:])
    if args.help:
        print(__doc__)
        return 0
    if args.strict:
        global TOLERATE_KNOWN
        TOLERATE_KNOWN = False
    if args.make_corpus:
        print(f"wrote {make_corpus(args.make_corpus)} seed files to {args.make_corpus}")
        return 0
    if args.reproduce:
        target = Target(configs=[None] if args.no_config else None)
        try:
            for f in args.reproduce:
                before = dict(KNOWN_HITS)
                target(Path(f).read_bytes())
                hit = sorted(k for k in KNOWN_HITS if KNOWN_HITS[k] != before.get(k))
                print(f"{f}: " + (f"known bug {', '.join(hit)} (tolerated; --strict to raise it)" if hit
                                  else "ok (only Exl2Error, invariants hold)"))
        finally:
            target.close()
        return 0
    if args.hypothesis is not None:
        run_hypothesis(args.hypothesis, seed=args.seed, include_sample=not args.no_sample)
        print(f"{args.hypothesis} hypothesis examples: no new bug found; known bugs hit: {KNOWN_HITS or 'none'}")
        return 0
    import atheris

    _load(instrument=True)
    target = Target()
    # compile (or load cached) Numba kernels before fuzzing so the first inputs are not timed out
    for s in builtin_seeds():
        target(s)
    atheris.Setup([argv[0], *rest], lambda data: target(bytes(data)))
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
