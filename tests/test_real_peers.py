"""bench/real_peers.py's bookkeeping (issue 40's peer table): a peer's peak RSS is its own, a failed peer keeps its
row with the error, and each row is merged into peers.json as it finishes.  No peer is run: small Python children
stand in for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import load_bench

rp = load_bench("real_peers")

# a child that touches ~64 MB and exits
SMALL_CHILD = "x = bytearray(64 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss across exec is Linux behaviour")
def test_peak_rss_is_the_childs_own_not_the_parents(tmp_path):
    """Linux keeps a process's peak RSS from before ``exec`` in ``ru_maxrss``: a child forked straight from a large
    parent reports the parent's peak (the oracle below shows it on this machine), run_child must not."""
    big = bytearray(768 << 20)                       # the parent now holds ~768 MB, as it does with the evaluator
    for i in range(0, len(big), 4096):
        big[i] = 1
    p = subprocess.Popen([sys.executable, "-c", SMALL_CHILD])
    _, _, ru = os.wait4(p.pid, 0)
    direct_mb = ru.ru_maxrss / 1024
    how = rp.run_child([sys.executable, "-c", SMALL_CHILD], tmp_path / "c.log", dict(os.environ), tmp_path)
    del big
    assert direct_mb > 700, "the oracle: a directly forked child inherits the parent's peak"
    assert 64 <= how["peak_rss_mb"] < 400, how
    assert how["cpu_s"] >= 0 and how["seconds"] > 0 and len(how["load"]) == 2


def test_failed_child_raises_with_its_log_tail(tmp_path):
    with pytest.raises(rp.PeerFailed) as e:
        rp.run_child([sys.executable, "-c", "import sys; print('the peer says no'); sys.exit(3)"],
                     tmp_path / "f.log", dict(os.environ), tmp_path)
    assert "failed (3)" in str(e.value)
    assert "the peer says no" in e.value.tail


def test_save_row_merges_with_rows_written_meanwhile(tmp_path):
    store = tmp_path / "peers.json"
    rp.save_row(store, "A", {"bpw": 4.0})
    store.write_text(json.dumps({**json.loads(store.read_text()), "B": {"row": "B", "bpw": 3.0}}))   # another run
    rp.save_row(store, "C", {"error": "failed (1): x", "log_tail": "boom"})
    rows = json.loads(store.read_text())
    assert sorted(rows) == ["A", "B", "C"]
    assert rows["A"] == {"row": "A", "bpw": 4.0} and rows["C"]["error"].startswith("failed")
    assert not list(tmp_path.glob("*.tmp"))
