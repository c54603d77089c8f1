"""The exl2fmt-validate pre-commit hook, run for real: ``pre-commit try-repo`` on a scratch git repository.

    python bench/precommit_try_repo.py [--pre-commit PATH/TO/pre-commit]

pre-commit (from PyPI, in a scratch venv: it is not a dependency of exl2fmt) builds the hook's own virtualenv
from this checkout (``pip install .`` of exl2fmt and its dependencies: the first run needs PyPI and takes
minutes; later runs reuse pre-commit's cache) and runs the hook as a user's repository would.  The scratch
repository under /tmp holds a valid model (the embedded sample), a broken one (config.json hidden_size doubled)
and a config.json that is not a model.  Checks:

1. only the valid model changed   -> exit 0, one validate run;
2. the broken model's config.json -> exit 1 and CONFIG_MISMATCH in the output (the file maps to its directory);
3. a non-model config.json alone  -> exit 0, nothing validated;
4. ``--all-files``                 -> exit 1 (both models validated once each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sh(*args, cwd, env=None, check=True):
    r = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode:
        raise SystemExit(f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pre-commit", default=shutil.which("pre-commit") or "pre-commit")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from exl2fmt.sample import write_sample

    work = Path(tempfile.mkdtemp(prefix="exl2fmt-precommit-"))
    repo = work / "models"
    repo.mkdir()
    env = dict(os.environ, PRE_COMMIT_HOME=os.environ.get("PRE_COMMIT_HOME", str(Path.home() / ".cache/pre-commit")),
               GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@localhost", GIT_COMMITTER_NAME="bench",
               GIT_COMMITTER_EMAIL="bench@localhost")
    sh("git", "init", "-q", cwd=repo)
    write_sample(repo / "good")
    write_sample(repo / "bad")
    cfg = json.loads((repo / "bad/config.json").read_text())
    cfg["hidden_size"] *= 2
    (repo / "bad/config.json").write_text(json.dumps(cfg))
    (repo / "docs").mkdir()
    (repo / "docs/config.json").write_text("{}")
    sh("git", "add", "-A", cwd=repo)
    sh("git", "commit", "-qm", "models", cwd=repo, env=env)

    cases = [
        ("valid model changed", ["--files", "good/output.safetensors", "good/config.json"], 0, "PASS"),
        ("broken model's config.json changed", ["--files", "bad/config.json"], 1, "CONFIG_MISMATCH"),
        ("non-model config.json changed", ["--files", "docs/config.json"], 0, None),
        ("--all-files", ["--all-files"], 1, "CONFIG_MISMATCH"),
    ]
    ok = True
    rows = []
    for what, args, want, needle in cases:
        t0 = time.perf_counter()
        r = sh(a.pre_commit, "try-repo", ROOT, "exl2fmt-validate", "--verbose", *args, cwd=repo, env=env, check=False)
        dt = time.perf_counter() - t0
        out = r.stdout + r.stderr
        # validate's own header line "exl2fmt validate DIR" (not the hook's name "exl2fmt validate (EXL2 ...")
        runs = len(re.findall(r"^exl2fmt validate (?!\()", out, re.M))
        good = r.returncode == want and (needle is None or needle in out)
        if what.startswith(("valid", "broken")):
            good = good and runs == 1
        if what == "--all-files":
            good = good and runs == 2
        if what.startswith("non-model"):
            good = good and runs == 0
        ok &= good
        rows.append((what, r.returncode, want, runs, dt, "ok" if good else "FAILED"))
        if not good:
            print(out[-3000:])
    print("| case | exit | expected | validate runs | seconds (each try-repo builds the hook's venv anew) | |\n"
          "|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]:.1f} | {row[5]} |")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
