"""Issue 41, classes 1, 2 and 11 (and the resume points of 14): nothing of the user's is deleted or
overwritten, and an interrupt stops a GGUF -> EXL2/GPTQ quantization.

The cases are directory setups, built at test time (spec/malformed/hostile3_userdata/README.md is the table):

* ``--work-dir`` pointed at the user's directory, the source, the destination or inside them;
* ``--save-measurement`` pointed at a source file, an unrelated file, a directory, a link;
* ``dequantize -o`` pointed at the source shard, a file of another kind, a directory, a link;
* ``sample DIR --force`` / ``demo --dir DIR --force`` pointed at a model directory;
* a rerun into a leftover job without ``--resume`` (refused before any work);
* SIGINT / SIGTERM / SIGKILL during the quantization that follows a GGUF's FP16 staging.

Every run goes through ``hostile_harness.run_bounded`` (a fresh CLI process: an exit code, no traceback,
bounded time and memory).  The oracle is a byte-for-byte digest of every protected tree taken before the run:
the source, the user's other files, a published DST; a refused run must leave the directory listing as it was.
The quantizing cases use the smallest model the suite has (tests/tiny_hf.py's llama: hidden 64, 2 layers).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from hostile_harness import ROOT, run_bounded

pytest.importorskip("torch")
pytest.importorskip("transformers")

QUANT_S = 240          # a whole tiny quantization under a shared, loaded CPU (seconds, typically 5-15)


def _tree(root: Path) -> dict:
    """{relative path: sha256 | "dir" | "link -> target"} of everything under ``root`` (links not followed)."""
    out = {}
    if not os.path.lexists(root):
        return out
    if root.is_symlink() or root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest() if not root.is_symlink()
                else f"link -> {os.readlink(root)}"}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"link -> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny llama directory, calibration ids .npy, a tiny F16 GGUF of it)."""
    from tiny_hf import make_tiny

    from exl2fmt.converters import convert

    d = tmp_path_factory.mktemp("h3u")
    src = make_tiny("llama", d / "tiny-llama", tokenizer=None)
    ids = d / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 320, (4, 32)))
    g = d / "tiny.gguf"
    convert(src, g, "gguf", gguf_type="f16")
    return src, ids, g


def _q(ids, target="gptq"):
    bits = ["--bits", "4", "--group-size", "32"] if target == "gptq" else ["--bits", "4.0"]
    return ["--to", target, *bits, "--calibration", str(ids), "--rows", "4", "--length", "32", "--device", "cpu"]


def _ok(r):
    assert not r.timed_out and r.rc is not None and r.rc >= 0, (r.rc, r.stderr[-2000:])
    assert not r.traceback, r.stderr[-4000:]


# ------------------------------------------------------------------------------------------- class 1: --work-dir


def test_a_user_work_dir_is_kept_and_only_our_subdirectory_is_removed(tiny, tmp_path):
    """An existing directory of the user's files as --work-dir: the run succeeds, the directory and every file in
    it are byte-identical afterwards (exl2fmt worked in, and removed, only its own marked subdirectory)."""
    src, ids, _ = tiny
    user = tmp_path / "mine"
    (user / "deep").mkdir(parents=True)
    (user / "notes.txt").write_text("keep me")
    (user / "deep" / "model.safetensors").write_bytes(os.urandom(1000))
    (user / "job.json").write_text('{"mine": true}')            # even a file named like ours
    before, src_before = _tree(user), _tree(src)
    r = run_bounded("convert", src, tmp_path / "q", *_q(ids), "--work-dir", user, timeout=QUANT_S)
    _ok(r)
    assert r.rc == 0, r.stderr[-2000:]
    assert _tree(user) == before and _tree(src) == src_before
    assert (tmp_path / "q" / "config.json").exists()


@pytest.mark.parametrize("where", ["src", "src/sub", "dst", "dst/sub", "dst-force", "file"])
def test_work_dir_in_the_source_or_destination_is_refused_before_any_work(tiny, tmp_path, where):
    """--work-dir SRC, inside SRC, DST (also with --force over a published DST), inside DST, or a regular file:
    a usage error naming the flag, nothing written, SRC and DST byte-identical."""
    import shutil

    src0, ids, _ = tiny
    src = tmp_path / "src"
    shutil.copytree(src0, src)
    dst = tmp_path / "dst"
    extra = []
    if where.startswith("dst"):                  # a published output to protect
        dst.mkdir()
        (dst / "config.json").write_text("{}")
        (dst / "model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}      ")
        extra = ["--force"]
    w = {"src": src, "src/sub": src / "sub", "dst": dst, "dst/sub": dst / "sub", "dst-force": dst,
         "file": tmp_path / "afile"}[where]
    if where == "file":
        w.write_text("not a directory")
    before = _tree(tmp_path)
    r = run_bounded("convert", src, dst, *_q(ids), "--work-dir", w, *extra, timeout=60)
    _ok(r)
    assert r.rc == 2 and "[USAGE]" in r.stderr and "--work-dir" in r.stderr, r.stderr[-2000:]
    assert _tree(tmp_path) == before            # nothing written, nothing removed


