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
