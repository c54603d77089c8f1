"""Calibration data (exl2fmt.quant.calib): file kinds, the built-in set, and the errors users will hit."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from exl2fmt.container import write_safetensors  # noqa: E402
from exl2fmt.errors import ErrorCode, Exl2Error  # noqa: E402
from exl2fmt.quant import calib  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "\n"
        "Pack my box with five dozen liquor jugs.\n") * 40


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A small byte-level BPE tokenizer trained on TEXT (an independent tokenizer: not the fixture model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([TEXT, calib.corpus_text("calib")[:50_000]], trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


@pytest.fixture(scope="module")
def tok(tok_path):
    return tokenizers.Tokenizer.from_file(str(tok_path))


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def test_txt_is_the_token_stream_reshaped(tmp_path, tok_path, tok):
    p = tmp_path / "c.txt"
    p.write_text(TEXT, encoding="utf-8")
    want = _enc(tok, TEXT)
    out = calib.load_calibration(p, tok_path, rows=3, length=20)
    assert out.dtype == torch.int64 and out.shape == (3, 20)
    assert out.flatten().tolist() == want[:60]
    # the tokenizer may also be given as the directory holding tokenizer.json
    assert torch.equal(calib.load_calibration(p, tok_path.parent, rows=3, length=20), out)


def test_jsonl_texts_are_tokenized_one_by_one(tmp_path, tok_path, tok):
    texts = ["Pack my box with five dozen liquor jugs.", "The quick brown fox", "jumps over the lazy dog. " * 5]
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n\n", encoding="utf-8")
    want = sum((_enc(tok, t) for t in texts), [])
    length = len(want) // 2
    out = calib.load_calibration(p, tok_path, rows=2, length=length)
    assert out.flatten().tolist() == want[:2 * length]


def test_token_id_files(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(5, 12), dtype=np.int64)
    np.save(tmp_path / "a.npy", ids)
    write_safetensors(tmp_path / "a.safetensors", {"input_ids": ids.astype(np.int32)})
    (tmp_path / "a.json").write_text(json.dumps(ids.tolist()))
    for name in ("a.npy", "a.safetensors", "a.json"):
        out = calib.load_calibration(tmp_path / name, None, rows=4, length=10)
        assert out.dtype == torch.int64 and np.array_equal(out.numpy(), ids[:4, :10]), name
    # rows shorter than length are skipped; a flat list is one stream
    (tmp_path / "b.json").write_text(json.dumps([[1, 2], [3, 4, 5, 6], [7], [8, 9, 10, 11, 12]]))
    assert calib.load_calibration(tmp_path / "b.json", None, 2, 3).tolist() == [[3, 4, 5], [8, 9, 10]]
    (tmp_path / "c.json").write_text(json.dumps(list(range(10))))
    assert calib.load_calibration(tmp_path / "c.json", None, 3, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    np.save(tmp_path / "c.npy", np.arange(7, dtype=np.uint16))
    assert calib.load_calibration(tmp_path / "c.npy", None, 2, 3).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_default_set_is_seeded_text_plus_random_rows(tok_path, tok):
    a = calib.load_calibration(None, tok_path, rows=50, length=64, seed=3)
    b = calib.load_calibration(None, tok_path, rows=50, length=64, seed=3)
    c = calib.load_calibration(None, tok_path, rows=50, length=64, seed=4)
    assert a.shape == (50, 64) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    n_rand = calib.default_random_rows(50)
    assert n_rand == 1
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert int(a.min()) >= 0 and int(a.max()) < vocab
    # the text rows decode to paragraphs of the shipped calibration part (inner pieces are whole paragraphs)
    paragraphs = {p.strip("\n") for p in calib.corpus_text("calib").split("\n\n")}
    decoded = tok.decode(a[:-n_rand].flatten().tolist())
    inner = decoded.split("\n\n")[1:-1]
    assert len(inner) > 20 and all(p.strip("\n") in paragraphs for p in inner if p.strip())
    # the random row is not text from the corpus: it uses the whole vocabulary, uniformly
    rand = a[-n_rand:]
    assert len(set(rand.flatten().tolist())) > 40
    # a short default set has no random rows
    assert calib.default_random_rows(4) == 0
    assert calib.load_calibration(None, tok_path, rows=4, length=16).shape == (4, 16)


def test_default_set_reaches_into_train_part(tok_path, tok):
    """More tokens than the calib part holds: the train part is appended, so large requests still work."""
    n_calib = len(_enc(tok, calib.corpus_text("calib")))
    length = 1024
    rows = n_calib // length + 20
    out = calib.load_calibration(None, tok_path, rows=rows, length=length, seed=0)
    assert out.shape == (rows, length)


def _code(fn):
    with pytest.raises(Exl2Error) as ei:
        fn()
    return ei.value


def test_errors(tmp_path, tok_path):
    e = _code(lambda: calib.load_calibration(tmp_path / "nope.txt", tok_path, 2, 8))
    assert e.code is ErrorCode.PATH_NOT_FOUND and "nope.txt" in str(e)

    p = tmp_path / "short.txt"
    p.write_text("a few words only", encoding="utf-8")
    e = _code(lambda: calib.load_calibration(p, tok_path, 4, 100))
    assert e.code is ErrorCode.CALIBRATION_INVALID and "400 are needed" in e.message
    n = int(e.message.split(" gives ")[1].split()[0])
    assert 0 < n < 400

    e = _code(lambda: calib.load_calibration(p, None, 1, 2))
    assert e.code is ErrorCode.PATH_NOT_FOUND and "tokenizer.json" in e.message
    e = _code(lambda: calib.load_calibration(p, tmp_path, 1, 2))
    assert e.code is ErrorCode.PATH_NOT_FOUND and "tokenizer.json" in str(e)
    bad_tok = tmp_path / "bad" / "tokenizer.json"
    bad_tok.parent.mkdir()
    bad_tok.write_text("{not json")
    assert _code(lambda: calib.load_calibration(p, bad_tok, 1, 2)).code is ErrorCode.CALIBRATION_INVALID

    j = tmp_path / "bad.jsonl"
    j.write_text('{"text": "ok"}\n\n{"text": 3}\n', encoding="utf-8")
    e = _code(lambda: calib.load_calibration(j, tok_path, 1, 2))
    assert e.code is ErrorCode.CALIBRATION_INVALID and "line 3" in e.message and "'text'" in e.message
    j.write_text('{"text": "ok"}\n{"text": "broken\n', encoding="utf-8")
    e = _code(lambda: calib.load_calibration(j, tok_path, 1, 2))
    assert "line 2" in e.message and "not valid JSON" in e.message
    j.write_text('["text"]\n', encoding="utf-8")
    assert "line 1" in _code(lambda: calib.load_calibration(j, tok_path, 1, 2)).message

    b = tmp_path / "latin1.txt"
    b.write_bytes(b"hello\nw\xe9rld\n")
    e = _code(lambda: calib.load_calibration(b, tok_path, 1, 2))
    assert e.code is ErrorCode.CALIBRATION_INVALID and "UTF-8" in e.message and "line 2" in e.message

    u = tmp_path / "x.parquet"
    u.write_bytes(b"PAR1")
    assert "unknown calibration file type" in _code(lambda: calib.load_calibration(u, tok_path, 1, 2)).message

    np.save(tmp_path / "f.npy", np.zeros((4, 4), np.float32))
    assert "integers" in _code(lambda: calib.load_calibration(tmp_path / "f.npy", None, 1, 2)).message
    np.save(tmp_path / "neg.npy", np.array([[1, -2, 3]]))
    assert "0..2**31-1" in _code(lambda: calib.load_calibration(tmp_path / "neg.npy", None, 1, 2)).message
    np.save(tmp_path / "few.npy", np.zeros((2, 8), np.int64))
    e = _code(lambda: calib.load_calibration(tmp_path / "few.npy", None, 3, 8))
    assert "found 2 rows" in e.message and "3 are needed" in e.message
    write_safetensors(tmp_path / "n.safetensors", {"ids": np.zeros((2, 8), np.int64)})
    assert "input_ids" in _code(lambda: calib.load_calibration(tmp_path / "n.safetensors", None, 1, 2)).message
    (tmp_path / "d.json").write_text(json.dumps({"input_ids": [1, 2]}))
    assert _code(lambda: calib.load_calibration(tmp_path / "d.json", None, 1, 2)).code is ErrorCode.CALIBRATION_INVALID
    assert _code(lambda: calib.load_calibration(None, tok_path, 0, 2)).code is ErrorCode.USAGE
