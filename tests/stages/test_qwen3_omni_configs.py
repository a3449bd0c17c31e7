"""The Qwen3-Omni stage configs: the tiny one is what the tests run; the 30B one (real weights from
$QWEN3_OMNI_PATH) loads a directory exactly as save_pretrained writes it: run here on the tiny checkpoint
(which is written that way), at fp32 and greedy, it gives transformers' text and frames like the tiny config."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni import cli
from omni.config.loader import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "stage_configs" / "qwen3_omni_tiny.yaml"
REAL = REPO / "stage_configs" / "qwen3_omni_30b_a3b.yaml"


def test_configs_validate_and_wire_the_registered_stages(monkeypatch):
    from tests.stages.qwen3_omni_utils import checkpoint

    monkeypatch.setenv("QWEN3_OMNI_PATH", str(checkpoint("tiny")))
    for path in (TINY, REAL):
        cfg = load_config(path)
        assert [s.model for s in cfg.stages] == ["qwen3_omni_thinker", "qwen3_omni_talker", "qwen3_omni_code2wav"]
        assert [s.input_processor for s in cfg.stages[1:]] == ["qwen3_omni_thinker2talker",
                                                               "qwen3_omni_talker2code2wav"]
    real = load_config(REAL)
    assert {s.model_path for s in real.stages} == {str(checkpoint("tiny"))}
    assert real.stages[2].inputs[0].stream  # audio streams with real weights


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_real_weights_config_runs_on_a_save_pretrained_directory(tmp_path, capsys, monkeypatch):
    from tests.stages.qwen3_omni_utils import checkpoint

    monkeypatch.setenv("QWEN3_OMNI_PATH", str(checkpoint("tiny")))
    prompt = "Hello there, who are you?"
    small = {"dtype": "float32", "cache": {"memory_budget_mb": 16}}
    overrides = {"thinker": {**small, "sampling": {"temperature": 0.0, "max_tokens": 8}},
                 "talker": {**small, "sampling": {"temperature": 0.0, "max_tokens": 20, "repetition_penalty": 1.05}},
                 "code2wav": {"model_kwargs": {"first_chunk_frames": 300, "chunk_frames": 300,
                                               "left_context_frames": 25}}}
    tiny = {"thinker": {"sampling": {"temperature": 0.0, "max_tokens": 8}},
            "talker": {"sampling": {"temperature": 0.0, "max_tokens": 20, "repetition_penalty": 1.05}}}
    results = {}
    for name, cfg, ov in (("real", REAL, overrides), ("tiny", TINY, tiny)):
        rc = cli.main(["run", str(cfg), "--prompt", prompt, "--json", "--backend", "local",
                       "--output-dir", str(tmp_path / name), "--stage-overrides", json.dumps(ov)])
        captured = capsys.readouterr()
        assert rc == 0, captured.err[-2000:]
        [results[name]] = json.loads(captured.out.strip().splitlines()[-1])["results"]
        assert results[name]["error"] is None
    assert results["real"]["outputs"]["thinker"]["token_ids"] == results["tiny"]["outputs"]["thinker"]["token_ids"]
    real_wav = (tmp_path / "real" / "0000_code2wav.wav").read_bytes()
    assert real_wav == (tmp_path / "tiny" / "0000_code2wav.wav").read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_small_checkpoint_and_config_stream_audio(tmp_path, capsys):
    """builtin:small-qwen3-omni (the benchmarks' checkpoint) has the proportions its recipe promises, and
    stage_configs/qwen3_omni_small.yaml streams text and audio from it end to end."""
    import wave

    import numpy as np

    from omni.registry import resolve_model_path

    path = resolve_model_path("builtin:small-qwen3-omni")
    info = json.loads((path / "omni_checkpoint.json").read_text())
    assert 80e6 < info["parameters"] < 160e6
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["thinker_config"]["text_config"]
    assert (text["num_experts"], text["num_experts_per_tok"]) == (8, 2)
    assert cfg["talker_config"]["num_code_groups"] == 16 and cfg["code2wav_config"]["codebook_size"] == 2048
    small = REPO / "stage_configs" / "qwen3_omni_small.yaml"
    rc = cli.main(["run", str(small), "--prompt", "Hello there", "--json", "--backend", "local", "--stream",
                   "--max-tokens", "12", "--output-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    [result] = json.loads(captured.out.strip().splitlines()[-1])["results"]
    assert result["error"] is None and len(result["outputs"]["thinker"]["token_ids"]) == 12
    with wave.open(str(tmp_path / "0000_code2wav.wav"), "rb") as w:
        audio = np.frombuffer(w.readframes(w.getnframes()), np.int16) / 32768
    assert len(audio) > 0 and 1e-3 < np.abs(audio).max() < 0.999  # neither silent nor clipped
