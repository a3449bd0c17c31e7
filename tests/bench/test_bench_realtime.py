"""`omni bench realtime` on the tiny Qwen2.5-Omni (short run): both servers, two session counts, the JSON keys
(the numbers are the integrator's to measure on an idle machine; here: that the caching run hits and the
uncached one does not)."""
from __future__ import annotations

import argparse

import pytest

from omni.bench import realtime as bench
from tests.serve.server_utils import OMNI  # the bench starts `omni serve` itself

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_realtime_reports_per_turn_latency_on_and_off():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--config", str(OMNI), "--backend", "local", "--sessions", "1", "2",
                              "--turns", "3", "--speech-s", "1.0", "--max-output-tokens", "4",
                              "--instructions-words", "50"])
    res = bench.run(args)
    for suffix in ("", "_c2"):
        assert res[f"turn2plus_first_audio_speedup{suffix}"] > 0
        assert res[f"turn5_over_turn2_latency{suffix}"] > 0
        lat = res[f"turn_latency_p50_ms{suffix}"]
        assert set(lat) == {"on", "off"} and all(set(v) == {"1", "2", "3"} for v in lat.values())
        assert all(ms > 0 for v in lat.values() for ms in v.values())
        cached = res[f"cached_tokens_mean{suffix}"]
        assert cached["off"] == {"1": 0, "2": 0, "3": 0}
        assert cached["on"]["1"] == 0 and cached["on"]["2"] > 0 and cached["on"]["3"] > cached["on"]["2"]
    with pytest.raises(ValueError, match="turns"):
        bench.run(parser.parse_args(["--turns", "1"]))


def test_bench_realtime_on_qwen3_omni():
    """`--config` a Qwen3-Omni pipeline: the same sessions through its thinker, talker (code predictor) and code2wav;
    the cached server hits from turn 2 on."""
    from tests.serve.server_utils import REPO

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    res = bench.run(parser.parse_args([
        "--config", str(REPO / "stage_configs" / "qwen3_omni_tiny.yaml"), "--backend", "local", "--sessions", "1",
        "--turns", "2", "--speech-s", "1.0", "--max-output-tokens", "4", "--instructions-words", "50"]))
    assert res["config"] == "qwen3_omni_tiny" and res["turn2plus_first_audio_speedup"] > 0
    assert res["cached_tokens_mean"]["on"]["2"] > 0 and res["cached_tokens_mean"]["off"] == {"1": 0, "2": 0}


def test_bench_realtime_on_the_voice_agent():
    """The cascade (ASR -> LLM -> TTS -> codec): a third server with plain edges, the keys the voice agent is
    measured by; the LLM's cache hits from turn 2 on."""
    from tests.serve.server_utils import REPO

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    res = bench.run(parser.parse_args([
        "--config", str(REPO / "stage_configs" / "voice_agent_tiny.yaml"), "--backend", "local", "--sessions", "1",
        "--turns", "2", "--speech-s", "1.0", "--max-output-tokens", "12", "--instructions-words", "30"]))
    assert set(res["turn_latency_p50_ms"]) == {"on", "off", "plain"}
    for key in ("first_audio_speedup_vs_plain", "last_turn_caching_speedup", "last_over_turn2_latency"):
        assert res[key] > 0
    assert res["cached_tokens_mean"]["on"]["2"] > 0 and res["cached_tokens_mean"]["off"] == {"1": 0, "2": 0}
