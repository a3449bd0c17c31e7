"""The Qwen3-ASR stage configs: `omni run` on the tiny one transcribes a clip named in a prompts file (its language
and context too) as transformers does; the real-weights one ($QWEN3_ASR_PATH) loads a directory exactly as
save_pretrained writes it (the tiny checkpoint is written that way) and gives the same tokens; the small checkpoint
has the proportions its recipe promises."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf

from omni import cli
from tests.stages.qwen3_asr.asr_utils import EOS_TEXT, speech

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "stage_configs" / "qwen3_asr_tiny.yaml"
REAL = REPO / "stage_configs" / "qwen3_asr.yaml"
SMALL = REPO / "stage_configs" / "qwen3_asr_small.yaml"


def _prompts(tmp_path: Path) -> Path:
    """Two lines: 3 s of the recording alone, and the same with a forced language and a context."""
    sf.write(tmp_path / "clip.wav", speech()[: 3 * 16000], 16000, subtype="FLOAT")
    audio = {"audio": "clip.wav"}
    lines = [{"prompt": "", "multi_modal_data": audio},
             {"prompt": "Beckett", "multi_modal_data": audio, "mm_processor_kwargs": {"language": "en"}}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _run(config: Path, prompts: Path, capsys, *extra: str) -> list[dict]:
    rc = cli.main(["run", str(config), "--prompts-file", str(prompts), "--json", "--backend", "local", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    results = json.loads(captured.out.strip().splitlines()[-1])["results"]
    assert all(r["error"] is None for r in results)
    return [r["outputs"]["asr"] for r in results]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_omni_run_transcribes_a_prompts_files_clip_as_transformers(tmp_path, capsys, hf_asr, asr_processor):
    from tests.stages.qwen3_asr.asr_utils import hf_generate, shown_text

    outs = _run(TINY, _prompts(tmp_path), capsys, "--max-tokens", "10")
    clip = speech()[: 3 * 16000]
    for out, (language, context) in zip(outs, [(None, None), ("en", "Beckett")]):
        ids, ref = hf_generate(hf_asr, asr_processor, clip, language, context, max_tokens=10)
        ref = ref[: next((i + 1 for i, t in enumerate(ref) if t == EOS_TEXT), len(ref))]
        assert out["token_ids"] == ref and out["text"] == shown_text(asr_processor, ref)


@pytest.mark.timeout(300)
def test_real_weights_config_runs_on_a_save_pretrained_directory(tmp_path, capsys, monkeypatch, asr_path):
    monkeypatch.setenv("QWEN3_ASR_PATH", str(asr_path))
    prompts = _prompts(tmp_path)
    small = json.dumps({"asr": {"dtype": "float32", "cache": {"memory_budget_mb": 16}, "resources": {"num_gpus": 0}}})
    real = _run(REAL, prompts, capsys, "--max-tokens", "8", "--stage-overrides", small)
    tiny = _run(TINY, prompts, capsys, "--max-tokens", "8")
    assert [o["token_ids"] for o in real] == [o["token_ids"] for o in tiny]


@pytest.mark.slow
def test_the_small_checkpoint_has_its_promised_proportions():
    from omni.config.loader import load_config
    from omni.registry import resolve_model_path

    path = resolve_model_path(load_config(SMALL).stages[0].model_path)
    info = json.loads((path / "omni_checkpoint.json").read_text())
    assert 80e6 < info["parameters"] < 160e6
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["audio_config"]["n_window_infer"] == 800 and cfg["text_config"]["num_key_value_heads"] == 4
