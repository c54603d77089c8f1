"""Peer check of the EXL3 oracle (tests/exl3_oracle.py; the Numba codec is bit-identical to it by
tests/test_exl3_codec.py) against exllamav3 1.6.5's own code, on the CPU (issue 39).

Nothing of exllamav3 is copied into this file or the project: at run time the script reads the unpacked wheel
(EXL3_SRC: the ``exllamav3`` folder of the unpacked 1.6.5 wheel), splices the pure functions it needs into a temporary
directory, compiles them with g++ (single job) and loads them with ctypes; Python pieces are taken out of the
sources with ast and executed with torch on the CPU. The temporary directory is removed afterwards.

What runs from exllamav3:
  C++ (cpu/moe_mul1.cpp):  make_tc_perm, state_end, decode_state_scalar, decode_mul1_scalar, hadamard_128_scalar
  CUDA headers compiled for the host (quant/exl3_dq.cuh + quant/codebook.cuh + ptx_portable.cuh, -DUSE_ROCM so
    the portable C forms of lop3/shf/bfe are used): dq_dispatch<bits, cb, half> = the per-lane decode of the
    reconstruct kernels, and decode_3inst<cb> for all three codebooks. CUDA intrinsics (__hadd, __hfma, __dp4a,
    __funnelshift_r, half2 helpers) come from OUR shim below (fp16 ops = exact double result, one RNE rounding).
  quant/frac.cu:  frac_perm and the pack_trellis_frac_kernel body (per-thread independent, run serially)
  Python: tensor_core_perm (quantize.py), mul1_codebook (ngram_codec.py), codebook_scale,
    preapply_had_l / preapply_had_r (quantize.py) with util/hadamard.py's Sylvester matrix, in torch CPU fp32.

Usage (the wheel carries the C++/CUDA sources; the index has no sdist):

    pip download --no-deps exllamav3==1.6.5 -d /tmp/x3 && unzip -q /tmp/x3/exllamav3-1.6.5-*.whl -d /tmp/x3/src
    EXL3_SRC=/tmp/x3/src/exllamav3 .venv/bin/python bench/exl3_peer_check.py [--tiles N] [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import exl3_oracle as R  # noqa: E402

SRC = os.environ.get("EXL3_SRC", "")
if not SRC or not os.path.isdir(SRC):
    raise SystemExit("set EXL3_SRC to the exllamav3 folder of the unpacked exllamav3 1.6.5 wheel (see --help)")
EXT = os.path.join(SRC, "exllamav3_ext")

# --------------------------------------------------------------------------------------------------
# Source extraction helpers
# --------------------------------------------------------------------------------------------------


def extract_c_function(text: str, signature_regex: str, with_template: bool = True) -> str:
    """Text of the first C/C++ definition whose header line matches signature_regex (brace matched)."""
    m = re.search(signature_regex, text, re.M)
    if not m:
        raise SystemExit(f"exl3_peer_check: cannot find {signature_regex!r} in the exllamav3 sources")
    start = text.rfind("\n", 0, m.start()) + 1
    if with_template:
        prev_end = start - 1
        prev_start = text.rfind("\n", 0, prev_end) + 1
        if text[prev_start:prev_end].lstrip().startswith("template"):
            start = prev_start
    i = text.index("{", m.end() - 1 if text[m.end() - 1] == "{" else m.end())
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                end = j + 1
                if text[end:end + 1] == ";":
                    end += 1
                return text[start:end] + "\n"
    raise SystemExit(f"exl3_peer_check: unbalanced braces after {signature_regex!r}")


def py_function(path: str, name: str) -> str:
    src = open(path).read()
    tree = ast.parse(src)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            node.decorator_list = []
            return ast.unparse(node)
    raise SystemExit(f"exl3_peer_check: {name} not in {path}")


def py_assign(path: str, name: str) -> str:
    """Source of the module-level assignment to ``name`` (to exec)."""
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.unparse(node)
    raise SystemExit(f"exl3_peer_check: assignment {name} not in {path}")


def py_constant(path: str, name: str):
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for tgt in node.targets:
                if isinstance(tgt, ast.Name) and tgt.id == name:
                    return ast.literal_eval(node.value)
                if isinstance(tgt, ast.Tuple):
                    for k, elt in enumerate(tgt.elts):
                        if isinstance(elt, ast.Name) and elt.id == name:
                            return ast.literal_eval(node.value.elts[k])
    raise SystemExit(f"exl3_peer_check: constant {name} not in {path}")


# --------------------------------------------------------------------------------------------------
# Our shim for the CUDA device intrinsics the decode headers use (host C++, GCC _Float16)
# --------------------------------------------------------------------------------------------------

SHIM = r"""
#pragma once
#include <cstdint>
#include <cstring>
#define __device__
#define __host__
#define __forceinline__ inline
typedef _Float16 half;
typedef _Float16 __half;
struct half2 { half x, y; };
static inline half h_round(double v) { return (half) v; }          // double -> fp16, round to nearest even
static inline half __hadd(half a, half b) { return h_round((double) a + (double) b); }
static inline half __hfma(half a, half b, half c) { return h_round((double) a * (double) b + (double) c); }
static inline half2 __hadd2(half2 a, half2 b) { return { __hadd(a.x, b.x), __hadd(a.y, b.y) }; }
static inline half2 __hfma2(half2 a, half2 b, half2 c) { return { __hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y) }; }
static inline half __low2half(half2 a) { return a.x; }
static inline half __high2half(half2 a) { return a.y; }
static inline half2 __lows2half2(half2 a, half2 b) { return { a.x, b.x }; }
static inline half2 __highs2half2(half2 a, half2 b) { return { a.y, b.y }; }
static inline half2 __halves2half2(half a, half b) { return { a, b }; }
static inline half2 __half2half2(half a) { return { a, a }; }
static inline half __ushort_as_half(uint16_t u) { half h; std::memcpy(&h, &u, 2); return h; }
static inline float __half2float(half h) { return (float) h; }
static inline uint32_t __dp4a(uint32_t a, uint32_t b, uint32_t c)
{
    uint32_t s = c;
    for (int i = 0; i < 4; ++i) s += ((a >> (8 * i)) & 0xff) * ((b >> (8 * i)) & 0xff);
    return s;
}
static inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t shift)
{
    uint64_t v = ((uint64_t) hi << 32) | lo;
    return (uint32_t) (v >> (shift & 31));
}
union half2_uint32 { uint32_t as_uint32; half2 as_half2;
    half2_uint32(uint32_t v) : as_uint32(v) {} half2_uint32(half2 v) : as_half2(v) {} };
