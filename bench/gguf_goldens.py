"""Regenerate the golden GGUF files in spec/vectors/gguf/ with llama.cpp's own converter (issue 15).

Usage (two interpreters: ours makes the tiny models, llama.cpp's converter runs in a scratch venv that has
transformers 4.57 and the gguf-py of the same llama.cpp checkout)::

    python bench/gguf_goldens.py --llama-cpp /path/to/llama.cpp --python /path/to/scratch-venv/bin/python \
        [--arch llama,qwen2] [--types f16,bf16,q8_0]

Per (architecture or ``VARIANTS`` entry, type) it builds ``tests/tiny_hf.make_tiny(arch)`` in a temporary directory named
``tiny-<arch>`` (the directory name is what llama.cpp derives ``general.name`` from), runs
``convert_hf_to_gguf.py DIR --outtype T --outfile spec/vectors/gguf/<arch>-<T>.gguf`` and records the command,
the llama.cpp commit and sha256 in ``spec/vectors/gguf/MANIFEST.json``.

llama.cpp's byte-level BPE path identifies the pre-tokenizer by hashing the token ids of a fixed text and only
knows the hashes of published tokenizers, so a tokenizer trained here is refused ("BPE pre-tokenizer was not
recognized").  For those models (qwen2/qwen3/moe/starcoder2, tokenizer ``bpe``) the converter runs with its
``get_vocab_base_pre`` answering ``qwen2`` - the name llama.cpp gives the published Qwen2 tokenizer, whose split
regex our tiny tokenizer uses (``tests/tiny_hf.write_bpe_tokenizer``).  Nothing else of the converter is
touched; MANIFEST.json marks those files ``"pre_override": "qwen2"``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "spec" / "vectors" / "gguf"
sys.path.insert(0, str(ROOT / "tests"))

#: architecture -> tokenizer kind used for its tiny model
ARCHS = {"llama": "spm", "mistral": "spm", "qwen2": "bpe", "qwen3": "bpe", "gemma": "spm", "granite": "spm",
         "gemma2": "spm", "gemma3_text": "spm", "mixtral": "spm", "qwen2_moe": "bpe", "qwen3_moe": "bpe",
         "cohere": "bpe", "starcoder2": "bpe", "phi3": "spm"}
DEFAULT_TYPES = {"llama": ("f16", "bf16", "q8_0"), "qwen2": ("f16", "bf16"), "gemma": ("f16", "q8_0"),
                 "qwen2_moe": ("f16", "q8_0")}
#: Phi-3 long-rope factors of the ``phi3-longrope`` variant (8 = head_dim / 2 each)
LONGROPE = {"original_max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "longrope", "type": "longrope",
                             "long_factor": [1.0 + 0.37 * i for i in range(8)],
                             "short_factor": [1.0 + 0.013 * i for i in range(8)]}}
#: variant -> (architecture, tokenizer, config overrides, types): sources other than an architecture's default
#: tiny model (``<variant>-<type>.gguf``; the model directory is still ``tiny-<arch>``): real SentencePiece
#: vocabularies of the Llama 2 and Gemma layouts (tests/tiny_hf.write_sp_tokenizer) and Phi-3 long-rope
VARIANTS = {"llama-sp": ("llama", "sp-llama2", {}, ("q8_0",)),
            "gemma3_text-sp": ("gemma3_text", "sp-gemma", {}, ("q8_0",)),
            "phi3-longrope": ("phi3", "spm", LONGROPE, ("q8_0",))}

_RUNNER = r"""
import runpy, sys
sys.argv = [sys.argv[1]] + sys.argv[3:]
pre = {pre!r}
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).parent))
if pre:
    import conversion.base as b
    b.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def model_name(arch: str) -> str:
    return f"tiny-{arch}"


def main(argv=None) -> int:
    from tiny_hf import make_tiny

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp checkout (convert_hf_to_gguf.py)")
    ap.add_argument("--python", required=True, help="interpreter with transformers 4.57 for the converter")
    ap.add_argument("--arch", default=",".join(ARCHS), help="architectures and/or variants (" +
                    ", ".join(VARIANTS) + ")")
    ap.add_argument("--types", default=None, help="comma list; default f16 (and bf16,q8_0 for llama)")
    a = ap.parse_args(argv)
    conv = a.llama_cpp / "convert_hf_to_gguf.py"
    commit = subprocess.run(["git", "-C", str(a.llama_cpp), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    OUT.mkdir(parents=True, exist_ok=True)
    man_p = OUT / "MANIFEST.json"
    manifest = json.loads(man_p.read_text()) if man_p.is_file() else {}
    with tempfile.TemporaryDirectory() as td:
        for name in a.arch.split(","):
            arch, tok, over, vtypes = VARIANTS.get(name) or (name, ARCHS[name], {}, DEFAULT_TYPES.get(name, ("f16",)))
            d = Path(td) / name / model_name(arch)
            src = make_tiny(arch, d, tokenizer=tok, **over)
            pre = "qwen2" if tok == "bpe" else None
            runner = Path(td) / "run_converter.py"
            runner.write_text(_RUNNER.format(pre=pre))
            types = a.types.split(",") if a.types else vtypes
            for t in types:
                dst = OUT / f"{name}-{t}.gguf"
                cmd = [a.python, str(runner), str(conv), "--", str(src), "--outtype", t, "--outfile", str(dst)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode:
                    print(f"{arch} {t}: FAILED\n{r.stderr[-3000:]}")
                    continue
                extra = "".join(f", {k}={v!r}" for k, v in over.items())
                manifest[dst.name] = {
                    "arch": arch, "type": t, "tokenizer": tok, "source": f"tests/tiny_hf.make_tiny({arch!r}, "
                    f"'{model_name(arch)}', tokenizer={tok!r}{extra})",
                    "command": f"python convert_hf_to_gguf.py {model_name(arch)} --outtype {t} --outfile {dst.name}",
                    "llama_cpp_commit": commit, "pre_override": pre,
                    "sha256": hashlib.sha256(dst.read_bytes()).hexdigest(), "bytes": dst.stat().st_size}
                if over:
                    manifest[dst.name]["config"] = over
                print(f"{arch} {t}: {dst.stat().st_size} bytes")
    man_p.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
