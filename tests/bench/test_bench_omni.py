"""`omni bench omni` on the tiny Qwen2.5-Omni config (short run)."""
from __future__ import annotations

import argparse

import pytest
import torch

from omni.bench import omni_bench

# `device: auto`: on a machine with a GPU the stages run there, where kernels need not sum in one order from run to
# run (an H100: the small Qwen2.5-Omni's waveforms 140 dB apart, caching on vs off, with every token equal).
ON_GPU = torch.cuda.is_available()


def assert_caching_changed_nothing(res):
    assert res["tokens_identical"] is True
    if ON_GPU:
        assert res["audio_snr_db_min"] is None or res["audio_snr_db_min"] >= 100
    else:
        assert res["outputs_identical"] is True and res["audio_snr_db_min"] is None  # None: bit for bit


@pytest.mark.slow
def test_omni_bench_reports_speedups_and_hits(tiny_omni):
    parser = argparse.ArgumentParser()
    omni_bench.add_arguments(parser)
    args = parser.parse_args(["--turns", "2", "--thinker-max-tokens", "4", "--talker-max-tokens", "6",
                              "--repeats", "1", "--edges", "plain"])
    res = omni_bench.run(args)
    assert res["edges"] == "plain"
    assert res["turn_latency_speedup"] > 0 and res["first_audio_speedup"] > 0
    assert_caching_changed_nothing(res)
    on = res["caching_on"]
    assert on["cached_tokens"][1]["thinker"] > 0 and on["cached_tokens"][1]["talker"] > 0
    assert res["caching_off"]["cached_tokens"][1] == {"thinker": 0, "talker": 0}
    for run in (on, res["caching_off"]):
        for latency, stages in zip(run["turn_latency_s"], run["stage_s"]):
            # the three stages run one after the other: their times add up to the turn's
            assert set(stages) == {"thinker", "talker", "token2wav"} and min(stages.values()) > 0
            # (the stage times telescope to the latency exactly; each of the three is rounded to 1e-4 s)
            assert sum(stages.values()) == pytest.approx(latency, abs=3 * 0.5e-4 + 1e-9)
        # plain edges: the caller's first audio is the finished waveform
        assert run["first_waveform_s"] == run["turn_latency_s"]
    assert res["first_waveform_speedup"] == pytest.approx(res["turn_latency_speedup"])
    with pytest.raises(ValueError, match="turns"):
        omni_bench.run(parser.parse_args(["--turns", "1"]))


@pytest.mark.slow
def test_omni_bench_on_qwen3_omni_finds_code2wav():
    """The Qwen3-Omni chain (thinker -> talker -> code2wav, found from the config: no stage named token2wav), with
    an image and an audio clip in turn 1: the second turn hits both decoders' caches, the outputs are identical."""
    parser = argparse.ArgumentParser()
    omni_bench.add_arguments(parser)
    args = parser.parse_args(["--config", "stage_configs/qwen3_omni_tiny.yaml", "--turns", "2", "--doc-tokens", "40",
                              "--thinker-max-tokens", "4", "--talker-max-tokens", "6", "--repeats", "1"])
    res = omni_bench.run(args)
    assert res["stages"] == ["thinker", "talker", "code2wav"]
    assert res["turn_latency_speedup"] > 0 and res["first_audio_speedup"] > 0
    assert_caching_changed_nothing(res)
    on, off = res["caching_on"], res["caching_off"]
    assert on["cached_tokens"][1]["thinker"] > 0 and on["cached_tokens"][1]["talker"] > 0
    assert off["cached_tokens"][1] == {"thinker": 0, "talker": 0}
    assert on["media"] == ["image"]  # auto: the Qwen3 talker refuses an image and a clip in one conversation
    # The image is encoded once per conversation: with caching on turn 2's prefix hit skips it, with caching off
    # turn 2 re-prefills it from the encoder cache.
    assert on["encoder"]["encoder_runs"] == 1 and off["encoder"]["encoder_runs"] == 1
    assert off["encoder"]["encoder_cache_hits"] >= 1
    for run in (on, off):
        for latency, stages in zip(run["turn_latency_s"], run["stage_s"]):
            assert set(stages) == {"thinker", "talker", "code2wav"} and min(stages.values()) > 0
            assert sum(stages.values()) == pytest.approx(latency, abs=3 * 0.5e-4 + 1e-9)


@pytest.mark.slow
def test_omni_bench_runs_the_configs_own_streaming_edges(tiny_streamed_qwen3_omni):
    """By default the config's edges as a user runs them: with thinker ~> talker ~> code2wav streamed the talker's
    first codec token comes before the first waveform chunk, which comes before the turn's end (code2wav's 2-frame
    windows of a 6-frame reply); caching still changes no output."""
    parser = argparse.ArgumentParser()
    omni_bench.add_arguments(parser)
    res = omni_bench.run(parser.parse_args([
        "--config", str(tiny_streamed_qwen3_omni), "--turns", "2", "--doc-tokens", "40", "--thinker-max-tokens", "4",
        "--talker-max-tokens", "6", "--repeats", "1"]))
    assert res["edges"] == "config"
    assert_caching_changed_nothing(res)
    for key in ("turn_latency_speedup", "first_audio_speedup", "first_waveform_speedup"):
        assert res[key] > 0, key
    for run in (res["caching_on"], res["caching_off"]):
        for codec, first, end in zip(run["first_audio_s"], run["first_waveform_s"], run["turn_latency_s"]):
            assert 0 < codec < first < end
    assert res["caching_on"]["cached_tokens"][1]["talker"] > 0


def test_audio_chain_is_found_from_the_edges():
    from omni.bench.audio_chain import AudioChain, audio_chain

    import numpy as np

    qwen3 = audio_chain("stage_configs/qwen3_omni_tiny.yaml")
    assert qwen3 == AudioChain("thinker", "talker", "code2wav", mixed_media=False)
    qwen2_5 = audio_chain("stage_configs/qwen2_5_omni_tiny.yaml")
    assert qwen2_5 == AudioChain("thinker", "talker", "token2wav", mixed_media=True)
    # turn 1's media: both where the talker takes them together, else the image (or what is asked for)
    assert list(qwen2_5.media(np.random.default_rng(0))) == ["image", "audio"]
    assert list(qwen3.media(np.random.default_rng(0))) == ["image"]
    assert list(qwen3.media(np.random.default_rng(0), ["audio"])) == ["audio"]
    with pytest.raises(ValueError, match="refuses an image and an audio clip"):
        qwen3.media(np.random.default_rng(0), ["image", "audio"])
    assert audio_chain("stage_configs/qwen3_omni_small.yaml").plain_edges() == {
        "talker": {"inputs": ["thinker"]}, "code2wav": {"inputs": ["talker"]}}
    with pytest.raises(ValueError, match="config 'tiny_chain': expected exactly one stage with final_output: audio"):
        audio_chain("stage_configs/tiny_chain.yaml")
