"""`omni bench omni` on the tiny Qwen2.5-Omni config (short run)."""
from __future__ import annotations

import argparse

import pytest

from omni.bench import omni_bench


@pytest.mark.slow
def test_omni_bench_reports_speedups_and_hits(tiny_omni):
    parser = argparse.ArgumentParser()
    omni_bench.add_arguments(parser)
    args = parser.parse_args(["--turns", "2", "--thinker-max-tokens", "4", "--talker-max-tokens", "6",
                              "--repeats", "1"])
    res = omni_bench.run(args)
    assert res["turn_latency_speedup"] > 0 and res["first_audio_speedup"] > 0
    assert res["outputs_identical"] is True
    on = res["caching_on"]
    assert on["cached_tokens"][1]["thinker"] > 0 and on["cached_tokens"][1]["talker"] > 0
    assert res["caching_off"]["cached_tokens"][1] == {"thinker": 0, "talker": 0}
    for run in (on, res["caching_off"]):
        for latency, stages in zip(run["turn_latency_s"], run["stage_s"]):
            # the three stages run one after the other: their times add up to the turn's
            assert set(stages) == {"thinker", "talker", "token2wav"} and min(stages.values()) > 0
            # (the stage times telescope to the latency exactly; each of the three is rounded to 1e-4 s)
            assert sum(stages.values()) == pytest.approx(latency, abs=3 * 0.5e-4 + 1e-9)
    with pytest.raises(ValueError, match="turns"):
        omni_bench.run(parser.parse_args(["--turns", "1"]))
