"""`omni bench serve` on the tiny Qwen2.5-Omni (short run): both modes, every concurrency, the JSON keys."""
from __future__ import annotations

import argparse

import pytest

from omni.bench import serve as bench
from tests.serve.server_utils import OMNI  # the bench starts `omni serve` itself

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_serve_reports_both_modes():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--configs", str(OMNI), "--backend", "local", "--concurrency", "1", "2",
                              "--turns", "2", "--max-tokens", "4", "--repeats", "2"])
    res = bench.run(args)
    for key in ("http_overhead_ratio", "ttft_p99_ms_c2", "requests_per_s_c2", "ttfp_p99_ms_c2"):
        assert res[key] > 0, key
    entry = res["configs"]["qwen2_5_omni_tiny"]
    assert entry["http_overhead_ratio"] == res["http_overhead_ratio"]
    for mode in ("in_process", "http"):
        for c, n in (("c1", 4), ("c2", 4)):  # conversations x turns (x 2 rounds at c=1)
            stats = entry[mode][c]
            assert stats["requests"] == n and stats["e2e_p99_ms"] >= stats["e2e_p50_ms"] > 0
            assert stats["ttft_p50_ms"] <= stats["ttfp_p50_ms"] <= stats["e2e_p99_ms"]
    with pytest.raises(ValueError, match="turns"):
        bench.run(parser.parse_args(["--turns", "9"]))
