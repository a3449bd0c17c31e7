"""Smoke test of `omni bench plan` (the planner's split vs an even split of one budget, replayed
through the stages' real KV cache managers)."""
import argparse
import json

import pytest

from omni.bench import plan


def _run(argv):
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    return plan.run(parser.parse_args(argv))


def test_bench_plan_reports_the_issue_keys(capsys):
    r = _run(["--config", "stage_configs/qwen2_5_omni_tiny.yaml", "--conversations", "2", "--context-tokens", "64",
              "--turns", "2"])
    json.dumps(r)
    for split in ("planned", "even"):
        assert set(r[split]) == {"thinker", "talker"}  # token2wav has no KV cache
        assert all(0 <= s["hit_rate"] <= 1 and s["num_blocks"] > 0 for s in r[split].values())
    assert r["planned_over_even_hit_rate"] > 0 and r["planning_seconds"] > 0
    assert "pipeline hit rate" in capsys.readouterr().out


@pytest.mark.slow  # builds the small checkpoint (once) where it is not made yet
def test_the_planned_split_beats_an_even_one_on_the_small_omni_pipeline():
    r = _run([])  # the issue's setting: small Qwen2.5-Omni, the talker's sequences longer than the thinker's
    assert r["planned"]["talker"]["num_blocks"] > r["even"]["talker"]["num_blocks"]
    assert r["planned"]["talker"]["turns_without_room"] == 0
    assert r["planned_over_even_hit_rate"] >= 1.1


def test_bench_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="--conversations"):
        _run(["--conversations", "0"])
