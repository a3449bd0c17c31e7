"""omni.registry: names -> import strings; validating a config imports no torch and no model code."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from omni import registry
from omni.engine.stage_model import AutoregressiveStageModel, OneShotStageModel

REPO = Path(__file__).resolve().parents[1]


def _fresh_python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_loading_and_validating_a_config_imports_no_torch():
    out = _fresh_python(
        "import sys, omni.config.loader\n"
        "cfg = omni.config.loader.load_config('stage_configs/tiny_chain.yaml')\n"
        "from omni.pipeline.graph import StageGraph\n"
        "g = StageGraph(cfg.stages)\n"
        "print([s.name for s in cfg.stages], [g.emits_hidden_states(n) for n in g.order],\n"
        "      'torch' in sys.modules, sorted(m for m in sys.modules if m.startswith('stages')))\n")
    assert out == "['thinker', 'talker'] [True, False] False ['stages']"


def test_omni_validate_imports_no_torch():
    out = _fresh_python(
        "import sys\n"
        "from omni import cli\n"
        "rc = cli.main(['validate', 'stage_configs/qwen2_5_omni_tiny.yaml'])\n"
        "print('rc', rc, 'torch' in sys.modules)\n")
    assert out.endswith("OK\nrc 0 False")


@pytest.mark.parametrize("name", ["causal_lm", "qwen2_5_omni_thinker", "qwen2_5_omni_talker",
                                  "qwen2_5_omni_token2wav", "qwen3_omni_thinker", "qwen3_omni_talker",
                                  "qwen3_omni_code2wav", "higgs_audio_v2", "higgs_audio_v2_codec", "qwen3_asr"])
def test_registered_stage_models_resolve_and_their_facts_hold(name):
    entry = registry.stage_model_entry(name)
    cls = registry.resolve_stage_model(name)
    base = AutoregressiveStageModel if entry.info.autoregressive else OneShotStageModel
    assert issubclass(cls, base)
    assert cls.info == entry.info  # one declaration: the class's object is the registration's


@pytest.mark.parametrize("name,media", [("causal_lm", None), ("qwen2_5_omni_thinker", ("image", "audio")),
                                        ("qwen3_omni_thinker", ("image", "audio")), ("qwen2_5_omni_talker", None),
                                        ("qwen3_asr", ("audio",))])
def test_the_media_a_model_takes_are_declared_with_its_facts(name, media):
    """StageInfo.media: what the thinkers' own prompts take (the server refuses other media at the edge); a request
    may hold them only for a model that renders its own prompt (input_media: () for one that does not, a plain
    decoder LM, whose admission refuses any media)."""
    from dataclasses import replace

    info = registry.stage_model_entry(name).info
    assert info.media == media and registry.resolve_stage_model(name).info.media == media
    assert replace(info, renders_own_prompt=True).input_media == media
    assert replace(info, renders_own_prompt=False).input_media == ()


@pytest.mark.parametrize("name,needs", [("passthrough_tokens", False), ("hidden_to_embeds", True),
                                        ("thinker2talker", True), ("talker2wav", False)])
def test_registered_input_processors_resolve(name, needs):
    assert callable(registry.resolve_input_processor(name))
    assert registry.input_processor_entry(name).needs_hidden_states is needs


def test_builtin_model_paths_resolve_through_their_scheme(tiny_llama):
    assert registry.resolve_model_path("builtin:tiny-llama") == tiny_llama
    with pytest.raises(ValueError, match="unknown builtin model 'nope'"):
        registry.resolve_model_path("builtin:nope")


def test_registering_checks_names_and_targets():
    with pytest.raises(ValueError, match="stage model name must be a non-empty str without ':'"):
        registry.register_stage_model("a:b", "pkg.mod:Cls")
    with pytest.raises(ValueError, match="target must be a 'package.module:attr' string"):
        registry.register_input_processor("mine", "not_a_target")


def test_snapshot_restore_carries_registrations_to_another_process():
    registry.register_input_processor("test_only_join", "os.path:join")
    snap = pickle.dumps(registry.snapshot())
    out = _fresh_python("import pickle\nfrom omni import registry\n"
                        f"registry.restore(pickle.loads({snap!r}))\n"
                        "print(registry.input_processor_entry('test_only_join').target)\n")
    assert out == "os.path:join"


def test_a_failing_plugin_is_named():
    r = subprocess.run([sys.executable, "-c", "from omni import registry; registry.stage_model_entry('causal_lm')"],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, registry.PLUGINS_ENV: "no_such_pkg:register"})
    assert r.returncode != 0
    assert "omni plugin 'no_such_pkg:register' (OMNI_PLUGINS) failed to load: ModuleNotFoundError" in r.stderr
