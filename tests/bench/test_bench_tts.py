"""`omni bench tts` on the tiny Higgs Audio v2 (local backend, short run): the JSON keys, every mode's work, the
voice's blocks hit with caching on and never off, and omni's one-shot audio equal to transformers' generate decoded
by the same codec (the numbers are the integrator's to measure on an idle machine, on the small checkpoint)."""
from __future__ import annotations

import argparse

import pytest

from omni.bench import tts as bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_tts_reports_the_issue_keys_on_the_tiny_pipeline():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--config", "stage_configs/higgs_audio_v2_tiny.yaml", "--backend", "local", "--voices",
                              "2", "--sentences", "2", "--reference-s", "2", "--max-frames", "24", "--concurrency", "2"])
    res = bench.run(args)
    assert res["requests"] == 4 and res["counted_requests"] == 2 and res["reference_frames"] == 100
    for key in ("ttfa_speedup", "streaming_ttfa_speedup", "vs_hf_audio_s_per_s_c4", "audio_s_per_s_c4",
                "hf_audio_s_per_s"):
        assert res[key] > 0, key
    assert set(res["ttfa_ms"]) == {"on", "off", "oneshot"}
    assert res["voice_prefix_hit_rate"] > 0.3 and res["hit_rate_off"] == 0  # the voice's blocks, on only
    assert res["audio_identical"] == 1
    assert res["min_frames"] == 24 and res["reply_frames"] == [24] * 4  # every reply its sentence's length
