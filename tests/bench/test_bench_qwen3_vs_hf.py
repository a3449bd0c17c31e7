"""`omni bench qwen3-vs-hf` on the tiny Qwen3-Omni (streamed edges, local backend), tiny sizes: the JSON keys, both
levels' work, and omni's audio equal to transformers' generate under greedy decoding."""
from __future__ import annotations

import argparse

import pytest

from omni.bench import qwen3_vs_hf as bench
from tests.stages.qwen3_omni_utils import GPU_MIN_SNR_DB, PIPELINE_ON_GPU

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_qwen3_vs_hf_on_the_tiny_pipeline(tiny_streamed_qwen3_omni):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--config", str(tiny_streamed_qwen3_omni), "--backend", "local", "--requests", "2",
                              "--thinker-tokens", "4", "--reply-frames", "8"])
    res = bench.run(args)
    assert res["stages"] == ["thinker", "talker", "code2wav"]
    for key in ("ttfp_speedup_c1", "e2e_speedup_c1", "requests_per_s_speedup_c4"):
        assert res[key] > 0, key
    hf = res["hf"]
    assert res["omni_c1"]["requests"] == res["omni_c4"]["requests"] == hf["requests"] == 2
    # fixed-length replies: the same audio at both levels; transformers' one-shot chunked_decode(300) keeps the few
    # trailing samples each of omni's 2-frame windows drops (chunked_decode's own behaviour per window)
    assert res["omni_c1"]["audio_s"] == res["omni_c4"]["audio_s"] > 0
    assert res["omni_c1"]["audio_s"] < hf["audio_s"] < 1.25 * res["omni_c1"]["audio_s"]
    for level in ("omni_c1", "omni_c4"):
        assert 0 < res[level]["ttfp_p50_ms"] <= res[level]["ttfp_p99_ms"]
    assert hf["thinker_tokens_identical"] == 1 and hf["first_codebook_identical"] == 1
    # transformers' code2wav on its frames in omni's windows: the same waveform up to the blocking of fp32 sums (bit
    # for bit where the thread counts match; on Ray the stage's actor has its own)
    # transformers' reference runs where the pipeline's thinker runs: a GPU comparison is GPU against GPU
    assert hf["device"] == ("cuda" if PIPELINE_ON_GPU else "cpu")
    if PIPELINE_ON_GPU:  # cuDNN's TF32 convolutions, blocked differently on each side
        assert hf["audio_snr_db_min"] >= GPU_MIN_SNR_DB, hf
    else:
        assert hf["audio_snr_db_min"] >= 100 and res["audio_identical"] == 1, hf


def test_qwen3_vs_hf_refuses_a_pipeline_without_audio():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(ValueError, match="final_output: audio"):
        bench.run(parser.parse_args(["--config", "stage_configs/tiny_chain.yaml", "--backend", "local"]))
