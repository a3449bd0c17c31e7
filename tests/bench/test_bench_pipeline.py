"""`omni bench pipeline` (TTFT part only, local backend, a short conversation)."""
from __future__ import annotations

from pathlib import Path

import pytest

CONFIG = str(Path(__file__).resolve().parents[2] / "stage_configs" / "tiny_chain.yaml")


@pytest.mark.slow
def test_bench_pipeline_ttft_part(shared_causal_lm, capsys):
    """`omni bench pipeline` (TTFT part only, local backend, a short conversation): the JSON it returns."""
    import argparse

    from omni.bench import pipeline as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--config", CONFIG, "--skip-backends", "--conversations", "1", "--turns", "3",
                              "--system-tokens", "32", "--threads-per-stage", "0"])
    res = bench.run(args)
    assert "ray_over_local_time_ratio" not in res  # skipped
    assert set(res["per_stage_ttft_speedup"]) == {"thinker", "talker"}
    assert all(v > 0 for v in res["per_stage_ttft_speedup"].values())
    ttft = res["ttft"]
    assert ttft["outputs_identical"] is True
    lengths = ttft["prompt_tokens_per_turn"]  # each turn: previous prompt + reply + 12 new tokens
    assert len(lengths) == 3 and lengths[0] == 32
    assert all(b - a > 12 for a, b in zip(lengths, lengths[1:]))
    for stage in ("thinker", "talker"):
        row = ttft["per_stage"][stage]
        assert row["cached_tokens_turns2plus_on"] > 0 and row["cached_tokens_turns2plus_off"] == 0
        assert row["hit_rate_on"] > 0 and row["hit_rate_off"] == 0
    assert "talker: TTFT turns 2+" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_bench_pipeline_backends_part_splits_the_ray_step(ray_cluster, capsys):
    """The backends part on tiny_chain (2 requests, 1 repeat): outputs identical on both backends, the ratio, and each
    stage's step on Ray split into the tick and what the actor adds (hop, dispatch, gap), from the stages' timers."""
    import argparse

    from omni.bench import pipeline as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--config", CONFIG, "--skip-ttft", "--num-requests", "2", "--repeats", "1",
                              "--max-tokens", "6", "--threads-per-stage", "1"])
    res = bench.run(args)
    backends = res["backends"]
    assert backends["outputs_identical"] is True and res["ray_over_local_time_ratio"] > 0
    assert set(res["ray_step_overhead_ms"]) == {"thinker", "talker"}
    for stage, split in backends["ray_step_split_ms"].items():
        assert all(v >= 0 for v in split.values()), split
        assert res["ray_step_overhead_ms"][stage] == pytest.approx(sum(split.values()))
        assert backends["tick_ms"]["ray"][stage] > 0 and backends["tick_ms"]["local"][stage] > 0
    assert "the actor adds" in capsys.readouterr().out
