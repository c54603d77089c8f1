"""Issue 41, classes 3 and 12: what the source's side files may put into an output.

* **Class 3, secrets into outputs.**  A source directory whose side files (LICENSE, NOTICE, README.md,
  tokenizer_config.json, generation_config.json, chat template, a sub-folder's file, a linked folder) are
  symbolic links to a secret file outside it and to ``/proc/self/environ`` (with a marker in the converting
  process's environment), plus a FIFO named like a license, is converted along every route that copies or reads
  side files: EXL2 -> FP16, GPTQ -> FP16, EXL2 -> GPTQ, GPTQ -> EXL2, FP16 -> GPTQ and FP16 -> EXL2 quantization
  (the smallest test model), FP16 -> GGUF and EXL2 -> GGUF (the card and tokenizer files go into the metadata),
  GGUF -> FP16 (links beside the GGUF).  Oracle: no byte of either secret appears in any file of the output
  (every file, hidden ones included), while a real in-SRC NOTICE.md and an in-SRC link to it are copied (so the
  copying itself works), and every run names the skipped links in a warning.  A multi-GB sparse README.md (and
  an over-cap LICENSE) are skipped with a warning under the bounded harness, never read whole.
* **Class 12, outputs that lie about themselves.**  An EXL2 / GPTQ model made by exl2fmt's quantizer carries
  exl2fmt's card (``library_name: exllamav2``), its manifest and (EXL2) measurement.json.  Converted to FP16 the
  output carries none of them - its README.md is the original model's card that the quantized card kept - and
  re-packed to the other quantized format or to GGUF the new card / metadata carry the original card, not the
  quantized one.

Every case runs as a fresh CLI process through ``hostile_harness.run_bounded`` (exit code, no traceback, wall
and memory limits).  Catalogue: spec/malformed/hostile3_sidefiles/README.md (the cases are built at test time:
they need links to absolute paths, FIFOs and sparse files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from hostile_harness import run_bounded

from exl2fmt.sample import write_sample

#: the secret file's marker, and the environment's (a value only the converting process's environ holds)
FILE_MARK = "S3CRET-FILE-7d1c0e"
ENV_MARK = "S3CRET-ENV-91ab44"
ENV = {"EXL2FMT_TEST_SECRET": ENV_MARK}
#: the secret file is a plausible model card / JSON / text, so that a reader that followed the link would take
#: its content (license into the card's front matter and GGUF general.license, a JSON key, license text)
SECRET_TEXT = f"---\nlicense: {FILE_MARK}\nlanguage:\n- {FILE_MARK}\n---\n# {FILE_MARK}\n"
INSIDE_MARK = "a-real-notice-inside-src"
SLOW = 240.0   # a quantization or a GGUF conversion on a shared 2-core machine


def _plant(src: Path, secret_dir: Path, *, readme: bool = True) -> None:
    """Links out of ``src`` to the secret file and to /proc/self/environ, a FIFO, and two honest files."""
    secret = secret_dir / "secret.txt"
    env = Path("/proc/self/environ")
    links = {"LICENSE": secret, "LICENSE.txt": env, "NOTICE": env, "USE_POLICY.md": secret,
             "tokenizer_config.json": env, "special_tokens_map.json": env, "generation_config.json": secret,
             "chat_template.jinja": secret, "linked_dir": secret_dir}
    if readme:
        links["README.md"] = secret
    for name, target in links.items():
        if os.path.lexists(src / name):
            (src / name).unlink()
        (src / name).symlink_to(target)
    (src / "sub").mkdir(exist_ok=True)
    (src / "sub" / "notes.txt").symlink_to(secret)
    (src / "sub" / "fine.txt").write_text("fine\n")
    os.mkfifo(src / "LICENSE.fifo")
    (src / "NOTICE.md").write_text(INSIDE_MARK + "\n")
    (src / "LICENSE.inner").symlink_to("NOTICE.md")          # a link that stays inside SRC is followed


def _leaks(out: Path) -> list[str]:
    """Files under ``out`` (a file or a directory, hidden files included) holding a byte sequence of a secret."""
    files = [out] if out.is_file() else [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
    bad = []
    for p in files:
        data = p.read_bytes()
        for mark in (FILE_MARK, ENV_MARK):
            if mark.encode() in data or mark.encode("utf-16-le") in data:
                bad.append(f"{p.relative_to(out) if out.is_dir() else p.name}: {mark}")
    return bad


def _links_under(out: Path) -> list[str]:
    return [] if out.is_file() else [str(p) for p in out.rglob("*") if p.is_symlink()]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Sources with the links planted: exl2 (the sample), gptq (the sample re-packed), dense (a 2-layer Llama),
    and a GGUF of the dense model in a folder with the same links; calibration ids for the quantizer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("side")
    secret_dir = root / "private"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text(SECRET_TEXT)
    (secret_dir / "id_rsa").write_text(FILE_MARK + "\n")
    w = {"root": root, "secret_dir": secret_dir}

    clean = root / "clean-exl2"
    write_sample(clean)
    from exl2fmt.converters import convert

    convert(clean, root / "clean-gptq", "gptq")
    for name in ("exl2", "gptq"):
        d = root / f"{name}-src"
        shutil.copytree(root / f"clean-{name}", d)
        _plant(d, secret_dir)
        w[name] = d

    dense = root / "dense-clean" / "mini"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(dense, safe_serialization=True)
    (dense / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# mini\n\nThe source card text.\n")
    w["dense_clean"] = dense
    d = root / "dense-src" / "mini"
    shutil.copytree(dense, d)
    _plant(d, secret_dir)
    w["dense"] = d
    ids = root / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, (2, 32)))
    w["ids"] = ids
    return w


def _run(*args, timeout=SLOW):
    r = run_bounded(*map(str, args), timeout=timeout, env_extra=ENV)
    assert not r.timed_out, f"ran past {timeout} s"
    assert not r.traceback, r.stderr[-4000:]
    return r


def _check_clean(r, out: Path, *, expect_notice: bool = True) -> None:
    assert r.rc == 0, (r.stdout + r.stderr)[-4000:]
    assert out.exists()
    assert _leaks(out) == []
    assert _links_under(out) == []                               # a copy is a copy, never a link
    said = r.stdout + r.stderr
    assert "outside the source directory" in said, said[-3000:]   # the skipped links are named, with why
    if out.is_dir() and expect_notice:
        assert (out / "NOTICE.md").read_text() == INSIDE_MARK + "\n"     # honest files are still copied
        assert (out / "LICENSE.inner").read_text() == INSIDE_MARK + "\n"  # (a link inside SRC: its content)
        for name in ("LICENSE", "LICENSE.txt", "NOTICE", "tokenizer_config.json", "LICENSE.fifo"):
            assert not os.path.lexists(out / name), name


# ------------------------------------------------------------------------------------------------ class 3


@pytest.mark.parametrize("src,target", [("exl2", "fp16"), ("gptq", "fp16"), ("exl2", "gptq"), ("gptq", "exl2")])
def test_conversions_carry_no_secret_reached_through_a_link(world, tmp_path, src, target):
    out = tmp_path / "out"
    r = _run("convert", world[src], out, "--to", target)
    _check_clean(r, out)
    said = r.stdout + r.stderr
    for name in ("LICENSE", "NOTICE", "README.md"):
        assert re.search(rf"(^|\s){re.escape(name)}: not copied or read \(a symbolic link to ", said), name
    assert "LICENSE.fifo: not copied or read (a FIFO)" in said
    if target == "fp16":                      # the dense route copies the whole tree: the sub-folder's link too
        assert (out / "sub" / "fine.txt").read_text() == "fine\n" and not os.path.lexists(out / "sub" / "notes.txt")
        assert not os.path.lexists(out / "linked_dir") and "README.md" not in os.listdir(out)
    else:                                     # a quantized output's own card: no source card was read
        card = (out / "README.md").read_text()
        assert "## Original model card" not in card and "license:" not in card


@pytest.mark.parametrize("target", ["gptq", "exl2"])
def test_quantization_carries_no_secret_reached_through_a_link(world, tmp_path, target):
    out = tmp_path / "q"
    r = _run("convert", world["dense"], out, "--to", target, "--bits", 4, "--calibration", world["ids"],
             "--rows", 2, "--length", 32)
    _check_clean(r, out)
    card = (out / "README.md").read_text()
    assert "## Original model card" not in card                 # README.md was a link: not read


def test_gguf_outputs_carry_no_secret_in_their_metadata(world, tmp_path):
    pytest.importorskip("gguf")
    for src in ("dense", "exl2"):
        out = tmp_path / f"{src}.gguf"
        # f16: the property is the metadata; auto's searched k-quant blocks for the EXL2 source only cost CI time
        r = _run("convert", world[src], out, "--to", "gguf", "--gguf-type", "f16")
        _check_clean(r, out)


def test_gguf_to_fp16_reads_nothing_beside_the_gguf(world, tmp_path):
    pytest.importorskip("gguf")
    from exl2fmt.converters import convert

    d = tmp_path / "g"
    d.mkdir()
    convert(world["dense_clean"], d / "m.gguf", "gguf")
    _plant(d, world["secret_dir"])
    out = tmp_path / "fp16"
    r = _run("convert", d / "m.gguf", out, "--to", "fp16")
    assert r.rc == 0, (r.stdout + r.stderr)[-3000:]
    assert _leaks(out) == [] and _links_under(out) == []


def test_the_oracle_sees_a_leak(world, tmp_path):
    """The scan finds both secrets when they are there: a copy that follows the links, as the converters did, made
    by a process that has the marker in its environment."""
    import subprocess

    out = tmp_path / "o"
    out.mkdir()
    subprocess.run(["cp", "-L", str(world["dense"] / "LICENSE"), str(world["dense"] / "NOTICE"), str(out)],
                   check=True, env={**os.environ, **ENV})
    assert sorted(_leaks(out)) == [f"LICENSE: {FILE_MARK}", f"NOTICE: {ENV_MARK}"]


def _sparse(path: Path, size: int, head: bytes = b"---\nlicense: mit\n---\n# big\n") -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


@pytest.mark.parametrize("target", ["fp16", "gptq", "gguf"])
def test_sparse_multi_gb_card_and_license_are_skipped_not_read(world, tmp_path, target):
    if target == "gguf":
        pytest.importorskip("gguf")
    src = tmp_path / "src"
    shutil.copytree(world["dense_clean"] if target == "gguf" else world["root"] / "clean-exl2", src)
    _sparse(src / "README.md", 6 << 30)
    _sparse(src / "LICENSE", 200 << 20, b"MIT\n")
    out = tmp_path / ("o.gguf" if target == "gguf" else "o")
    r = run_bounded("convert", src, out, "--to", target, timeout=SLOW)
    assert r.rc == 0 and not r.traceback and r.peak_rss_bytes < 1 << 30, (r.stdout + r.stderr)[-3000:]
    said = r.stdout + r.stderr
    assert re.search(r"README\.md: not copied or read \(\d+ bytes, over the 4 MiB limit", said), said[-3000:]
    if target != "gguf":
        assert re.search(r"LICENSE: not copied or read \(\d+ bytes, over the 16 MiB limit", said), said[-3000:]
        assert not (out / "LICENSE").exists()
        if target == "fp16":
            assert not (out / "README.md").exists()
        else:
            assert "# big" not in (out / "README.md").read_text()


def test_gate_unit_rules(tmp_path):
    """The gate itself: regular files inside SRC pass; a link out, a broken or looping link, a FIFO, a directory,
    an over-cap file do not; the HF cache layout (snapshot links into the repository's blobs) passes, a blob
    that is itself a link out does not; a file that grows past the cap while copied is dropped."""
    from exl2fmt.container.sidefiles import copy_side_file, read_side_text, side_file_problem

    src = tmp_path / "m"
    src.mkdir()
    (src / "a.txt").write_text("a")
    (tmp_path / "out.txt").write_text("secret")
    (src / "out").symlink_to(tmp_path / "out.txt")
    (src / "broken").symlink_to(tmp_path / "nowhere")
    (src / "loop").symlink_to(src / "loop")
    os.mkfifo(src / "fifo")
    (src / "dir").mkdir()
    assert side_file_problem(src, src / "a.txt") is None
    assert "outside the source directory" in side_file_problem(src, src / "out")
    assert "broken or looping" in side_file_problem(src, src / "broken")
    assert "broken or looping" in side_file_problem(src, src / "loop")
    assert side_file_problem(src, src / "fifo") == "a FIFO"
    assert side_file_problem(src, src / "dir") == "a directory"
    assert "over the 1 bytes limit" not in (side_file_problem(src, src / "a.txt", cap=0) or "") and \
        "over the" in side_file_problem(src, src / "a.txt", cap=0)
    w: list[str] = []
    assert read_side_text(src, src / "out", warnings=w) is None and "outside" in w[0]
    assert read_side_text(src, src / "missing", warnings=w) is None and len(w) == 1   # absent: no warning
    # the Hugging Face cache: snapshots/REV/x -> ../../blobs/H passes; a blob linking out does not
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (repo / "blobs" / "h1").write_text("tok")
    (repo / "blobs" / "h2").symlink_to(tmp_path / "out.txt")
    (snap / "tokenizer.json").symlink_to("../../blobs/h1")
    (snap / "LICENSE").symlink_to("../../blobs/h2")
    assert side_file_problem(snap, snap / "tokenizer.json") is None
    assert "outside the source directory" in side_file_problem(snap, snap / "LICENSE")
    assert copy_side_file(snap, snap / "tokenizer.json", tmp_path / "t.json") is None
    assert (tmp_path / "t.json").read_text() == "tok"
    # /proc files report size 0: the cap is enforced while reading (as the gate sees a file inside a /proc root)
    proc = Path("/proc/self")
    if (proc / "environ").exists():
        why = copy_side_file(proc, proc / "environ", tmp_path / "e", cap=4)
        assert why is not None and "limit" in why and not (tmp_path / "e").exists()


# ------------------------------------------------------------------------------------------------ class 12


@pytest.fixture(scope="module")
def quantized(world, tmp_path_factory):
    """The dense model (honest card, no links) quantized by exl2fmt to EXL2 and GPTQ: outputs with exl2fmt's card,
    manifest and (EXL2) measurement."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for target in ("exl2", "gptq"):
        d = root / target
        r = _run("convert", world["dense_clean"], d, "--to", target, "--bits", 4, "--calibration", world["ids"],
                 "--rows", 2, "--length", 32)
        assert r.rc == 0, (r.stdout + r.stderr)[-3000:]
        card = (d / "README.md").read_text()
        assert "quantized_by: \"exl2fmt" in card and "exl2fmt-manifest.json" in os.listdir(d)
        out[target] = d
    return out


ARTEFACTS = ("exl2fmt-manifest.json", "measurement.json", "quantization_config.json", "quantize_config.json")


@pytest.mark.parametrize("src", ["exl2", "gptq"])
def test_dense_output_of_an_exl2fmt_quantization_carries_none_of_its_artefacts(quantized, tmp_path, src):
    d = quantized[src]
    shutil.copyfile(d / "exl2fmt-manifest.json", tmp_path / "m.json")
    (d / "quantization_config.json").write_text(json.dumps({"bits": 4}))   # a separate one, as some uploads have
    out = tmp_path / "fp16"
    r = _run("convert", d, out, "--to", "fp16")
    assert r.rc == 0, (r.stdout + r.stderr)[-3000:]
    names = set(os.listdir(out))
    assert not names & set(ARTEFACTS), names
    card = (out / "README.md").read_text()
    # the original model's card (as the quantized card kept it), its license in the front matter; nothing of
    # the quantized format
    assert card.startswith("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n")
    assert "# mini" in card and "The source card text." in card
    for word in ("exllamav2", "EXL2", "GPTQ", "quantized_by", "base_model_relation", "bpw", "Original model card"):
        assert word not in card, word
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert "describes its" in r.stdout + r.stderr                # said why the card was replaced


@pytest.mark.parametrize("src,target", [("exl2", "gptq"), ("gptq", "exl2")])
def test_repacked_card_keeps_the_original_card_not_the_quantized_one(quantized, tmp_path, src, target):
    out = tmp_path / "o"
    r = _run("convert", quantized[src], out, "--to", target)
    assert r.rc == 0, (r.stdout + r.stderr)[-3000:]
    card = (out / "README.md").read_text()
    assert card.count("## Original model card") == 1 and card.count("\n---\n") >= 1
    orig = card.split("## Original model card", 1)[1]
    assert "# mini" in orig and "The source card text." in orig
    assert src.upper() + " " not in orig and "exl2fmt" not in orig and "Layers" not in orig
    front = card.split("---\n")[1]
    assert f"format: {target}" in front and "license: apache-2.0" in front and front.count("license:") == 1
    assert not (out / "measurement.json").exists()


def test_gguf_of_an_exl2fmt_quantization_has_the_original_cards_metadata(quantized, tmp_path):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    r = _run("convert", quantized["exl2"], out, "--to", "gguf")
    assert r.rc == 0, (r.stdout + r.stderr)[-3000:]
    f = gguf.GGUFReader(str(out)).fields
    assert f["general.license"].contents() == "apache-2.0"
    tags = f["general.tags"].contents()
    assert "exl2" not in tags and "quantized" in tags
