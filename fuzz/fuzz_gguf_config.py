#!/usr/bin/env python3
"""Fuzz the GGUF reader and the config.json number checks (issue 11): the only exception allowed is Exl2Error.

    .venv/bin/python fuzz/fuzz_gguf_config.py --random 2000 [--seed N]    # stdlib mutation driver, no atheris
    .venv/bin/python fuzz/fuzz_gguf_config.py CORPUS_DIR -max_total_time=300 -rss_limit_mb=2048 -timeout=10
                                                                          # coverage-guided, with atheris

One input drives two targets (the first byte picks which):

* **gguf** - the bytes are a ``.gguf`` file: ``exl2fmt.gguf_scan.open_gguf_file`` (bounded walk), every
  field's ``contents()``, ``gguf_hparam_issues``, every tensor's ``data`` view, ``inspect_model`` (its report
  must serialise as strict JSON: no NaN) and ``converters.gguf_read.build_config``;
* **config** - the bytes are the text of a ``config.json`` beside a tiny valid EXL2 + GPTQ + dense model:
  ``validate_model(deep=True)``, ``inspect_model`` (strict JSON again), ``dequantize_layer`` of each layer.

Invariants besides "only Exl2Error": error codes from the closed enum, one escaped line per error.
Seeds (``seeds()``): hand-built GGUFs (valid, long arrays, nested arrays, huge counts) and configs with edge
numbers; mutations are byte flips, 8-byte integer overwrites with edge values, truncation, and for configs
JSON number substitutions.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "spec" / "malformed"))


class FuzzInvariantError(AssertionError):
    pass


_M: dict = {}


def _load(instrument: bool = False) -> None:
    if _M:
        return
    ctx = contextlib.nullcontext()
    if instrument:
        import atheris

        ctx = atheris.instrument_imports(include=["exl2fmt", "converters"], exclude=["exl2fmt.codec"])
    with ctx:
        from exl2fmt.errors import ErrorCode, Exl2Error
        from exl2fmt.gguf_scan import gguf_hparam_issues, open_gguf_file
        from exl2fmt.inspect import inspect_model
        from exl2fmt.model import dequantize_layer
        from exl2fmt.validate import validate_model
        from exl2fmt.converters.gguf_read import build_config
    _M.update(ErrorCode=ErrorCode, Exl2Error=Exl2Error, open_gguf_file=open_gguf_file,
              gguf_hparam_issues=gguf_hparam_issues, inspect_model=inspect_model, validate_model=validate_model,
              dequantize_layer=dequantize_layer, build_config=build_config)


def _check_error(e) -> None:
    if not isinstance(e.code, _M["ErrorCode"]):
        raise FuzzInvariantError(f"code outside ErrorCode: {e.code!r}")
    line = e.one_line()
    if any(c in line for c in "\n\r\x1b\x07\x00"):
        raise FuzzInvariantError(f"not one escaped line: {line!r}")


def _strict_json(doc) -> None:
    try:
        json.dumps(doc, allow_nan=False, default=str)
    except ValueError as e:
        raise FuzzInvariantError(f"report is not strict JSON: {e}") from None


class Target:
    def __init__(self):
        _load()
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="exl2fmt-fuzz-gc-", dir=base)
        self.gguf = os.path.join(self.dir, "f.gguf")
        self.model = os.path.join(self.dir, "model")
        os.mkdir(self.model)
        from make_hostile import tiny_model_tensors  # the catalogue's tiny valid layers

        from exl2fmt.container import write_safetensors

        write_safetensors(os.path.join(self.model, "model.safetensors"), tiny_model_tensors())
        self.layers = ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"]
        self.execs = 0

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def __call__(self, data: bytes) -> None:
        self.execs += 1
        if not data:
            return
        Exl2Error = _M["Exl2Error"]
        try:
            if data[0] & 1:
                self._gguf(data[1:])
            else:
                self._config(data[1:])
        except Exl2Error as e:
            _check_error(e)

    def _gguf(self, data: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.gguf)
        with open(self.gguf, "wb") as f:
            f.write(data)
        g = _M["open_gguf_file"](self.gguf)
        try:
            arch = None
            for f in g.fields.values():
                try:
                    v = f.contents()
                except UnicodeDecodeError:
                    continue  # a non-UTF-8 string value: readers skip it (inspect) or treat it as absent
                if f.name == "general.architecture" and isinstance(v, str):
                    arch = v
            for _ in _M["gguf_hparam_issues"](g, arch):
                pass
            for t in g.tensors:
                a = t.data
                if a.nbytes != t.n_bytes:
                    raise FuzzInvariantError(f"tensor {t.name!r} view holds {a.nbytes} bytes, info says {t.n_bytes}")
            _M["build_config"](g, self.gguf, [])  # an Exl2Error here is handled by __call__
        finally:
            g.close()
        _strict_json(_M["inspect_model"](self.gguf))

    def _config(self, data: bytes) -> None:
        with open(os.path.join(self.model, "config.json"), "wb") as f:
            f.write(data)
        rep = _M["validate_model"](self.model, deep=True)
        _strict_json(rep.as_dict())
        _strict_json(_M["inspect_model"](self.model))
        for key in self.layers:
            try:
                _M["dequantize_layer"](self.model, key)
            except _M["Exl2Error"] as e:
                _check_error(e)


# ------------------------------------------------------------------------------------------------ seeds

def seeds() -> list[bytes]:
    from make_hostile import ARR, F32, STR, U8, U32, gguf_bytes, gguf_llama_kvs

    import numpy as np

    emb = np.zeros((4, 32), np.float32).tobytes()
    out = []
    kv = gguf_llama_kvs(block_count=1)
    tensors = [("token_embd.weight", [32, 4], 0, emb), ("blk.0.attn_norm.weight", [32], 0, b"\0" * 128)]
    out.append(b"\x01" + gguf_bytes(kv, tensors))
    out.append(b"\x01" + gguf_bytes(kv + [("tokenizer.ggml.tokens", ARR, (STR, ["a", "b", "c"]))], tensors))
    out.append(b"\x01" + gguf_bytes(kv + [("x.arr", ARR, (U8, (1000, b"\0" * 1000)))], tensors))
    out.append(b"\x01" + gguf_bytes(kv + [("x.nest", ARR, (ARR, [(U32, [1, 2]), (F32, [0.5])]))], tensors))
    base_cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 32,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    out.append(b"\x00" + json.dumps(base_cfg).encode())
    for k, v in (("hidden_size", 0), ("vocab_size", 10 ** 30), ("rms_norm_eps", float("nan")),
                 ("num_attention_heads", -1)):
        out.append(b"\x00" + json.dumps(dict(base_cfg, **{k: v})).encode())
    out.append(b"\x00" + json.dumps(dict(base_cfg, quantization_config={"quant_method": "gptq", "bits": 4,
                                                                        "group_size": 0})).encode())
    return out


_EDGE = [0, 1, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 63 - 1, 2 ** 64 - 1, 1 << 20, 1 << 40]
_NUMS = ["0", "-1", "1e308", "NaN", "Infinity", "-Infinity", "1" + "0" * 30, "true", "null", "0.5", "[]", "{}"]


def mutate(data: bytes, rnd: random.Random) -> bytes:
    b = bytearray(data)
    op = rnd.randrange(6)
    if not b:
        return bytes(rnd.randbytes(rnd.randrange(64)))
    if op == 0:
        for _ in range(rnd.randrange(1, 8)):
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
    elif op == 1 and len(b) > 9:
        i = rnd.randrange(1, len(b) - 8)
        b[i:i + 8] = struct.pack("<Q", rnd.choice(_EDGE))
    elif op == 2 and len(b) > 5:
        i = rnd.randrange(1, len(b) - 4)
        b[i:i + 4] = struct.pack("<I", rnd.choice(_EDGE) & 0xFFFFFFFF)
    elif op == 3:
        del b[rnd.randrange(1, len(b) + 1):]
    elif op == 4 and b[0] & 1 == 0:
        text = bytes(b[1:]).decode("utf-8", "replace")
        import re

        nums = list(re.finditer(r"-?\d+(\.\d+)?(e-?\d+)?", text))
        if nums:
            m = rnd.choice(nums)
            text = text[:m.start()] + rnd.choice(_NUMS) + text[m.end():]
        b = bytearray(b[:1] + text.encode())
    else:
        i = rnd.randrange(len(b) + 1)
        b[i:i] = rnd.randbytes(rnd.randrange(1, 16))
    return bytes(b)


def run_random(n: int, seed: int = 0, seconds: float | None = None) -> tuple[int, int]:
    import time

    rnd = random.Random(seed)
    pool = seeds()
    target = Target()
    t0 = time.monotonic()
    i = 0
    try:
        while i < n and (seconds is None or time.monotonic() - t0 < seconds):
            data = rnd.choice(pool)
            for _ in range(rnd.randrange(1, 4)):
                data = mutate(data, rnd)
            try:
                target(data)
            except BaseException:
                crash = ROOT / "fuzz" / "crashes" / f"gguf-config-{seed}-{i}.bin"
                crash.write_bytes(data)
                print(f"crash after {i} inputs; input saved to {crash}", file=sys.stderr)
                raise
            i += 1
    finally:
        target.close()
    return i, int(time.monotonic() - t0)


def main(argv: list[str]) -> int:
    if len(argv) > 1 and argv[1] == "--random":
        n = int(argv[2]) if len(argv) > 2 else 1000
        seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
        secs = float(argv[argv.index("--seconds") + 1]) if "--seconds" in argv else None
        done, took = run_random(n, seed, secs)
        print(f"{done} inputs in {took} s: only Exl2Error, invariants hold")
        return 0
    if len(argv) > 1 and argv[1] == "--make-corpus":
        d = Path(argv[2])
        d.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(seeds()):
            (d / f"seed-{i:02d}").write_bytes(s)
        return 0
    import atheris

    _load(instrument=True)
    target = Target()
    atheris.Setup(argv, lambda data: target(bytes(data)))
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
