"""exl2fmt.gguf_scan (the bounded lazy GGUF reader) against the gguf package's own writer and reader.

The file is written by ``gguf.GGUFWriter`` (an independent writer) and read by both ``gguf.GGUFReader`` (the
oracle) and ``open_gguf_file``: every field's contents and every tensor's type, shape and bytes must agree.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.gguf_scan import GGUF_MAX_ARRAY_STRINGS, gguf_hparam_issues, open_gguf_file  # noqa: E402


def _write(path, *, block_count=2):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_string("test.text", "héllo")
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc", "ü"])
    w.add_bool("test.flag", True)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 32)).astype(np.float32))
    for b in range(block_count):
        w.add_tensor(f"blk.{b}.attn_norm.weight", rng.standard_normal(32).astype(np.float16))
    q8 = rng.integers(0, 255, size=(4, 34 * 2), dtype=np.uint8)  # 4 rows of 64 Q8_0 values (2 blocks of 34 B)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # shape in bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_agrees_with_gguf_reader(tmp_path):
    p = tmp_path / "m.gguf"
    _write(p)
    ref = gguf.GGUFReader(str(p))
    with open_gguf_file(p) as g:
        ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert sorted(g.fields) == sorted(ref_fields)
        for k, f in ref_fields.items():
            assert g.fields[k].contents() == f.contents(), k
            assert [int(t) for t in f.types] == g.fields[k].types, k
        assert [t.name for t in g.tensors] == [t.name for t in ref.tensors]
        for mine, theirs in zip(g.tensors, ref.tensors):
            assert mine.tensor_type == theirs.tensor_type
            assert mine.shape.tolist() == theirs.shape.tolist()
            assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (theirs.n_elements, theirs.n_bytes,
                                                                        theirs.data_offset)
            assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
            assert np.array_equal(np.asarray(mine.data).view(np.uint8), np.asarray(theirs.data).view(np.uint8))
        assert gguf_hparam_issues(g, "llama") == []


def test_hparams_bounded_by_the_tensors(tmp_path):
    p = tmp_path / "m.gguf"
    _write(p, block_count=2)
    raw = bytearray(p.read_bytes())
    with open_gguf_file(p) as g:
        off = g.fields["llama.block_count"]._offset
        off_h = g.fields["llama.attention.head_count"]._offset
    raw[off:off + 4] = struct.pack("<I", 3)         # one block more than the tensors hold
    raw[off_h:off_h + 4] = struct.pack("<I", 3)     # 2 KV heads do not divide 3
    p.write_bytes(bytes(raw))
    with open_gguf_file(p) as g:
        keys = [k for k, _ in gguf_hparam_issues(g, "llama")]
    assert keys == ["llama.block_count", "llama.attention.head_count_kv"]


def test_string_count_cap_before_walking(tmp_path):
    # a string array declaring one string more than the cap, in a file that could hold that many lengths
    n = GGUF_MAX_ARRAY_STRINGS + 1
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, n)
    p = tmp_path / "s.gguf"
    with open(p, "wb") as f:
        f.write(body)
        f.truncate(len(body) + 8 * n)   # sparse: zero-length strings, 32 MiB of holes
    with pytest.raises(Exl2Error) as e:
        open_gguf_file(p)
    assert e.value.code is ErrorCode.GGUF_INVALID and "cap" in e.value.message


def test_fuzz_target_smoke():
    """A short seeded run of fuzz/fuzz_gguf_config.py's mutation driver (GGUF reader + config checks): only
    Exl2Error, strict-JSON reports, one-line messages."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("fuzz_gguf_config", root / "fuzz" / "fuzz_gguf_config.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    done, _ = mod.run_random(24, seed=1)
    assert done == 24