union half_uint16 { uint16_t as_uint16; half as_half;
    half_uint16(uint16_t v) : as_uint16(v) {} half_uint16(half v) : as_half(v) {} };
struct FragB { half2 v[2]; half2& operator[](int i) { return v[i]; } };
#define FSHF_IMM(dst, lo, hi, imm) (dst) = exl3_shf_r_wrap((lo), (hi), (imm))
#define BFE16_IMM(dst, src, imm) (dst) = exl3_bfe_u32_16((src), (imm))
static inline uint32_t bfe64(uint32_t lo, uint32_t hi, int offset, int length);   // unused by dq_dispatch
struct dim3_ { unsigned x, y, z; };
static dim3_ blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __launch_bounds__(x)
#define __restrict__
"""

HARNESS_TAIL = r"""
// ---- harness (ours) ----
static inline uint16_t h_bits(half h) { uint16_t u; std::memcpy(&u, &h, 2); return u; }

template <int bits, bool hb>
static void cpu_states_t(const uint16_t* packed, int ntiles, uint16_t* out)
{
    constexpr auto perm = make_tc_perm();
    const int ps = tile_u16(bits, hb);
    for (int i = 0; i < ntiles; ++i)
        for (int t = 0; t < 256; ++t)
            out[i * 256 + perm[t]] = decode_state_scalar<bits, hb>(packed + (size_t) i * ps, t);
}

