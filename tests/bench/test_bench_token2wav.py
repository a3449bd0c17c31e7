"""`omni bench token2wav` on the tiny checkpoint (short run)."""
from __future__ import annotations

import argparse

import pytest

from omni.bench import token2wav


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    token2wav.add_arguments(parser)
    return parser.parse_args(["--model", "builtin:tiny-qwen2_5-omni", *argv])


def test_token2wav_bench_compares_with_transformers_and_is_bitwise_equal(tiny_omni):
    res = token2wav.run(_args("--codes", "3", "17", "--repeats", "1"))
    assert [r["codes"] for r in res["lengths"]] == [3, 17]
    for row in res["lengths"]:
        assert row["bitwise_equal"] is True
        assert row["transformers_s"] > 0 and row["ours_s"] > 0
        assert row["speedup"] == pytest.approx(row["transformers_s"] / row["ours_s"])
        assert row["audio_s"] > 0 and row["rtf"] == pytest.approx(row["ours_s"] / row["audio_s"])
    assert res["bitwise_equal"] is True and set(res["speedup"]) == {"3", "17"}


@pytest.mark.parametrize("argv,match", [(["--codes", "0"], "--codes must be >= 1"),
                                        (["--repeats", "0"], "--repeats must be >= 1"),
                                        (["--codes", "100000"], "--codes: at most")])
def test_token2wav_bench_bad_arguments(tiny_omni, argv, match):
    with pytest.raises(ValueError, match=match):
        token2wav.run(_args(*argv))
