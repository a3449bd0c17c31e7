"""Smoke test of `omni bench kv` (the workloads drive the real manager end to end)."""

import argparse
import json

import pytest

from omni.bench import kv


@pytest.mark.slow
def test_bench_kv_reports_every_key(capsys):
    parser = argparse.ArgumentParser()
    kv.add_arguments(parser)
    result = kv.run(parser.parse_args(["--repeats", "1"]))
    keys = ["long_prompt_miss_us", "long_prompt_hit_us", "shared_prefix_us_per_request",
            "shared_prefix_evict_us_per_request", "hash_tokens_per_s"]
    for k in keys:
        assert result[k] > 0
        assert k in result["vllm_anchor"] and result["speedup_vs_vllm_anchor"][k] > 0
    json.dumps(result)
    assert "long_prompt_miss_us" in capsys.readouterr().out


def test_bench_kv_rejects_bad_repeats():
    parser = argparse.ArgumentParser()
    kv.add_arguments(parser)
    with pytest.raises(ValueError, match="--repeats"):
        kv.run(parser.parse_args(["--repeats", "0"]))
