"""The bounded runner itself (tests/hostile_harness.py): the peak RSS it reports is the CLI's own, even when the
test process that starts it is large (a fork of a pytest worker that loaded torch inherits its resident pages,
and Linux reports them as the child's peak even after exec)."""

from __future__ import annotations

from hostile_harness import RSS_LIMIT_BYTES, run_bounded


def test_peak_rss_is_the_clis_own_when_the_parent_is_large():
    ballast = bytearray(RSS_LIMIT_BYTES + (256 << 20))   # resident: bytearray zero-fills every page
    try:
        r = run_bounded("--version", timeout=60)
    finally:
        del ballast
    assert r.rc == 0 and not r.timed_out, r.stderr[-2000:]
    assert 0 < r.peak_rss_bytes < 512 << 20, r.peak_rss_bytes

