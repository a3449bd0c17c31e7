"""`omni bench token2wav` on the tiny checkpoint (short run)."""
from __future__ import annotations

import argparse

import pytest

from omni.bench import token2wav


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    token2wav.add_arguments(parser)
    return parser.parse_args(["--model", "builtin:tiny-qwen2_5-omni", *argv])


@pytest.mark.slow
def test_token2wav_bench_compares_with_transformers_and_agrees(tiny_omni):
    """3 codes lie inside one DiT block (bitwise transformers'); 40 span several (block-local attention:
    the same waveform up to the order of fp32 sums, far above 100 dB SNR)."""
    res = token2wav.run(_args("--codes", "3", "40", "--repeats", "1"))
    assert [r["codes"] for r in res["lengths"]] == [3, 40]
    assert res["lengths"][0]["bitwise_equal"] is True and res["lengths"][0]["max_abs_diff"] == 0.0
    for row in res["lengths"]:
        assert row["agrees"] is True and (row["bitwise_equal"] or row["snr_db"] >= 100.0)
        assert row["transformers_s"] > 0 and row["ours_s"] > 0
        assert row["speedup"] == pytest.approx(row["transformers_s"] / row["ours_s"])
        assert row["audio_s"] > 0 and row["rtf"] == pytest.approx(row["ours_s"] / row["audio_s"])
    assert res["outputs_agree"] is True and set(res["speedup"]) == {"3", "40"}
    new = res["newcomer"]  # a streamed newcomer's first audio, alone and behind a stream in flight
    assert new["alone_ms"] > 0 and new["behind_a_stream_ms"] > 0
    assert res["newcomer_wait_ratio"] == pytest.approx(new["behind_a_stream_ms"] / new["alone_ms"])


@pytest.mark.parametrize("argv,match", [(["--codes", "0"], "--codes must be >= 1"),
                                        (["--repeats", "0"], "--repeats must be >= 1"),
                                        (["--codes", "100000"], "--codes: at most")])
def test_token2wav_bench_bad_arguments(tiny_omni, argv, match):
    with pytest.raises(ValueError, match=match):
        token2wav.run(_args(*argv))