template <int bits, int cb, bool hb>
static void dq_t(const uint16_t* packed, int ntiles, uint16_t* out)
{
    const int ps = 16 * bits + (hb ? 8 : 0);
    for (int i = 0; i < ntiles; ++i)
    {
        const uint32_t* p = (const uint32_t*) (packed + (size_t) i * ps);
        for (int lane = 0; lane < 32; ++lane)
        {
            FragB f0, f1;
            dq_dispatch<bits, cb, hb>(p, lane * 8, f0, f1);
            half2 hv[4] = { f0[0], f0[1], f1[0], f1[1] };
            for (int j = 0; j < 4; ++j)
            {
                out[i * 256 + lane * 8 + 2 * j + 0] = h_bits(hv[j].x);
                out[i * 256 + lane * 8 + 2 * j + 1] = h_bits(hv[j].y);
            }
        }
    }
}

extern "C" {

void ex_tc_perm(uint16_t* out) { auto p = make_tc_perm(); for (int i = 0; i < 256; ++i) out[i] = p[i]; }
void ex_frac_perm(uint16_t* out) { for (int i = 0; i < 256; ++i) out[i] = frac_perm(i); }
int ex_state_end(int bits, int hb, int t) { return state_end(bits, hb != 0, t); }

int ex_cpu_states(int bits, int hb, const uint16_t* packed, int ntiles, uint16_t* out)
{
    #define C(b, h) if (bits == b && hb == h) { cpu_states_t<b, h>(packed, ntiles, out); return 0; }
    C(1,0) C(2,0) C(3,0) C(4,0) C(5,0) C(6,0) C(7,0) C(8,0) C(1,1) C(2,1) C(3,1)
    #undef C
    return -1;
}

int ex_dq(int bits, int hb, int cb, const uint16_t* packed, int ntiles, uint16_t* out)
{
    #define C(b, c, h) if (bits == b && cb == c && hb == h) { dq_t<b, c, h>(packed, ntiles, out); return 0; }
    C(1,0,0) C(2,0,0) C(3,0,0) C(4,0,0) C(5,0,0) C(6,0,0) C(7,0,0) C(8,0,0)
    C(1,1,0) C(2,1,0) C(3,1,0) C(4,1,0) C(5,1,0) C(6,1,0) C(7,1,0) C(8,1,0)
    C(1,2,0) C(2,2,0) C(3,2,0) C(4,2,0) C(5,2,0) C(6,2,0) C(7,2,0) C(8,2,0)
    C(1,2,1) C(2,2,1) C(3,2,1)
    #undef C
    return -1;
}

void ex_codebook(int cb, int n, const uint16_t* states, uint16_t* out)
{
    for (int i = 0; i < n; ++i)
    {
        half v = cb == 0 ? decode_3inst<0>(states[i]) : cb == 1 ? decode_3inst<1>(states[i]) : decode_3inst<2>(states[i]);
        out[i] = h_bits(v);
    }
}

void ex_cpu_mul1(int n, const uint16_t* states, float* out) { for (int i = 0; i < n; ++i) out[i] = decode_mul1_scalar(states[i]); }

void ex_had128(int nblocks, float* v) { for (int i = 0; i < nblocks; ++i) hadamard_128_scalar(v + 128 * i); }

// pack_trellis_frac_kernel: one thread per tile, no shared state -> run the threads one after another
void ex_pack_frac(uint16_t* packed, const uint16_t* unpacked, int num_tiles, int ka, uint32_t mask, int bpb)
{
    for (int t = 0; t < num_tiles; ++t)
    {
        blockIdx.x = t / 128; threadIdx.x = t % 128;
        pack_trellis_frac_kernel(packed, unpacked, num_tiles, ka, mask, bpb);
    }
}

}
"""


def build_library(tmp: str) -> ctypes.CDLL:
    moe = open(os.path.join(EXT, "cpu", "moe_mul1.cpp")).read()
    frac = open(os.path.join(EXT, "quant", "frac.cu")).read()
    parts = [
        '#include <array>\n#include <cmath>\n#include <cstring>\n',
        re.search(r"^constexpr uint32_t MUL1_MULT = [^;]+;", moe, re.M).group(0) + "\n",
        # mul1_k_inv in exllamav3 converts fp16 0x1eee with c10::Half; same value, without ATen:
        "inline float mul1_k_inv() { return (float) __ushort_as_half(0x1eee); }\n",
        extract_c_function(moe, r"^constexpr std::array<uint16_t, 256> make_tc_perm\(\)"),
        extract_c_function(moe, r"^constexpr int rate_k2\("),
        extract_c_function(moe, r"^constexpr int tile_u16\("),
        extract_c_function(moe, r"^constexpr int tile_words32\("),
        extract_c_function(moe, r"^constexpr int state_end\("),
        extract_c_function(moe, r"^inline uint32_t load_u32_\("),
        extract_c_function(moe, r"^inline uint16_t decode_state_scalar\("),
        extract_c_function(moe, r"^inline float decode_mul1_scalar\("),
        extract_c_function(moe, r"^void hadamard_128_scalar\("),
        "#define FRAC_MAX_WORDS 64\n",
        extract_c_function(frac, r"^__device__ __forceinline__ int frac_d\("),
        extract_c_function(frac, r"^__device__ __forceinline__ int frac_perm\("),
        extract_c_function(frac, r"^void pack_trellis_frac_kernel\(", with_template=False).replace(
            "void pack_trellis_frac_kernel", "static void pack_trellis_frac_kernel"),
    ]
    # frac.cu's kernel starts with '__global__ __launch_bounds__(128)' on the line before; our shim defines both empty
    shim = os.path.join(tmp, "shim.h")
    with open(shim, "w") as f:
        f.write(SHIM)
    src = os.path.join(tmp, "peer.cpp")
    with open(src, "w") as f:
        f.write('#include "shim.h"\n')
        f.write(f'#include "{os.path.join(EXT, "ptx_portable.cuh")}"\n')
        f.write(f'#include "{os.path.join(EXT, "quant", "exl3_dq.cuh")}"\n')
        f.write("".join(parts))
        f.write(HARNESS_TAIL)
    lib = os.path.join(tmp, "peer.so")
    cmd = ["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-DUSE_ROCM", "-Wno-unknown-pragmas",
           "-I", tmp, "-include", shim, src, "-o", lib]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.stderr.write(r.stderr[-6000:])
        raise SystemExit("exl3_peer_check: g++ failed")
    print(f"compiled exllamav3 pieces in {time.time() - t0:.1f} s")
    so = ctypes.CDLL(lib)
    return so


def ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def torch_pieces():
    import torch
    from functools import lru_cache
    ns = {"torch": torch, "lru_cache": lru_cache, "math": __import__("math")}
    q = os.path.join(SRC, "modules", "quant", "exl3_lib", "quantize.py")
    ncodec = os.path.join(SRC, "modules", "quant", "exl3_lib", "ngram_codec.py")
    exec(py_function(q, "tensor_core_perm"), ns)
    ns["MUL1"] = py_constant(ncodec, "MUL1")
    for fn in ("mul1_codebook", "ring_dim", "unpack_rows", "hadamard_rotate", "dequant_rows"):
        exec(py_function(ncodec, fn), ns)
    # util/hadamard.py without its extension import (only the Sylvester path is used for n = 128)
    hpath = os.path.join(SRC, "util", "hadamard.py")
    htext = open(hpath).read().replace("from ..ext import exllamav3_ext as ext", "ext = None")
    hns = {"__file__": hpath, "__name__": "exl3_hadamard_peer"}
    exec(compile(htext, hpath, "exec"), hns)
    ns["get_hadamard_dt"] = hns["get_hadamard_dt"]
    exec(py_assign(q, "_HAD_MAX_GEMM_ROWS"), ns)
    exec(py_function(q, "preapply_had_l"), ns)
    exec(py_function(q, "preapply_had_r"), ns)
    ns["codebook_scale"] = py_constant(q, "codebook_scale")
    ns["had_k"] = py_constant(q, "had_k")
    return ns


def ulp_diff_f16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in fp16 ulps (ordered integer distance of the bit patterns)."""
    def key(x):
        u = x.astype(np.float16).view(np.uint16).astype(np.int32)
        return np.where(u & 0x8000, 0x8000 - (u & 0x7FFF), 0x8000 + u)
    return np.abs(key(a) - key(b))


