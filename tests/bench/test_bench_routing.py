"""`omni bench routing` (short run, local backend)."""
from __future__ import annotations

import pytest

TINY = "stage_configs/tiny_chain.yaml"


@pytest.mark.slow
def test_bench_routing_reports_the_issue_keys():
    """`omni bench routing` on the tiny chain in-process: the JSON keys the README table is built from."""
    import argparse

    from omni.bench import routing as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--config", TINY, "--backend", "local", "--conversations", "3", "--turns", "2",
                              "--system-tokens", "32", "--context-tokens", "40", "--turn-tokens", "8",
                              "--reply-tokens", "4", "--talker-tokens", "2", "--stagger-s", "0",
                              "--memory-budget-mb", "8"])
    res = bench.run(args)
    for key in ("hit_rate_affinity", "hit_rate_round_robin", "hit_rate_single", "affinity_vs_single_hit_rate",
                "ttft_round_robin_over_affinity"):
        assert isinstance(res[key], float) and res[key] > 0, key
    assert res["hit_rate_affinity"] >= res["hit_rate_round_robin"]
    assert res["outputs_identical"]  # routing never changes what a request computes
    aff = res["setups"]["affinity"]
    assert aff["routers"]["thinker"]["decisions"]["affinity"] == 3  # every second turn went home