def test_a_work_directory_exl2fmt_did_not_make_is_refused(tiny, tmp_path):
    """A directory at the work directory's own path (``.DST.exl2fmt-work``) without exl2fmt's marker, a link
    there, or a file: refused before any work (it would otherwise be deleted after the run), left as it was."""
    src, ids, _ = tiny
    for kind in ("dir", "link", "file"):
        t = tmp_path / kind
        t.mkdir()
        work = t / ".q.exl2fmt-work"
        target = t / "elsewhere"
        target.mkdir()
        (target / "precious.txt").write_text("x")
        if kind == "dir":
            work.mkdir()
            (work / "precious.txt").write_text("x")
        elif kind == "link":
            work.symlink_to(target)
        else:
            work.write_text("x")
        before = _tree(t)
        r = run_bounded("convert", src, t / "q", *_q(ids), timeout=60)
        _ok(r)
        assert r.rc == 2 and "[OUTPUT_EXISTS]" in r.stderr and ".q.exl2fmt-work" in r.stderr, (kind, r.stderr)
        assert _tree(t) == before, kind


def test_a_rerun_without_resume_is_refused_before_any_work(tiny, tmp_path, monkeypatch):
    """A leftover job in the work directory and no --resume: refused before the calibration set is read (a
    calibration file that does not exist would otherwise be the error), for FP16 and GGUF sources alike."""
    from exl2fmt.quant.workdir import make_work_dir

    src, ids, g = tiny
    for source in (src, g):
        work = tmp_path / ".q.exl2fmt-work"
        if not work.exists():
            make_work_dir(work, tmp_path / "q")
            (work / "job.json").write_text("{}")
        before = _tree(tmp_path)
        r = run_bounded("convert", source, tmp_path / "q", "--to", "gptq", "--calibration", tmp_path / "nope.npy",
                        "--rows", "2", "--length", "16", timeout=60)
        _ok(r)
        assert r.rc == 2 and "[OUTPUT_EXISTS]" in r.stderr and "--resume" in r.stderr, r.stderr[-2000:]
        assert "nope.npy" not in r.stderr and "calibrat" not in r.stderr.lower().split("error:")[-1]
        assert _tree(tmp_path) == before


# ------------------------------------------------------------------------------------ class 2: --save-measurement


@pytest.mark.parametrize("case", ["src-shard", "src-new", "src-force", "dst-file", "unrelated", "unrelated-force",
                                  "directory", "link", "measurement"])
def test_save_measurement_never_overwrites_what_is_not_ours(tiny, tmp_path, case):
    """--save-measurement into SRC (new or existing, even with --force) or DST: USAGE; an existing file without
    --force, or of another kind (even with it), a directory, a link: OUTPUT_EXISTS. Each refused before any
    work: every file byte-identical, nothing new. An existing measurement.json without --force is refused too."""
    import shutil

    src0, ids, _ = tiny
    src = tmp_path / "src"
    shutil.copytree(src0, src)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.json").write_text('{"not": "a measurement"}')
    (other / "dir").mkdir()
    (other / "target.txt").write_text("the link's target")
    (other / "link.json").symlink_to(other / "target.txt")
    (other / "m.json").write_text('{\n    "measurement": {}, "last_module_idx": 0}')
    dst = tmp_path / "dst"
    force = case.endswith("force") or case == "dst-file"
    if case == "dst-file":
        dst.mkdir()
        (dst / "config.json").write_text("{}")
        (dst / "model.safetensors").write_bytes(b"\x02" + b"\0" * 7 + b"{}")
    path, code = {"src-shard": (src / "model.safetensors", "USAGE"), "src-new": (src / "m.json", "USAGE"),
                  "src-force": (src / "model.safetensors", "USAGE"), "dst-file": (dst / "m.json", "USAGE"),
                  "unrelated": (other / "notes.json", "OUTPUT_EXISTS"),
                  "unrelated-force": (other / "notes.json", "OUTPUT_EXISTS"),
                  "directory": (other / "dir", "OUTPUT_EXISTS"), "link": (other / "link.json", "OUTPUT_EXISTS"),
                  "measurement": (other / "m.json", "OUTPUT_EXISTS")}[case]
    before = _tree(tmp_path)
    r = run_bounded("convert", src, dst, *_q(ids, "exl2"), "--save-measurement", path,
                    *(["--force"] if force else []), timeout=60)
    _ok(r)
    assert r.rc == 2 and f"[{code}]" in r.stderr and "--save-measurement" in r.stderr, r.stderr[-2000:]
    assert _tree(tmp_path) == before


