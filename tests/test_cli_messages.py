"""The messages of `omni validate` / `omni run` a new user meets first (issue 47): a missing model directory
names the environment variable that sets it and the path once; an empty model directory is refused before
anything loads; a problem every stage shares is one line, once; a YAML key typo gets "did you mean"."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omni import cli
from tests.test_cli_errors import no_engines, one_line_error  # noqa: F401 (a fixture and a helper, shared)

REPO = Path(__file__).resolve().parents[1]
SEVEN_B = REPO / "stage_configs" / "qwen2_5_omni_7b.yaml"


def test_missing_weights_name_the_variable_and_the_path_once(capsys, monkeypatch):
    monkeypatch.delenv("QWEN2_5_OMNI_PATH", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent-home")  # the config's default, ~/models/..., is then missing
    assert cli.main(["validate", str(SEVEN_B)]) == 2
    err = one_line_error(capsys)
    path = "/nonexistent-home/models/Qwen2.5-Omni-7B"
    assert err.count(path) == 1, err
    assert err.startswith(f"error: stages 'thinker', 'talker', 'token2wav': model_path: model path '{path}' "
                          "does not exist"), err
    assert "$QWEN2_5_OMNI_PATH, which is not set" in err and "export QWEN2_5_OMNI_PATH=" in err, err


def test_a_set_variable_is_named_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QWEN2_5_OMNI_PATH", str(tmp_path / "nope"))
    assert cli.main(["validate", str(SEVEN_B)]) == 2
    err = one_line_error(capsys)
    assert err.count(str(tmp_path / "nope")) == 1 and err.endswith("the config reads it from $QWEN2_5_OMNI_PATH")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_an_empty_model_directory_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch, no_engines,
                                                                   command):
    empty = tmp_path / "model"
    empty.mkdir()
    monkeypatch.setenv("QWEN2_5_OMNI_PATH", str(empty))
    argv = [command, str(SEVEN_B), *(["--prompt", "hi", "--backend", "local"] if command == "run" else [])]
    assert cli.main(argv) == 2
    assert one_line_error(capsys) == (
        f"error: stages 'thinker', 'talker', 'token2wav': model_path: model path '{empty}' holds no config.json: "
        "give the directory of a Hugging Face checkpoint (config.json, the weights, the tokenizer); "
        "the config reads it from $QWEN2_5_OMNI_PATH")


def test_a_model_directory_without_a_tokenizer_is_refused_for_the_stage_that_tokenizes(tmp_path, capsys,
                                                                                         monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("QWEN2_5_OMNI_PATH", str(model))
    assert cli.main(["validate", str(SEVEN_B)]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: stage 'thinker': model_path: model path '{model}' holds no tokenizer "), err
    (model / "tokenizer.json").write_text("{}")
    assert cli.main(["validate", str(SEVEN_B)]) == 0, capsys.readouterr().err


def test_a_separate_tokenizer_directory_is_checked(tmp_path, capsys):
    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    (model / "config.json").write_text("{}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"runtime": {"backend": "local"}, "stages": [
        {"name": "a", "model": "causal_lm", "model_path": str(model), "tokenizer": str(tok), "final_output": "text"}]}))
    assert cli.main(["validate", str(cfg)]) == 2
    assert one_line_error(capsys).startswith(f"error: stage 'a': tokenizer: tokenizer path '{tok}' holds no tokenizer")


@pytest.mark.parametrize("typo,suggestion", [("enable_prefix_cachng", "enable_prefix_caching"),
                                             ("blok_size", "block_size")])
def test_a_key_typo_gets_did_you_mean(tmp_path, capsys, typo, suggestion):
    stage = {"name": "a", "model_path": "builtin:tiny-qwen2", "final_output": "text"}
    if typo == "blok_size":
        stage["cache"] = {typo: 4}
    else:
        stage[typo] = False
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(yaml.safe_dump({"stages": [stage]}))
    assert cli.main(["validate", str(cfg)]) == 2
    err = one_line_error(capsys)
    assert f"unknown key {typo!r} (allowed: " in err and err.endswith(f"); did you mean {suggestion!r}?"), err


def test_a_qwen2_5_omni_config_loads_without_false_vocabulary_warnings():
    """The talker config's thinker-vocabulary ids are right (transformers checks them against the codec's
    vocabulary): loading prints none of its seven warnings; a token id really out of range still warns."""
    import logging

    import stages.qwen2_5_omni  # noqa: F401 - what every Qwen2.5-Omni stage imports first
    from transformers import Qwen2_5OmniTalkerConfig

    logging.Logger.warning_once.cache_clear()  # transformers warns once per process and message
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.configuration_utils")
    logger.addHandler(handler)
    try:
        Qwen2_5OmniTalkerConfig()
        assert [r.getMessage() for r in records if "within the vocabulary" in r.getMessage()] == []
        Qwen2_5OmniTalkerConfig(pad_token_id=99999)
    finally:
        logger.removeHandler(handler)
    [bad] = [r.getMessage() for r in records if "within the vocabulary" in r.getMessage()]
    assert bad.startswith("Model config: pad_token_id must be")
