"""`omni bench streaming --pipeline omni` on the tiny Qwen2.5-Omni (short run, local backend): every
mode makes the same audio (fixed-length replies), the keys and the TTFP-per-turn plot."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from omni import Omni
from omni.bench import streaming as bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_streaming_bench_on_the_omni_pipeline(tmp_path, tiny_streamed_omni):
    path = tiny_streamed_omni
    cfg = yaml.safe_load(path.read_text())
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    codes = 20
    args = parser.parse_args(["--pipeline", "omni", "--omni-config", str(path), "--backend", "local",
                              "--concurrency", "1", "--omni-repeats", "2", "--omni-turns", "2",
                              "--omni-doc-tokens", "40", "--omni-audio-codes", str(codes),
                              "--plot", str(tmp_path / "ttfp.png")])
    res = bench.run(args)
    for key in ("ttfp_speedup", "rtf_streaming", "e2e_ratio"):
        assert res[key] > 0, key
    # min_tokens = max_tokens: every reply is `codes` codec tokens of audio, whatever the prompt (the
    # repeats' prompts differ) and the mode; the mean equals one request's length below
    seconds = res["omni_c1"]["non_streaming"]["audio_s"]
    for mode in ("non_streaming", "streaming"):
        entry = res["omni_c1"][mode]
        assert entry["audio_s"] == pytest.approx(seconds), mode
        assert 0 < entry["ttfp_s"] <= entry["e2e_s"]
        assert len(entry["ttfp_s_each"]) == 2 and entry["ttfp_s"] == pytest.approx(sum(entry["ttfp_s_each"]) / 2)
    # ... and that length is the one asked for (the config's own talker max_tokens is longer)
    talker = next(st for st in cfg["stages"] if st["name"] == "talker")
    assert talker["sampling"]["max_tokens"] > codes
    with Omni(str(path), backend="local",
              stage_overrides={"talker": {"sampling": {"max_tokens": codes, "min_tokens": codes}}}) as o:
        [out] = o.generate(["Just checking the length."], use_tqdm=False)
    audio = out.outputs["token2wav"]
    assert seconds == pytest.approx(len(audio.audio) / int(audio.passthrough.get("sampling_rate", 24000)))
    assert sorted(res["ttfp_per_turn"]) == ["non_streaming_caching_off", "non_streaming_caching_on",
                                             "streaming_caching_off", "streaming_caching_on"]
    assert all(len(v) == 2 for v in res["ttfp_per_turn"].values())
    assert Path(res["plot"]).stat().st_size > 1000


def test_streaming_bench_on_the_qwen3_omni_pipeline(tiny_streamed_qwen3_omni):
    """`--pipeline qwen3-omni`: the code2wav stage found from the config, the keys at concurrency 1 and 4, every
    mode the same length of audio, and the first audio of a streamed request before its end."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    frames = 12
    args = parser.parse_args(["--pipeline", "qwen3-omni", "--omni-config", str(tiny_streamed_qwen3_omni),
                              "--backend", "local", "--concurrency", "1", "4", "--omni-repeats", "1",
                              "--omni-turns", "2", "--omni-doc-tokens", "40", "--omni-audio-codes", str(frames)])
    res = bench.run(args)
    assert res["omni_stages"] == ["thinker", "talker", "code2wav"] and res["omni_audio_codes"] == frames
    assert res["omni_media"] == ["image"]  # the Qwen3 talker refuses an image and a clip in one conversation
    assert "chain_first_token_speedup" not in res  # qwen3-omni runs that part alone
    for key in ("ttfp_speedup", "rtf_streaming", "e2e_ratio", "ttfp_speedup_c4", "rtf_streaming_c4", "e2e_ratio_c4"):
        assert res[key] > 0, key
    # one waveform per one-shot request: nothing to wait for once it plays
    assert res["omni_c1"]["non_streaming"]["stall_s"] == 0 and res["stall_s_streaming"] >= 0
    seconds = res["omni_c1"]["non_streaming"]["audio_s"]
    assert seconds > 0
    for c in ("omni_c1", "omni_c4"):
        for mode in ("non_streaming", "streaming"):
            entry = res[c][mode]
            assert entry["audio_s"] == pytest.approx(seconds), (c, mode)  # min_tokens = max_tokens: fixed length
            assert 0 < entry["ttfp_s"] <= entry["e2e_s"]
        assert len(res[c]["streaming"]["ttfp_s_each"]) == int(c[-1])
    # Streaming: code2wav's first chunk (2 frames) is audio long before the reply's 12 frames are done.
    assert res["omni_c1"]["streaming"]["ttfp_s"] < res["omni_c1"]["streaming"]["e2e_s"]
    assert all(len(v) == 2 for v in res["ttfp_per_turn"].values())