def test_save_measurement_replaces_a_measurement_with_force_atomically(tiny, tmp_path):
    """With --force an earlier measurement.json is replaced (a whole new file, not written through a link
    planted at its temp name); the run is otherwise the normal one."""
    src, ids, _ = tiny
    m = tmp_path / "m.json"
    m.write_text('{"measurement": {}, "last_module_idx": 0}')
    r = run_bounded("convert", src, tmp_path / "q", *_q(ids, "exl2"), "--save-measurement", m, "--force",
                    timeout=QUANT_S)
    _ok(r)
    assert r.rc == 0, r.stderr[-2000:]
    doc = json.loads(m.read_text())
    assert doc["measurement"] and doc == json.loads((tmp_path / "q" / "measurement.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "q"]      # no temp file left


# ------------------------------------------------------------------------------------------ dequantize -o


@pytest.mark.parametrize("case", ["shard", "shard-force", "config-force", "other-kind-force", "directory",
                                  "link-force", "npy-in-model-force", "npy"])
def test_dequantize_output_replaces_only_its_own_kind(tiny, tmp_path, case):
    """``dequantize -o``: --force replaces only a .npy file outside the model being read; the source shard, its
    config, a file of another kind, a directory, a link, or a .npy inside the model are never replaced; an
    existing .npy without --force is refused. Everything byte-identical afterwards."""
    import shutil

    src0, _, _ = tiny
    src = tmp_path / "src"
    shutil.copytree(src0, src)
    np.save(src / "old.npy", np.zeros(3))
    (tmp_path / "page.html").write_text("<html>")
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "w.npy", np.ones(3))
    (tmp_path / "l.npy").symlink_to(tmp_path / "w.npy")
    path = {"shard": src / "model.safetensors", "shard-force": src / "model.safetensors",
            "config-force": src / "config.json", "other-kind-force": tmp_path / "page.html",
            "directory": tmp_path / "dir", "link-force": tmp_path / "l.npy",
            "npy-in-model-force": src / "old.npy", "npy": tmp_path / "w.npy"}[case]
    before = _tree(tmp_path)
    r = run_bounded("dequantize", src, "model.layers.0.mlp.down_proj", "-o", path,
                    *(["--force"] if case.endswith("force") else []), timeout=60)
    _ok(r)
    assert r.rc == 2 and "[OUTPUT_EXISTS]" in r.stderr, r.stderr[-2000:]
    assert _tree(tmp_path) == before


def test_dequantize_force_replaces_a_npy(tiny, tmp_path):
    src, _, _ = tiny
    out = tmp_path / "w.npy"
    np.save(out, np.ones(3))
    r = run_bounded("dequantize", src, "model.layers.0.mlp.down_proj", "-o", out, "--force", timeout=60)
    _ok(r)
    assert r.rc == 0 and np.load(out).shape != (3,), r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.npy"]


# --------------------------------------------------------------------------------- sample / demo --dir --force


@pytest.mark.parametrize("case", ["model-dir", "own-output", "demo-model-dir"])
def test_sample_force_replaces_only_a_sample(tiny, tmp_path, case):
    """``sample DIR --force`` (and ``demo --dir DIR --force``) replaces only a sample exl2fmt wrote: a model
    directory's config.json, or a user's output.safetensors, is refused (OUTPUT_EXISTS) and left byte-identical."""
    import shutil

    src0, _, _ = tiny
    d = tmp_path / "d"
    if case == "own-output":
        d.mkdir()
        (d / "output.safetensors").write_bytes(b"\x02" + b"\0" * 7 + b"{}")
    else:
        shutil.copytree(src0, d)
    before = _tree(tmp_path)
    args = ("demo", "--dir", d, "--force") if case.startswith("demo") else ("sample", d, "--force")
    r = run_bounded(*args, timeout=60)
    _ok(r)
    assert r.rc == 2 and "[OUTPUT_EXISTS]" in r.stderr + r.stdout, (r.stdout[-1000:], r.stderr[-2000:])
    assert _tree(tmp_path) == before


def test_sample_force_replaces_a_sample(tmp_path):
    r = run_bounded("sample", tmp_path / "s", timeout=60)
    assert r.rc == 0, r.stderr
    before = _tree(tmp_path / "s")
    r = run_bounded("sample", tmp_path / "s", "--force", timeout=60)
    _ok(r)
    assert r.rc == 0 and _tree(tmp_path / "s") == before, r.stderr    # deterministic: the same bytes again


# ------------------------------------------------------------------- class 11: interrupts around the GGUF staging


def _staging(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".exl2fmt-partial-" in p.name or ".exl2fmt-fp16-" in p.name)


def _start(args, cwd):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "exl2fmt-numba-cache"))
    return subprocess.Popen([sys.executable, "-m", "exl2fmt.cli.app", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(cwd), env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(proc, path: Path, limit=QUANT_S) -> None:
    t0 = time.monotonic()
    while not path.exists() and proc.poll() is None and time.monotonic() - t0 < limit:
        time.sleep(0.005)


def _slow_calibration(d: Path) -> Path:
    """Enough rows that the quantize pass outlasts the signal's delivery on any machine (the tiny model)."""
    p = d / "ids-slow.npy"
    np.save(p, np.random.default_rng(1).integers(0, 320, (64, 64)))
    return p


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_stops_a_gguf_quantization_and_removes_the_staging(tiny, tmp_path, sig):
    """GGUF -> GPTQ: SIGINT / SIGTERM sent once the quantizer is running (its work directory exists, i.e. after
    the FP16 staging was published) ends the run with 130 and "progress saved"; the staging directory is gone,
    no DST; the GGUF is byte-identical."""
    _, _, g = tiny
    ids = _slow_calibration(tmp_path)
    g_sha = _tree(g)
    work = tmp_path / ".q.exl2fmt-work"
    proc = _start(["convert", g, tmp_path / "q", "--to", "gptq", "--calibration", ids, "--rows", "64", "--length",
                   "64", "--device", "cpu"], ROOT)
    try:
        _wait_for(proc, work / "job.json")
        assert proc.poll() is None, "the run ended before the quantizer started: " + proc.stderr.read()[-2000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "progress saved" in err, err[-2000:]
    assert _staging(tmp_path) == [] and not (tmp_path / "q").exists()
    assert _tree(g) == g_sha


def test_a_killed_gguf_quantization_leaves_a_staging_the_next_run_removes(tiny, tmp_path):
    """SIGKILL while quantizing a GGUF leaves the marked FP16 staging (no cleanup can run); the next run for the
    same DST removes it (its process is gone), says so, and finishes; nothing else is touched."""
    _, ids, g = tiny
    slow = _slow_calibration(tmp_path)
    keep = tmp_path / ".q.exl2fmt-partial-notours"     # named like ours, but no marker: never removed
    keep.mkdir()
    (keep / "x").write_text("x")
    work = tmp_path / ".q.exl2fmt-work"
    args = ["convert", g, tmp_path / "q", "--to", "gptq", "--calibration", slow, "--rows", "64", "--length", "64",
            "--device", "cpu"]
    proc = _start(args, ROOT)
    try:
        _wait_for(proc, work / "job.json")
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = [n for n in _staging(tmp_path) if n != keep.name]
    assert len(left) == 1, _staging(tmp_path)
    r = run_bounded(*args, "--resume", timeout=QUANT_S)
    _ok(r)
    assert r.rc == 0, r.stderr[-2000:]
    assert _staging(tmp_path) == [keep.name] and (keep / "x").read_text() == "x"
    assert "removed" in r.stderr and left[0] in r.stderr
    assert not work.exists() and (tmp_path / "q" / "config.json").exists()


# ------------------------------------------------------------------------------ class 14: the ETA after --resume


def test_the_eta_after_a_resume_counts_only_this_runs_work():
    """A resumed run reports the point it resumes at ("resumed at block ..."); the rate is measured from there:
    a run that jumps to 60% at once and then gains 1% a second estimates ~15 s at 85%, not the ~4.6 s that
    counting the jump as this run's work gives."""
    from exl2fmt.cli.progress import Bar, Overall, StatusLines

    now = [0.0]
    clock = (lambda: now[0])

    for make in (lambda o: Bar(o, stream=open(os.devnull, "w")), lambda o: StatusLines("t", o,
                                                                                         stream=open(os.devnull, "w"))):
        overall = Overall(["calibrate", "quantize", "done"], {"calibrate": 0.0, "quantize": 1.0, "done": 0.0})
        bar = make(overall)
        bar.eta.clock = clock
        bar.eta.t0 = 0.0
        bar(0, 1, "calibrate: calibrating")
        now[0] = 1.0
        bar(60, 100, "quantize: resumed at block 7 of 10")
        eta = None
        for s in range(1, 26):
            now[0] = 1.0 + s
            bar(60 + s, 100, "quantize: x")
            eta = bar.eta.value
        remaining = 100 - (60 + 25)                  # seconds at 1% a second; counting the jump gives ~4.6 s
        assert eta is not None and 0.5 * remaining <= eta <= 2 * remaining, eta
