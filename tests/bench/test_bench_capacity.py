"""`omni bench capacity` on the tiny Qwen2.5-Omni (streamed edges), tiny sizes: the JSON keys, every level's
work, the stages' time split, omni's audio equal to transformers' at concurrency 1, the plot."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from omni.bench import capacity as bench
from omni.engine.step_profile import PHASES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_capacity_bench_on_the_tiny_omni_pipeline(tmp_path, tiny_streamed_omni, ray_cluster):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    # Two token2wav replicas (the bottleneck stage scaled out, as README shows): the streamed consumer's
    # replica chosen per request, its busy time counted per replica; each with its vocoder thread and two DiT
    # threads (as the small config runs).
    overrides = {"token2wav": {"replicas": 2, "model_kwargs": {"first_chunk_codes": 5, "chunk_codes": 8,
                                                               "vocoder_thread": True, "dit_threads": 2}}}
    args = parser.parse_args(["--config", str(tiny_streamed_omni), "--concurrency", "4", "--requests", "4",
                              "--reply-seconds", "0.4", "--thinker-tokens", "4", "--plot", str(tmp_path / "cap.png"), "--rates", "8",
                              "--stage-overrides", json.dumps(overrides)])
    res = bench.run(args)
    assert res["stage_overrides"] == overrides
    # the vocoder thread ran the later pieces (20 codes: pieces of 5, 8, 7) on each level
    assert set(res["vocoder_busy_fraction"]) == {"1", "4"}
    assert all(0 < lv["token2wav"] <= 1 and set(lv) == {"token2wav"} for lv in res["vocoder_busy_fraction"].values())
    assert res["concurrency"] == [1, 4]  # 1 is always run
    assert res["codec_tokens"] == 20
    for key in ("audio_s_per_s", "ttfp_p50_ms", "ttfp_p99_ms", "rtf_p50", "rtf_p99"):
        assert sorted(res[key]) == ["1", "4"], key
        assert all(v > 0 for v in res[key].values()), key
    # Every reply is 20 codec tokens (on the tiny checkpoint's vocoder not 0.4 s: its upsampling is smaller),
    # at every level, on both backends and in transformers.
    audio_s = res["levels"]["1"]["audio_s"]
    assert audio_s > 0
    assert res["local_c1"]["audio_s"] == audio_s and res["hf"]["audio_s"] == audio_s
    for c, level in res["levels"].items():
        assert level["requests"] == 4
        assert level["audio_s"] == audio_s, c
        assert level["ttfp_p50_ms"] <= level["ttfp_p99_ms"]
        assert 0 <= level["stall_p50_ms"] <= level["stall_p99_ms"]
        assert sorted(res["stage_busy_fraction"][c]) == ["talker", "thinker", "token2wav"]
        for stage, split in res["stage_profile"][c].items():
            assert sum(split[p] for p in PHASES) == pytest.approx(1.0), (c, stage)
            assert res["stage_busy_fraction"][c][stage] == pytest.approx(1 - split["waiting"])
            assert 0 < res["stage_busy_fraction"][c][stage] <= 1, (c, stage)
        assert res["stage_profile"][c]["thinker"]["sampling"] > 0  # an autoregressive stage samples
        # The machine's CPU over the level (Linux): busy, an audio second's cost, and the rate it allows.
        assert 0 < level["machine_cpu_busy"] <= 1
        assert level["core_s_per_audio_s"] == pytest.approx(
            level["machine_cpu_busy"] * level["cores"] * level["wall_s"] / level["audio_s"])
        assert level["audio_s_per_s_cpu_ceiling"] == pytest.approx(level["cores"] / level["core_s_per_audio_s"])
        assert level["audio_s_per_s_cpu_ceiling"] >= level["audio_s_per_s"] * (1 - 1e-9)
    assert res["throughput_c4_over_c1_cpu_ceiling"] == pytest.approx(
        res["levels"]["4"]["audio_s_per_s_cpu_ceiling"] / res["levels"]["1"]["audio_s_per_s"])
    assert 0 < res["hf"]["machine_cpu_busy"] <= 1 and res["hf"]["core_s_per_audio_s"] > 0
    for key in ("throughput_c4_over_c1", "ttfp_p99_c4_over_c1_p50", "ray_over_local_e2e_c1",
                "vs_hf_audio_s_per_s_c4", "vs_hf_ttfp_c1"):
        assert res[key] > 0, key
    assert res["local_c1"]["requests"] == 4 and res["hf"]["requests"] == 4
    # The open loop: 4 requests arriving at 8 a second, the same replies, timed from their own submissions.
    (rate, open_level), = res["open_loop"].items()
    assert rate == "8" and open_level["rate_per_s"] == 8 and open_level["requests"] == 4
    assert open_level["audio_s"] == audio_s  # the 4 replies' audio, as at every level
    assert open_level["offered_audio_s_per_s"] == pytest.approx(8 * audio_s / 4)
    assert 0 < open_level["arrival_span_s"] < open_level["wall_s"]
    assert 0 < open_level["ttfp_p50_ms"] <= open_level["ttfp_p99_ms"]
    assert sorted(open_level["stage_busy_fraction"]) == ["talker", "thinker", "token2wav"]
    assert res["hf"]["device"] == "cpu"  # where the pipeline's thinker runs (Ray tests run on CPU machines)
    for backend in ("local", "ray"):  # 20 codes: far from the near ties a long reply can meet on Ray
        agree = res["hf"][backend]
        assert agree["thinker_tokens_identical"] == 1 and agree["codes_identical"] == 1, (backend, agree)
        assert agree["codes_first_difference"] == [None] * 4, (backend, agree)
    assert res["audio_identical"] == 1 and res["audio_identical_ray"] == 1, res["hf"]
    assert Path(res["plot"]).stat().st_size > 1000