def ulp16_at(x: float) -> float:
    """fp16 ulp at magnitude x (normal range)."""
    e = np.floor(np.log2(max(abs(x), 2.0 ** -14)))
    return float(2.0 ** (e - 10))


def scale_err(a: np.ndarray, b: np.ndarray, ref: np.ndarray) -> float:
    """max |a - b| in fp16 ulps at the layer's RMS magnitude (a scale-aware ulp: elementwise ulps explode
    near zero, where both sides are results of cancellation)."""
    rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max() / ulp16_at(rms))


def block_ulp_err(a: np.ndarray, b: np.ndarray, ref: np.ndarray) -> float:
    """max |a - b| / ulp16(m), m = max |ref| over the element's 128-row block of its column (the input-side
    Hadamard block): the error scale an fp32-order change can produce through the fp16 intermediate."""
    in_p, out_p = ref.shape
    m = np.abs(ref.astype(np.float64)).reshape(in_p // 128, 128, out_p).max(axis=1, keepdims=True)
    e = np.floor(np.log2(np.maximum(m, 2.0 ** -14)))
    u = np.broadcast_to(2.0 ** (e - 10), (in_p // 128, 128, out_p)).reshape(in_p, out_p)
    return float((np.abs(a.astype(np.float64) - b.astype(np.float64)) / u).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--big", action="store_true", help="add four larger layers (up to 1024x768) to the layer check")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    res: dict = {"exllamav3_src": SRC, "tiles_per_rate": args.tiles}
    tmp = tempfile.mkdtemp(prefix="exl3peer_")
    try:
        so = build_library(tmp)
        ns = torch_pieces()
        import torch

        # ---- permutation: 3 upstream definitions vs ours
        p_cpu = np.zeros(256, np.uint16); so.ex_tc_perm(ptr(p_cpu))
        p_frac = np.zeros(256, np.uint16); so.ex_frac_perm(ptr(p_frac))
        p_py = ns["tensor_core_perm"]("cpu").numpy()
        ours = R.tc_perm()
        res["tc_perm"] = {"moe_mul1.make_tc_perm": bool(np.array_equal(p_cpu, ours)),
                          "frac.cu.frac_perm": bool(np.array_equal(p_frac, ours)),
                          "quantize.tensor_core_perm": bool(np.array_equal(p_py, ours))}
        # CUDA reconstruct_tile shuffle (reconstruct.cu:47-75) re-stated: lane L (bit 2 clear) writes
        # frag slot j of itself and of lane L+4 to row 2(L%4) + (j&1) + 8((j>>1)&1), columns 2(L//8) + {0,1} (+8 for j>=4)
        shuf = np.zeros(256, np.int64)
        for L in range(32):
            if L & 4:
                continue
            for j in range(8):
                r = 2 * (L % 4) + (j & 1) + 8 * ((j >> 1) & 1)
                c = 2 * (L // 8) + 8 * (j >> 2)
                shuf[L * 8 + j] = r * 16 + c
                shuf[(L + 4) * 8 + j] = r * 16 + c + 1
        res["tc_perm"]["reconstruct_tile_shuffle_restated"] = bool(np.array_equal(shuf, ours))

        # ---- state windows
        se_ok = True
        for K in R.RATES:
            bits, hb = int(K), int(R.rate_k2(K) % 2)
            e_up = np.array([so.ex_state_end(bits, hb, t) for t in range(256)]) - 128 * R.rate_k2(K)
            se_ok &= bool(np.array_equal(e_up, R.window_end(K)))
        res["state_end_equal_all_rates"] = se_ok

        # ---- states and decoded values on random tiles, all 11 rates
        per_rate = {}
        for K in R.RATES:
            k2 = R.rate_k2(K)
            bits, hb = int(K), k2 % 2
            L = R.tile_words(K)
            tk, tn = 2, args.tiles // 2
            tr = rng.integers(-32768, 32768, size=(tk, tn, L), dtype=np.int64).astype(np.int16)
            # a few structured tiles too: all zero, all ones, single bits
            tr[0, 0] = 0
            tr[0, 1] = -1
            tr[1, 0] = 0
            tr[1, 0, 0] = 1
            flat = np.ascontiguousarray(tr.reshape(-1, L)).view(np.uint16)
            up = np.zeros((tk * tn, 256), np.uint16)
            assert so.ex_cpu_states(bits, hb, ptr(flat), tk * tn, ptr(up)) == 0
            our_states = R.decode_states(tr, K)
            ours_tiles = our_states.reshape(tk, 16, tn, 16).transpose(0, 2, 1, 3).reshape(tk * tn, 256)
            entry = {"states_equal_cpu_scalar": bool(np.array_equal(up, ours_tiles))}
            # the CUDA per-lane decode (dq_dispatch) for each codebook valid at this rate
            cbs = [2] if hb else [0, 1, 2]
            for cb in cbs:
                out = np.zeros((tk * tn, 256), np.uint16)
                assert so.ex_dq(bits, hb, cb, ptr(flat), tk * tn, ptr(out)) == 0
                name = ["3inst", "mcg", "mul1"][cb]
                ours_vals = R.codebook_values(ours_tiles, name).view(np.uint16)   # row-major tile order
                ours_lane = ours_vals[:, R.tc_perm()]                               # -> ring/lane order
                entry[f"cuda_dq_{name}_bitexact"] = bool(np.array_equal(out, ours_lane))
            # our packer reproduces the bytes
            entry["pack_roundtrip_bytes"] = bool(np.array_equal(R.pack_trellis(our_states, K), tr))
            if hb:
                # exllamav3's own frac packer on our ring-order states
                ring = ours_tiles[:, R.tc_perm()].copy()
                pk = np.zeros((tk * tn, L), np.uint16)
                so.ex_pack_frac(ptr(pk), ptr(ring), tk * tn, bits, 0xAAAA, L)
                entry["upstream_pack_frac_equals_input"] = bool(np.array_equal(pk, flat))
            per_rate[str(K)] = entry
        res["rates"] = per_rate

        # ---- codebooks over all 65536 states
        s = np.arange(65536, dtype=np.uint16)
        cbres = {}
        for cb, name in enumerate(["3inst", "mcg", "mul1"]):
            out = np.zeros(65536, np.uint16)
            so.ex_codebook(cb, 65536, ptr(s), ptr(out))
            ours_v = R.codebook_values(s, name)
            cbres[f"{name}_decode_3inst<{cb}>_bitexact"] = bool(np.array_equal(out, ours_v.view(np.uint16)))
            v = ours_v.astype(np.float64)
            cbres[f"{name}_rms"] = float(np.sqrt(np.mean(v * v)))
            cbres[f"{name}_mean"] = float(v.mean())
        lut = ns["mul1_codebook"]("cpu").numpy()
        cbres["mul1_codebook()_lut_bitexact"] = bool(np.array_equal(lut.view(np.uint16), R.codebook_mul1(s).view(np.uint16)))
        cbres["codebook_scale"] = ns["codebook_scale"]
        cbres["3inst_rms_minus_codebook_scale"] = cbres["3inst_rms"] - ns["codebook_scale"]
        cpu_m = np.zeros(65536, np.float32)
        so.ex_cpu_mul1(65536, ptr(s), ptr(cpu_m))
        dlt = cpu_m.astype(np.float64) - R.codebook_mul1(s).astype(np.float64)
        cbres["cpu_moe_mul1_minus_cuda"] = {"mean": float(dlt.mean()), "std": float(dlt.std()),
                                            "max_abs": float(np.abs(dlt).max()),
                                            "states_equal_after_fp16_round": int(np.sum(cpu_m.astype(np.float16) == R.codebook_mul1(s)))}
        res["codebooks"] = cbres

        # ---- Hadamard: exllamav3's CPU butterfly vs ours, and the torch fp32 matmul (get_weight_tensor) path
        x = rng.standard_normal((64, 128)).astype(np.float32)
        v = x.copy()
        so.ex_had128(64, ptr(v))
        ours_h = R.hadamard_128(x, axis=1)
        res["hadamard"] = {"cpu_butterfly_times_scale_bitexact": bool(np.array_equal((v * R.HAD_SCALE_F32).astype(np.float32), ours_h))}
        had = ns["get_hadamard_dt"](128, "cpu", torch.float, 1 / (128 ** 0.5)).numpy()
        Hs = np.array([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)], np.float32)
        res["hadamard"]["upstream_matrix_is_sylvester_times_f32_scale"] = bool(np.array_equal(had, Hs * R.HAD_SCALE_F32))

        # ---- whole layer: ours vs exllamav3's get_weight_tensor sequence run with torch CPU, and vs exact fp64 sums
        layer = {}
        cases = [(4, "mul1", 300, 200, False), (2.5, "mul1", 256, 384, False),
                 (3, "3inst", 384, 256, True), (6, "mcg", 128, 128, False)]
        if args.big:
            cases += [(4, "mul1", 1024, 768, False), (2, "3inst", 768, 1024, False),
                      (1.5, "mul1", 512, 512, False), (8, "mcg", 512, 500, False)]
        for K, cbname, in_f, out_f, legacy in cases:
            in_p, out_p = -(-in_f // 128) * 128, -(-out_f // 128) * 128
            tr = rng.integers(-32768, 32768, size=(in_p // 16, out_p // 16, R.tile_words(K)), dtype=np.int64).astype(np.int16)
            t = {"trellis": tr}
            if cbname == "mul1":
                t["mul1"] = R.MUL1_MARKER
            if cbname == "mcg":
                t["mcg"] = R.MCG_MARKER
            if legacy:
                t["su"] = rng.integers(-32768, 32768, size=in_p // 16).astype(np.int16)
                t["sv"] = rng.integers(-32768, 32768, size=out_p // 16).astype(np.int16)
                suh, svh = R.unpack_sign_bits(t["su"]), R.unpack_sign_bits(t["sv"])
            else:
                suh = (rng.choice([-1, 1], in_p) * rng.uniform(0.002, 0.02, in_p)).astype(np.float16)
                svh = (rng.choice([-1, 1], out_p) * rng.uniform(0.5, 2.0, out_p)).astype(np.float16)
                t["suh"], t["svh"] = suh, svh
            ours_p = R.dequantize(t, in_f, out_f, return_padded=True)
            w_hat, _, _ = R.inner_weight(t)
            # exllamav3 sequence (LinearEXL3.get_weight_tensor) with its preapply_had_* on torch CPU
            w = torch.from_numpy(w_hat.copy())
            w = ns["preapply_had_l"](w, 128)
            w *= torch.from_numpy(suh).unsqueeze(1)
            w = ns["preapply_had_r"](w, 128)
            w *= torch.from_numpy(svh).unsqueeze(0)
            up_w = w.numpy()
            # same sequence with exact (fp64) Hadamard sums
            Hd = Hs.astype(np.float64) * float(R.HAD_SCALE_F32)
            a = np.einsum("ij,bjn->bin", Hd, w_hat.astype(np.float64).reshape(-1, 128, out_p)).reshape(in_p, out_p).astype(np.float16)
            b = (a.astype(np.float64) * suh.astype(np.float64)[:, None]).astype(np.float16)
            c = (b.astype(np.float64).reshape(in_p, -1, 128) @ Hd).reshape(in_p, out_p).astype(np.float16)
            exact = (c.astype(np.float64) * svh.astype(np.float64)[None, :]).astype(np.float16)
            du = ulp_diff_f16(ours_p, up_w)
            de = ulp_diff_f16(ours_p, exact)
            dt = ulp_diff_f16(up_w, exact)
            layer[f"K{K}_{cbname}_{in_f}x{out_f}{'_legacy' if legacy else ''}"] = {
                "ours_vs_torch_getweight": {"equal_frac": float(np.mean(du == 0)), "max_ulp": int(du.max()), "n_gt1": int(np.sum(du > 1))},
                "ours_vs_exact_sums": {"equal_frac": float(np.mean(de == 0)), "max_ulp": int(de.max())},
                "torch_vs_exact_sums": {"equal_frac": float(np.mean(dt == 0)), "max_ulp": int(dt.max())},
                "max_diff_in_ulps_at_layer_rms": {"ours_vs_torch": scale_err(ours_p, up_w, exact),
                                                  "ours_vs_exact": scale_err(ours_p, exact, exact),
                                                  "torch_vs_exact": scale_err(up_w, exact, exact)},
                "max_diff_in_ulps_of_block_column_max": {"ours_vs_torch": block_ulp_err(ours_p, up_w, exact),
                                                         "ours_vs_exact": block_ulp_err(ours_p, exact, exact),
                                                         "torch_vs_exact": block_ulp_err(up_w, exact, exact)},
                "elementwise_gt1ulp_where_abs_below_rms_over_16": int(np.sum((du > 1) & (np.abs(exact.astype(np.float64)) < np.sqrt(np.mean(exact.astype(np.float64) ** 2)) / 16))),
                "trim_ok": bool(np.array_equal(R.dequantize(t, in_f, out_f), ours_p[:in_f, :out_f].T)),
            }
        res["layer"] = layer

        # ---- quantized embeddings: ngram_codec.dequant_rows (+ .half(), as embedding.py does on the CPU) vs ours
        emb = {}
        cb_t = ns["mul1_codebook"]("cpu")
        for K in range(1, 9):
            V, hidden = 5, 600
            G = -(-hidden // 256)
            tr = rng.integers(-32768, 32768, size=(V, G * (1 + 16 * K)), dtype=np.int64).astype(np.int16)
            sc = rng.uniform(0.01, 0.1, V * G).astype(np.float16).view(np.int16)
            tr.reshape(V * G, -1)[:, 0] = sc
            signs = rng.choice([-1.0, 1.0], (G, 256)).astype(np.float16)
            rings = torch.from_numpy(tr.reshape(V * G, -1).copy())
            st_up, _ = ns["unpack_rows"](rings, K)
            st_ours, _ = R.embedding_ring_states(tr.reshape(V * G, -1), K)
            up = ns["dequant_rows"](rings, K, cb_t, signs=torch.from_numpy(signs).repeat(V, 1)).half()
            up = up.view(V, -1)[:, :hidden].numpy()
            ours_e = R.dequantize_embedding(tr, signs, hidden)
            emb[str(K)] = {"states_equal": bool(np.array_equal(st_up.numpy(), st_ours)),
                           "values_bitexact": bool(np.array_equal(up.view(np.uint16), ours_e.view(np.uint16)))}
        res["embedding"] = emb
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(json.dumps(res, indent=1))
    fails = []

    def walk(d, path=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, path + k + ".")
            elif isinstance(v, bool) and not v:
                fails.append(path + k)
    walk(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print("FAILED: " + ", ".join(fails) if fails else "ALL BOOLEAN CHECKS PASS")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
