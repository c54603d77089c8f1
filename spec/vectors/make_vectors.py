#!/usr/bin/env python3
"""Generate the golden vectors in spec/vectors/ (see README.md there).

    python spec/vectors/make_vectors.py            # rewrite the vectors next to this script
    python spec/vectors/make_vectors.py OUT_DIR    # write them somewhere else (tests compare the bytes)

Deterministic on every machine: the random codes come from a self-contained SplitMix64 generator (not
NumPy's, whose streams may change between versions), tensors are packed and dequantized only with the
slow NumPy twins of ``exl2fmt.codec.oracle`` (never the Numba codecs under test), and files are written
with ``exl2fmt.container.write_safetensors`` (tensors sorted by name, fixed metadata).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from exl2fmt.codec import oracle as O
from exl2fmt.container import write_safetensors

HERE = Path(__file__).resolve().parent
MODEL_FILE = "model.safetensors"
EXPECTED_FILE = "expected.json"
CONFIG_FILE = "config.json"
SUMS_FILE = "SHA256SUMS"
METADATA = {"format": "pt", "generator": "exl2fmt spec/vectors/make_vectors.py"}


class SplitMix64:
    """Tiny deterministic PRNG (Steele, Lea, Flood 2014); plenty for test data."""

    MASK = (1 << 64) - 1

    def __init__(self, seed: int):
        self.state = seed & self.MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def codes(self, rows: int, cols: int, top: int) -> np.ndarray:
        """Integers in [0, top]; one cell in eight is forced to 0 or top so the limits always occur."""
        out = np.empty((rows, cols), dtype=np.int64)
        for r in range(rows):
            for c in range(cols):
                v = self.next()
                if v % 8 == 0:
                    out[r, c] = top if (v >> 3) & 1 else 0
                else:
                    out[r, c] = (v >> 4) % (top + 1)
        return out

    def permutation(self, n: int) -> np.ndarray:
        p = list(range(n))
        for i in range(n - 1, 0, -1):
            j = self.below(i + 1)
            p[i], p[j] = p[j], p[i]
        return np.array(p, dtype=np.int64)

    def f16(self, n: int, lo: int, hi: int, negative: bool = False) -> np.ndarray:
        """float16 [n] from bit patterns uniform in [lo, hi] (optionally random sign)."""
        pats = [lo + self.below(hi - lo + 1) | ((self.below(2) << 15) if negative else 0) for _ in range(n)]
        return np.array(pats, dtype=np.uint16).view(np.float16)


# ---------------------------------------------------------------------------------------------------
# hex text helpers (the JSON encoding documented in README.md)
# ---------------------------------------------------------------------------------------------------


def hex_rows_u8(a: np.ndarray) -> list[str]:
    """Integer matrix (values < 256) -> one string per row, two hex digits per column."""
    return ["".join(f"{int(v):02x}" for v in row) for row in np.asarray(a)]


def hex_rows_u4(a: np.ndarray) -> list[str]:
    """Integer matrix (values < 16) -> one string per row, one hex digit per column."""
    return ["".join(f"{int(v):x}" for v in row) for row in np.asarray(a)]


def hex_f16(a: np.ndarray) -> str:
    """float16 vector -> four hex digits (the uint16 bit pattern) per value."""
    return "".join(f"{int(v):04x}" for v in np.ascontiguousarray(a, dtype=np.float16).view(np.uint16).ravel())


def hex_rows_f16(a: np.ndarray) -> list[str]:
    return [hex_f16(row) for row in np.asarray(a, dtype=np.float16)]


def dump_json(obj: dict) -> str:
    """Deterministic JSON: one key per line, lists of strings one item per line, everything else compact."""
    lines = ["{"]
    items = list(obj.items())
    for i, (k, v) in enumerate(items):
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            body = "[\n" + ",\n".join("    " + json.dumps(x) for x in v) + "\n  ]"
        else:
            body = json.dumps(v, separators=(", ", ": "))
        lines.append(f"  {json.dumps(k)}: {body}" + ("," if i < len(items) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------
# vector builders
# ---------------------------------------------------------------------------------------------------


def exl2_vector(name, key, bits_rows, N, q_scale_max_bits, seed, bias=False, permute=False, config=None):
    rng = SplitMix64(seed)
    K = sum(r for _, r in bits_rows)
    G = len(bits_rows)
    n_pad = -(-N // 32) * 32
    codes = np.zeros((K, n_pad), dtype=np.int64)
    r0 = 0
    for b, r in bits_rows:
        codes[r0:r0 + r, :N] = rng.codes(r, N, (1 << b) - 1)
        codes[r0:r0 + r, N:] = 1 << (b - 1)  # padding columns: q = z (zero-padded weights, exl2-format.md 3.9)
        r0 += r
    scale_codes = np.zeros((G, n_pad), dtype=np.int64)
    scale_codes[:, :N] = rng.codes(G, N, 15)  # padding columns: code 0
    qsm = np.array(q_scale_max_bits, dtype=np.uint16).view(np.float16)
    perm = rng.permutation(K) if permute else np.arange(K)
    invperm = np.argsort(perm).astype(np.int32)
    tensors = {
        f"{key}.q_weight": O.pack_q_weight(codes, bits_rows),
        f"{key}.q_scale": O.pack_q_scale(scale_codes),
        f"{key}.q_scale_max": qsm,
        f"{key}.q_groups": O.encode_q_groups(bits_rows),
        f"{key}.q_invperm": invperm,
    }
    bias_f16 = None
    if bias:
        bias_f16 = rng.f16(N, 0x0001, 0x5BFF, negative=True)
        padded = np.zeros(n_pad, dtype=np.float16)
        padded[:N] = bias_f16
        tensors[f"{key}.bias"] = padded
    W = O.dequantize(tensors[f"{key}.q_weight"], tensors[f"{key}.q_scale"], qsm, bits_rows, invperm, out_features=N)
    expected = {
        "name": name, "format": "exl2", "key": key, "file": MODEL_FILE,
        "K": K, "N": N, "N_pad": n_pad, "groups": [[b, r] for b, r in bits_rows],
        "q_groups": [int(v) for v in tensors[f"{key}.q_groups"]],
        "q_invperm": [int(v) for v in invperm],
        "q_scale_max_f16": hex_f16(qsm),
        "scale_codes": hex_rows_u4(scale_codes),
        "codes": hex_rows_u8(codes),
        "bias_f16": None if bias_f16 is None else hex_f16(bias_f16),
        "dequant_f16": hex_rows_f16(W),
    }
    return tensors, expected, config


def gptq_vector(name, key, bits, K, N, group_size, sym, v2, act_order, with_g_idx, seed, scale_range):
    rng = SplitMix64(seed)
    G = -(-K // group_size)
    codes = rng.codes(K, N, (1 << bits) - 1)
    if sym:
        zeros = np.full((G, N), 1 << (bits - 1), dtype=np.int64)
    else:
        zeros = rng.codes(G, N, (1 << bits) - 1)  # v2 allows z = 0 (no v1 encoding) and z = 2^b - 1
    fields = zeros if v2 else zeros - 1
    scales = rng.f16(G * N, *scale_range).reshape(G, N)
    if act_order:
        perm = rng.permutation(K)  # processing order; g_idx[k] = (position of k in perm) // group_size
        g_idx = (np.argsort(perm) // group_size).astype(np.int32)
    else:
        g_idx = (np.arange(K) // group_size).astype(np.int32)
    tensors = {
        f"{key}.qweight": O.gptq_pack_rows(codes, bits),
        f"{key}.qzeros": np.ascontiguousarray(O.gptq_pack_rows(fields.T, bits).T),
        f"{key}.scales": scales,
    }
    if with_g_idx:
        tensors[f"{key}.g_idx"] = g_idx
    W = O.gptq_dequantize(tensors[f"{key}.qweight"], tensors[f"{key}.qzeros"], scales, g_idx, bits, v2=v2)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"},
    }
    expected = {
        "name": name, "format": "gptq", "key": key, "file": MODEL_FILE,
        "K": K, "N": N, "bits": bits, "group_size": group_size, "sym": sym, "v2": v2,
        "g_idx": [int(v) for v in g_idx] if with_g_idx else None,
        "zeros": hex_rows_u8(zeros),
        "scales_f16": hex_rows_f16(scales),
        "codes": hex_rows_u8(codes),
        "dequant_f16": hex_rows_f16(W),
    }
    return tensors, expected, config


def dense_vector(name, key, N, K, seed):
    rng = SplitMix64(seed)
    w = rng.f16(N * K, 0x0001, 0x7BFF, negative=True).reshape(N, K)
    b = rng.f16(N, 0x0001, 0x5BFF, negative=True)
    tensors = {f"{key}.weight": w, f"{key}.bias": b}
    expected = {"name": name, "format": "dense", "key": key, "file": MODEL_FILE, "K": K, "N": N,
                "bias_f16": hex_f16(b), "dequant_f16": hex_rows_f16(w)}
    return tensors, expected, None


def _exl3_oracle():
    """The slow NumPy EXL3 twin, tests/exl3_oracle.py (loaded by path: tests/ is not a package)."""
    import importlib.util
    path = HERE.parents[1] / "tests" / "exl3_oracle.py"
    spec = importlib.util.spec_from_file_location("exl3_oracle", path)
    mod = importlib.util.module_from_spec(spec)
    old, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.dont_write_bytecode = old
    return mod


def _ceil128(n: int) -> int:
    return -(-n // 128) * 128


def _rate_tag(rate) -> str:
    """1 -> "1bit", 2.5 -> "2.5bit" (folder names)."""
    return f"{rate:g}bit"


def exl3_vector(name, key, rate, codebook, K, N, seed, legacy=False, bias=False, config=None):
    """One EXL3 linear: random ring words (any bit pattern is a valid ring), tile (0, 1) all zero bits and
    tile (1, 0) all one bits (states 0x0000 / 0xFFFF), random signed scales with one all-zero output channel
    (svh = 0, as exllamav3 writes for an all-zero column), or legacy packed su/sv signs."""
    E = _exl3_oracle()
    rng = SplitMix64(seed)
    in_p, out_p = _ceil128(K), _ceil128(N)
    tk, tn, L = in_p // 16, out_p // 16, E.tile_words(rate)
    words = np.array([rng.next() & 0xFFFF for _ in range(tk * tn * L)], dtype=np.uint16).reshape(tk, tn, L)
    words[0, 1, :] = 0x0000
    words[1, 0, :] = 0xFFFF
    trellis = words.view(np.int16)
    tensors = {f"{key}.trellis": trellis}
    if legacy:
        for slot, n in (("su", in_p // 16), ("sv", out_p // 16)):
            tensors[f"{key}.{slot}"] = np.array([rng.next() & 0xFFFF for _ in range(n)], dtype=np.uint16).view(np.int16)
    else:
        suh = rng.f16(in_p, 0x1C00, 0x2E00, negative=True)   # |suh| in [2^-8, 0.094]: signs x scales x global scale
        svh = rng.f16(out_p, 0x3800, 0x4000, negative=True)  # |svh| in [0.5, 2]
        svh[rng.below(N)] = 0.0                              # one all-zero output channel
        tensors[f"{key}.suh"], tensors[f"{key}.svh"] = suh, svh
    if codebook == "mcg":
        tensors[f"{key}.mcg"] = np.array(E.MCG_MARKER, dtype=np.int32)
    elif codebook == "mul1":
        tensors[f"{key}.mul1"] = np.array(E.MUL1_MARKER, dtype=np.int32)
    bias_f16 = None
    if bias:
        bias_f16 = rng.f16(N, 0x0001, 0x5BFF, negative=True)
        tensors[f"{key}.bias"] = bias_f16
    w_hat, rate_read, cb_read = E.inner_weight(tensors)
    assert rate_read == rate and cb_read == codebook, (name, rate_read, cb_read)
    W = E.dequantize(tensors, K, N)
    states = E.decode_states(trellis, rate)
    perm = E.tc_perm()
    tile0_states = states[:16, :16].reshape(256)[perm]            # ring order: position t
    tile0_values = w_hat[:16, :16].reshape(256)[perm]
    expected = {
        "name": name, "format": "exl3", "key": key, "file": MODEL_FILE,
        "K": K, "N": N, "in_p": in_p, "out_p": out_p, "rate": rate, "trellis_last_dim": L,
        "codebook": codebook, "signs": "su/sv" if legacy else "suh/svh",
        "tile0_words": hex_f16(words[0, 0].view(np.float16)),
        "tile0_states": ["".join(f"{int(v):04x}" for v in tile0_states[16 * i:16 * i + 16]) for i in range(16)],
        "tile0_values_f16": hex_rows_f16(tile0_values.reshape(16, 16)),
        "tile0_inner_f16": hex_rows_f16(w_hat[:16, :16]),
        "inner_sha256": hashlib.sha256(np.ascontiguousarray(w_hat).view(np.uint16).astype("<u2").tobytes()).hexdigest(),
        "bias_f16": None if bias_f16 is None else hex_f16(bias_f16),
        "dequant_f16": hex_rows_f16(W),
    }
    return tensors, expected, config


#: EXL3 rates and the codebooks each one exists with (half rates: mul1 only, exllamav3 1.6.5 bits_k.cuh).
EXL3_RATES = (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5)
EXL3_CODEBOOKS = ("3inst", "mcg", "mul1")
EXL3_PADDED_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 136,
                      "intermediate_size": 200}
EXL3_LEGACY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                      "intermediate_size": 200}


def exl3_names() -> list[str]:
    """Every EXL3 vector folder, in generation order."""
    names = [f"exl3_{_rate_tag(r)}_{cb}" for r in EXL3_RATES for cb in EXL3_CODEBOOKS
             if float(r).is_integer() or cb == "mul1"]
    return names + ["exl3_padded_2.5bit_mul1", "exl3_legacy_su_sv_3bit_3inst"]


def build_exl3() -> dict[str, tuple[dict, dict, dict | None]]:
    v: dict[str, tuple[dict, dict, dict | None]] = {}
    seed = 500
    for r in EXL3_RATES:
        for cb in EXL3_CODEBOOKS:
            if not float(r).is_integer() and cb != "mul1":
                continue
            name = f"exl3_{_rate_tag(r)}_{cb}"
            v[name] = exl3_vector(name, "model.layers.0.self_attn.q_proj", r, cb, 128, 128, seed)
            seed += 1
    # in 200 -> 256 (two input blocks), out 136 -> 256 (two output blocks), bias [N], half rate
    v["exl3_padded_2.5bit_mul1"] = exl3_vector("exl3_padded_2.5bit_mul1", "model.layers.0.mlp.down_proj", 2.5,
                                               "mul1", 200, 136, seed=600, bias=True, config=EXL3_PADDED_CONFIG)
    # legacy packed signs, out 200 -> 256: su [128/16], sv [256/16] (the padded lengths)
    v["exl3_legacy_su_sv_3bit_3inst"] = exl3_vector("exl3_legacy_su_sv_3bit_3inst", "model.layers.0.mlp.gate_proj",
                                                    3, "3inst", 128, 200, seed=601, legacy=True,
                                                    config=EXL3_LEGACY_CONFIG)
    assert list(v) == exl3_names()
    return v


#: q_scale_max of the single-width EXL2 vectors: 1.0, ~0.1, 12.0, 2^-10 (1 + 2^-10) (q_scale_max / 256 is
#: subnormal and rounds), 2^-14 (q_scale_max / 256 subnormal, exact), 255.875.
SINGLE_QSM = {2: 0x3C00, 3: 0x2E66, 4: 0x4A00, 5: 0x1401, 6: 0x0400, 8: 0x5BFF}
MIXED_GROUPS = [(8, 32), (6, 32), (5, 32), (4, 32), (3, 32), (2, 32)]
#: the 2-bit group's 0x0001 makes m = fp16(2^-24 / 256) = 0: its weights are +0 or -0 by the sign of q - z.
MIXED_QSM = [0x3555, 0x2E00, 0x1401, 0x4900, 0x2A00, 0x0001]
MIXED_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 40,
                "intermediate_size": 192}


def build() -> dict[str, tuple[dict, dict, dict | None]]:
    v: dict[str, tuple[dict, dict, dict | None]] = {}
    for b in sorted(SINGLE_QSM):
        name = f"exl2_{b}bit"
        v[name] = exl2_vector(name, "model.layers.0.self_attn.q_proj", [(b, 32)], 32, [SINGLE_QSM[b]], seed=100 + b)
    v["exl2_mixed"] = exl2_vector("exl2_mixed", "model.layers.0.mlp.down_proj", MIXED_GROUPS, 40, MIXED_QSM,
                                  seed=200, bias=True, permute=True, config=MIXED_CONFIG)
    v["gptq_4bit_sym_v1_actorder"] = gptq_vector(
        "gptq_4bit_sym_v1_actorder", "model.layers.0.self_attn.q_proj", bits=4, K=64, N=32, group_size=32,
        sym=True, v2=False, act_order=True, with_g_idx=True, seed=300, scale_range=(0x1800, 0x2C00))
    v["gptq_3bit_asym_v2"] = gptq_vector(
        "gptq_3bit_asym_v2", "model.layers.0.mlp.up_proj", bits=3, K=64, N=32, group_size=32,
        sym=False, v2=True, act_order=False, with_g_idx=False, seed=301, scale_range=(0x1800, 0x3400))
    v["dense_f16"] = dense_vector("dense_f16", "model.layers.0.mlp.gate_proj", N=24, K=40, seed=400)
    v.update(build_exl3())
    return v


def main(out_dir: str | Path = HERE) -> list[Path]:
    """Write every vector under ``out_dir`` (one folder each) and SHA256SUMS; returns the files written."""
    out = Path(out_dir)
    written: list[Path] = []
    for name, (tensors, expected, config) in build().items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        model = write_safetensors(d / MODEL_FILE, tensors, METADATA)
        expected["sha256"] = sha256(model)
        (d / EXPECTED_FILE).write_text(dump_json(expected), encoding="utf-8", newline="\n")
        written += [model, d / EXPECTED_FILE]
        if config is not None:
            (d / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8", newline="\n")
            written.append(d / CONFIG_FILE)
    sums = "".join(f"{sha256(p)}  {p.relative_to(out).as_posix()}\n" for p in sorted(written))
    (out / SUMS_FILE).write_text(sums, encoding="utf-8", newline="\n")
    return written + [out / SUMS_FILE]


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
