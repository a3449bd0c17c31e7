"""omni.config.schema: every validation error names the stage and the field."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from omni.config.schema import PipelineConfig
from omni.config.loader import load_config, parse_stage_overrides
from omni.sampling_params import SamplingParams
from omni.errors import ConfigError, OmniError
from tests.fakes import chain_config, diamond_config, stage

REPO = Path(__file__).resolve().parents[1]


def cfg_with(*stages, **top):
    return {"name": "t", "runtime": {"backend": "local"}, "stages": list(stages), **top}


def err(data, overrides=None) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(data, overrides)
    return str(ei.value)


def test_valid_chain_defaults():
    cfg = load_config(chain_config())
    assert isinstance(cfg, PipelineConfig)
    th, ta = cfg.stages
    assert th.cache.block_size == 16 and th.cache.num_blocks is None and th.cache.hash_seed == 0
    assert th.scheduler.max_num_seqs == 64 and th.scheduler.max_num_batched_tokens == 2048
    assert th.scheduler.enable_chunked_prefill is True
    assert th.resources.num_cpus == 1 and th.resources.num_gpus == 0 and th.resources.custom == {}
    assert th.max_restarts == 0 and th.dtype == "float32" and th.device == "auto"
    assert th.enable_prefix_caching is True and th.use_chat_template is False
    assert isinstance(th.sampling, SamplingParams) and th.sampling.max_tokens == 3
    assert ta.inputs == ["thinker"] and ta.input_processor is None
    assert cfg.runtime.request_timeout_s == 600 and cfg.runtime.stage_start_timeout_s == 300


def test_runtime_defaults():
    cfg = load_config({"stages": [stage("a", final_output="text")]})
    assert cfg.runtime.backend == "ray" and cfg.runtime.ray_address is None
    assert cfg.name == "pipeline"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, OmniError)


def test_duplicate_names():
    msg = err(cfg_with(stage("a", final_output="text"), stage("a", final_output="text")))
    assert "unique" in msg and "'a'" in msg


def test_unknown_key_in_stage_lists_allowed_keys():
    msg = err(cfg_with(stage("a", final_output="text", enable_prefix_cache=False)))
    assert msg.startswith("stage 'a': unknown key 'enable_prefix_cache'")
    assert "enable_prefix_caching" in msg  # the allowed keys are listed


def test_unknown_key_nested_and_top_level():
    msg = err(cfg_with(stage("a", final_output="text", cache={"blocksize": 4})))
    assert "stage 'a': cache: unknown key 'blocksize'" in msg and "block_size" in msg
    assert "unknown key 'stagez'" in err({"stagez": [], "stages": [stage("a", final_output="text")]})
    assert "runtime: unknown key 'timeout'" in err(cfg_with(stage("a", final_output="text"), runtime={"timeout": 1}))


def test_unknown_input():
    msg = err(cfg_with(stage("a", final_output="text"), stage("b", inputs=["nope"], final_output="text")))
    assert "stage 'b': inputs: unknown stage 'nope'" in msg


def test_self_input_and_duplicate_input():
    assert "stage 'a': inputs: a stage cannot be its own input" in err(
        cfg_with(stage("e", final_output="text"), stage("a", inputs=["a"], final_output="text")))
    assert "stage 'b': inputs: 'a' is listed twice" in err(
        cfg_with(stage("a"), stage("b", inputs=["a", "a"], final_output="text")))


def test_cycle_is_named():
    msg = err(cfg_with(stage("e"), stage("a", inputs=["e", "c"]), stage("b", inputs=["a"]),
                       stage("c", inputs=["b"], final_output="text")))
    assert "cycle: a -> b -> c -> a" in msg


def test_no_entry_stage_is_the_cycle_it_holds():
    msg = err(cfg_with(stage("a", inputs=["b"]), stage("b", inputs=["a"], final_output="text")))
    assert "cycle: a -> b -> a" in msg


def test_no_final_output():
    msg = err(cfg_with(stage("a"), stage("b", inputs=["a"])))
    assert "no final output" in msg and "final_output" in msg


def test_dangling_stage_without_final_output():
    msg = err(cfg_with(stage("a", final_output="text"), stage("b", inputs=["a"])))
    assert "stage 'b': final_output" in msg and "discarded" in msg


def test_no_stages():
    assert "at least one stage" in err({"stages": []})
    assert "stages: required field is missing" in err({"name": "x"})


def test_missing_model_path():
    msg = err(cfg_with({"name": "a", "model": "fake", "final_output": "text"}))
    assert "stage 'a': model_path: required field is missing" in msg


def test_unknown_model():
    msg = err(cfg_with(stage("a", model="nope", final_output="text")))
    assert "stage 'a': model: unknown stage model 'nope'" in msg and "causal_lm" in msg


def test_model_target_that_does_not_import():
    msg = err(cfg_with(stage("a", model="no_such_pkg.mod:Cls", final_output="text")))
    assert "stage 'a': model: 'no_such_pkg.mod:Cls'" in msg and "does not resolve" in msg
    assert "ModuleNotFoundError" in msg


def test_model_target_that_is_not_a_class():
    msg = err(cfg_with(stage("a", model="os.path:join", final_output="text")))
    assert "stage 'a': model" in msg and "not a class" in msg


def test_model_target_class_resolves():
    cfg = load_config(cfg_with(stage("a", model="tests.fakes:FakeStageModel",
                                     final_output="text")))
    assert cfg.stages[0].model.endswith(":FakeStageModel")


def test_unknown_input_processor():
    msg = err(cfg_with(stage("a"), stage("b", inputs=["a"], input_processor="nope", final_output="text")))
    assert "stage 'b': input_processor: unknown input processor 'nope'" in msg
    assert "passthrough_tokens" in msg


@pytest.mark.parametrize("target,why", [
    ("no_such_pkg:fn", "ModuleNotFoundError"),
    ("tests.fakes:missing_fn", "AttributeError"),
    ("tests.fakes:HIDDEN", "not callable"),
    ("not-a-target:", "not of the form"),
])
def test_input_processor_target_that_does_not_resolve(target, why):
    msg = err(cfg_with(stage("a"), stage("b", inputs=["a"], input_processor=target, final_output="text")))
    assert f"stage 'b': input_processor: {target!r}" in msg and why in msg


def test_input_processor_target_resolves():
    data = diamond_config()
    data["stages"][3]["input_processor"] = "tests.fakes:tagged_concat"
    assert load_config(data).stages[3].input_processor.endswith(":tagged_concat")


def test_input_processor_on_entry_stage():
    msg = err(cfg_with(stage("a", input_processor="passthrough_tokens", final_output="text")))
    assert "stage 'a': input_processor: only a stage with `inputs`" in msg


def test_final_output_hidden_needs_a_model_that_emits_hidden_states():
    msg = err(cfg_with(stage("a"), stage("w", model="fake_nar", inputs=["a"], final_output="hidden",
                                       enable_prefix_caching=False)))
    assert "stage 'w': final_output: model 'fake_nar' emits no hidden states" in msg


def test_prefix_caching_on_non_autoregressive_model():
    # Asked for explicitly, it is an error; by default a one-shot stage has it off (issue 11).
    msg = err(cfg_with(stage("a"), stage("w", model="fake_nar", inputs=["a"], final_output="audio",
                                         enable_prefix_caching=True)))
    assert "stage 'w': enable_prefix_caching" in msg and "does not apply" in msg
    ok = load_config(cfg_with(stage("a"), stage("w", model="fake_nar", inputs=["a"], final_output="audio",
                                                enable_prefix_caching=False)))
    assert ok.stages[1].enable_prefix_caching is False
    default = load_config(cfg_with(stage("a"), stage("w", model="fake_nar", inputs=["a"], final_output="audio")))
    assert [s.enable_prefix_caching for s in default.stages] == [True, False]


@pytest.mark.parametrize("field,expect", [
    ({"cache": {"block_size": 0}}, "stage 'a': cache.block_size: Input should be greater than or equal to 1 (got 0)"),
    ({"cache": {"block_size": 512}}, "stage 'a': cache.block_size: Input should be less than or equal to 256 (got 512)"),
    ({"cache": {"num_blocks": 1}}, "stage 'a': cache.num_blocks: Input should be greater than or equal to 2 (got 1)"),
    ({"cache": {"memory_budget_mb": 0}}, "stage 'a': cache.memory_budget_mb: Input should be greater than 0 (got 0)"),
    ({"cache": {"num_blocks": 8, "memory_budget_mb": 1}}, "stage 'a': cache: set num_blocks or memory_budget_mb, not both"),
    ({"scheduler": {"max_num_seqs": 0}}, "stage 'a': scheduler.max_num_seqs: Input should be greater than or equal to 1 (got 0)"),
    ({"scheduler": {"max_num_batched_tokens": -5}}, "scheduler.max_num_batched_tokens: Input should be greater than or equal to 1 (got -5)"),
    ({"scheduler": {"max_model_len": 0}}, "scheduler.max_model_len: Input should be greater than or equal to 1"),
    ({"scheduler": {"enable_chunked_prefill": False, "max_model_len": 4096, "max_num_batched_tokens": 2048}},
     "stage 'a': scheduler: max_num_batched_tokens (2048) must be >= max_model_len (4096) when enable_chunked_prefill is false"),
    ({"resources": {"num_cpus": -1}}, "stage 'a': resources.num_cpus: Input should be greater than or equal to 0 (got -1)"),
    ({"resources": {"num_gpus": -0.5}}, "resources.num_gpus: Input should be greater than or equal to 0"),
    ({"resources": {"custom": {"tpu": -1}}}, "stage 'a': resources.custom: custom resource amounts must be >= 0"),
    ({"max_restarts": -2}, "stage 'a': max_restarts: Input should be greater than or equal to -1 (got -2)"),
    ({"dtype": "fp8"}, "stage 'a': dtype: Input should be 'float32', 'float16' or 'bfloat16' (got 'fp8')"),
    ({"device": "tpu"}, "stage 'a': device: Input should be 'auto', 'cpu' or 'cuda'"),
    ({"final_output": "video"}, "stage 'a': final_output: Input should be 'text', 'tokens', 'audio' or 'hidden'"),
    ({"sampling": {"max_tokens": 0}}, "stage 'a': sampling.max_tokens: max_tokens must be an integer >= 1, got 0"),
    ({"sampling": {"top_p": 1.5}}, "stage 'a': sampling.top_p: top_p must be in (0, 1]"),
    ({"sampling": {"temprature": 1.0}}, "stage 'a': sampling: unknown key 'temprature'"),
    ({"enable_prefix_caching": "maybe"}, "stage 'a': enable_prefix_caching: expected true or false (got 'maybe')"),
    ({"inputs": "x"}, "stage 'a': inputs: Input should be a valid list"),
])
def test_invalid_numbers_and_values(field, expect):
    msg = err(cfg_with(stage("a", **{"final_output": "text", **field})))
    assert expect in msg, msg


# ------------------------------------------------------------------ unions
@pytest.mark.parametrize("field,expect", [
    ({"inputs": [5]}, "stage 'a': inputs[0]: expected a string or an object (got 5)"),
    ({"inputs": [None]}, "stage 'a': inputs[0]: expected a string or an object (got null)"),
    ({"cache": {"memory_budget_mb": "lots"}},
     'stage \'a\': cache.memory_budget_mb: expected a number or "auto" (got "lots")'),
    # shaped like one member (an object: an edge): that member's own error, its name not in the path
    ({"inputs": [{"stage": "e", "chunk_tokens": 0}]},
     "stage 'a': inputs[0].chunk_tokens: Input should be greater than or equal to 1 (got 0)"),
    ({"inputs": [{"stag": "e"}]}, "stage 'a': inputs[0]: unknown key 'stag' (allowed: stage, stream, chunk_tokens)"),
])
def test_a_union_field_says_what_it_takes(field, expect):
    msg = err(cfg_with(stage("e"), stage("a", **{"final_output": "text", **field})))
    assert expect in msg, msg
    for member in ("InputEdge", ".str", ".float", "literal[", ".0"):  # pydantic's names for the union's members
        assert member not in msg, msg


def test_a_union_error_is_one_problem_next_to_the_others():
    msg = err(cfg_with(stage("e"), stage("a", final_output="text", inputs=[5], cache={"memory_budget_mb": "lots"},
                                         dtype="fp8")))
    assert msg.split("; ") == [
        "stage 'a': inputs[0]: expected a string or an object (got 5)",
        'stage \'a\': cache.memory_budget_mb: expected a number or "auto" (got "lots")',
        "stage 'a': dtype: Input should be 'float32', 'float16' or 'bfloat16' (got 'fp8')",
    ]


def test_mapping_keys_that_look_like_member_names_stay_in_the_path():
    # Two bad custom resources with CamelCase names are two fields, not a union's members.
    msg = err(cfg_with(stage("a", final_output="text", resources={"custom": {"TPU": "x", "HPU": "y"}})))
    assert "stage 'a': resources.custom.TPU: Input should be a valid number" in msg, msg
    assert "stage 'a': resources.custom.HPU: Input should be a valid number" in msg, msg


def test_union_errors_from_stage_overrides_json():
    msg = err(chain_config(), '{"talker": {"inputs": [7], "cache": {"memory_budget_mb": "lots"}}}')
    assert msg == ("stage 'talker': inputs[0]: expected a string or an object (got 7); "
                   'stage \'talker\': cache.memory_budget_mb: expected a number or "auto" (got "lots")'), msg


# ------------------------------------------------------------------ booleans
BOOL_FIELDS = [
    lambda v: cfg_with(stage("a", final_output="text", enable_prefix_caching=v)),
    lambda v: cfg_with(stage("a", final_output="text", use_chat_template=v)),
    lambda v: cfg_with(stage("a", final_output="text", scheduler={"enable_chunked_prefill": v})),
    lambda v: cfg_with(stage("e"), stage("a", final_output="text", inputs=[{"stage": "e", "stream": v}])),
    lambda v: cfg_with(stage("a", final_output="text"), runtime={"log_to_driver": v}),
    lambda v: cfg_with(stage("a", final_output="text"), runtime={"wait_for_nodes": v}),
    lambda v: cfg_with(stage("a", final_output="text", sampling={"ignore_eos": v})),
    lambda v: cfg_with(stage("a", final_output="text", sampling={"echo_prompt": v})),
    lambda v: cfg_with(stage("a", final_output="text", sampling={"max_tokens_fit": v})),
    lambda v: cfg_with(stage("a", final_output="text", sampling={"detokenize": v})),
]
BOOL_NAMES = ["stage 'a': enable_prefix_caching", "stage 'a': use_chat_template",
              "stage 'a': scheduler.enable_chunked_prefill", "stage 'a': inputs[0].stream", "runtime.log_to_driver",
              "runtime.wait_for_nodes", "stage 'a': sampling.ignore_eos", "stage 'a': sampling.echo_prompt",
              "stage 'a': sampling.max_tokens_fit", "stage 'a': sampling.detokenize"]


@pytest.mark.parametrize("value", [1, 0, "yes", "true", "false", "on", None])
@pytest.mark.parametrize("make,name", list(zip(BOOL_FIELDS, BOOL_NAMES)), ids=BOOL_NAMES)
def test_boolean_fields_take_only_true_or_false(make, name, value):
    msg = err(make(value))
    assert f"{name}: expected true or false (got {value!r})" in msg, msg


def test_every_boolean_field_of_the_config_is_strict():
    """A new `bool` field of omni/config/schema.py, or of the SamplingParams a stage's `sampling:` holds, must be a
    StrictFlag too (the table above covers each one)."""
    import omni.config.schema as config_module
    import omni.sampling_params as sampling_module
    from pydantic import BaseModel

    found = set()
    for module in (config_module, sampling_module):
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__:
                for name, info in cls.model_fields.items():
                    if info.annotation is bool:
                        assert any(getattr(m, "strict", False) for m in info.metadata), f"{cls.__name__}.{name}"
                        found.add(name)
    assert found == {"enable_prefix_caching", "use_chat_template", "enable_chunked_prefill", "stream", "log_to_driver",
                     "wait_for_nodes", "ignore_eos", "echo_prompt", "max_tokens_fit", "include_stop_str_in_output",
                     "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
                     "skip_reading_prefix_cache"}  # (vLLM's null for skip_reading_prefix_cache is false)


@pytest.mark.parametrize("value", ["false", 1])
def test_sampling_booleans_are_strict_in_stage_overrides_and_the_python_api(value):
    msg = err(chain_config(), json.dumps({"thinker": {"sampling": {"ignore_eos": value}}}))
    assert f"stage 'thinker': sampling.ignore_eos: expected true or false (got {value!r})" in msg, msg
    with pytest.raises(ValueError, match="expected true or false"):
        SamplingParams(echo_prompt=value)
    assert SamplingParams(ignore_eos=True, echo_prompt=False, max_tokens_fit=True).ignore_eos is True


def test_boolean_fields_take_true_and_false():
    for make, name in zip(BOOL_FIELDS, BOOL_NAMES):
        for value in (True, False):
            load_config(make(value))
    assert load_config(chain_config(), '{"thinker": {"enable_prefix_caching": false}}').stages[0] \
        .enable_prefix_caching is False


def test_invalid_stage_name():
    msg = err(cfg_with(stage("my stage", final_output="text")))
    assert "name: 'my stage' is not a valid stage name" in msg


@pytest.mark.parametrize("runtime,expect", [
    ({"backend": "k8s"}, "runtime.backend: Input should be 'ray' or 'local'"),
    ({"request_timeout_s": 0}, "runtime.request_timeout_s: Input should be greater than 0 (got 0)"),
    ({"stage_start_timeout_s": -1}, "runtime.stage_start_timeout_s: Input should be greater than 0"),
])
def test_invalid_runtime(runtime, expect):
    assert expect in err({"runtime": runtime, "stages": [stage("a", final_output="text")]})


def test_several_errors_are_all_reported():
    msg = err(cfg_with(stage("a", final_output="text", cache={"block_size": 0}, dtype="fp8")))
    assert "cache.block_size" in msg and "dtype" in msg


def test_env_expansion(monkeypatch):
    monkeypatch.setenv("OMNI_TEST_MODELS", "/models")
    monkeypatch.delenv("OMNI_TEST_UNSET", raising=False)
    cfg = load_config(cfg_with(stage("a", final_output="text", model_path="${OMNI_TEST_MODELS}/tiny",
                                     tokenizer="${OMNI_TEST_UNSET:-/tok}")))
    assert cfg.stages[0].model_path == "/models/tiny" and cfg.stages[0].tokenizer == "/tok"
    msg = err(cfg_with(stage("a", final_output="text", model_path="${OMNI_TEST_UNSET}/x")))
    assert "stage 'a': model_path: environment variable 'OMNI_TEST_UNSET' is not set" in msg


def test_builtin_model_path_is_not_resolved_at_validation():
    cfg = load_config(cfg_with(stage("a", final_output="text", model_path="builtin:tiny-llama")))
    assert cfg.stages[0].model_path == "builtin:tiny-llama"


def test_fan_out_and_fan_in_validate():
    cfg = load_config(diamond_config())
    assert [s.name for s in cfg.stages] == ["a", "b", "c", "d"]


# ------------------------------------------------------------------ overrides
def test_stage_overrides_deep_merge():
    base = chain_config()
    cfg = load_config(base, {"talker": {"enable_prefix_caching": False, "cache": {"block_size": 8}},
                             "thinker": {"sampling": {"temperature": 0.0}}})
    th, ta = cfg.stages
    assert ta.enable_prefix_caching is False and ta.cache.block_size == 8
    assert th.sampling.temperature == 0.0 and th.sampling.max_tokens == 3  # merged, not replaced
    assert base == chain_config()  # the input is not mutated


def test_stage_overrides_from_json_text():
    cfg = load_config(chain_config(), '{"talker": {"enable_prefix_caching": false}}')
    assert cfg.stages[1].enable_prefix_caching is False


def test_stage_overrides_errors():
    assert "stage_overrides: unknown stage 'talkr'" in err(chain_config(), {"talkr": {"dtype": "float16"}})
    assert "stage_overrides: not valid JSON" in err(chain_config(), "{talker:")
    assert "stage 'talker': block_size" not in err(chain_config(), {"talker": {"cache": {"block_size": 0}}})
    assert "stage 'talker': cache.block_size" in err(chain_config(), {"talker": {"cache": {"block_size": 0}}})
    assert "stage 'talker': unknown key 'enable_caching'" in err(chain_config(), {"talker": {"enable_caching": 0}})
    assert "must be a mapping of fields" in err(chain_config(), {"talker": 3})
    assert "must map stage names" in err(chain_config(), "[1, 2]")
    assert parse_stage_overrides(None) == {}


def test_overrides_on_a_pipeline_config_object():
    cfg = load_config(chain_config())
    cfg2 = load_config(cfg, {"thinker": {"max_restarts": 2}})
    assert cfg2.stages[0].max_restarts == 2 and cfg.stages[0].max_restarts == 0
    assert load_config(cfg) is cfg


# ----------------------------------------------------------------------- YAML
def test_yaml_file(tmp_path):
    p = tmp_path / "mini.yaml"
    p.write_text("runtime: {backend: local}\nstages:\n"
                 "  - {name: a, model: fake, model_path: x, final_output: text}\n")
    cfg = load_config(p)
    assert cfg.name == "mini" and cfg.runtime.backend == "local"
    assert load_config(str(p)).name == "mini"


def test_yaml_errors(tmp_path):
    assert "config file not found" in err(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n")
    assert "invalid YAML" in err(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    assert "top level must be a mapping" in err(lst)
    assert "expected a path, a mapping or a PipelineConfig" in err(42)


def test_yaml_uses_safe_load(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("name: !!python/object/apply:os.system ['echo hacked']\nstages: []\n")
    assert "invalid YAML" in err(p)


def test_shipped_stage_configs_validate():
    names = {}
    for path in sorted((REPO / "stage_configs").glob("*.yaml")):
        cfg = load_config(path)
        names[path.stem] = cfg
        assert cfg.runtime.backend == "ray"  # what users run; tests pass backend="local"
    assert {"tiny_chain", "smollm2_chain", "fan_out"} <= set(names)
    tiny = names["tiny_chain"]
    assert [s.model_path for s in tiny.stages] == ["builtin:tiny-qwen2"] * 2
    assert tiny.stages[1].input_processor == "hidden_to_embeds"
    assert [s.final_output for s in tiny.stages] == ["text", "tokens"]
    assert names["smollm2_chain"].stages[0].use_chat_template is True
    fan = names["fan_out"]
    assert [len(s.inputs) for s in fan.stages] == [0, 1, 1, 2]


def test_copy_of_config_dict_revalidates():
    data = copy.deepcopy(chain_config())
    data["stages"][1]["inputs"] = ["ghost"]
    assert "unknown stage 'ghost'" in err(data)


def test_replicas_and_routing():
    cfg = load_config(chain_config())
    th = cfg.stages[0]
    assert th.replicas == 1 and th.routing is None and th.routing_policy == "prefix_affinity"
    assert th.router.imbalance_threshold == 4 and th.router.on_replica_failure == "retry"
    data = chain_config()
    data["stages"][1].update(replicas=3, enable_prefix_caching=False, router={"on_replica_failure": "fail"})
    ta = load_config(data).stages[1]
    assert ta.replicas == 3 and ta.routing_policy == "least_loaded" and ta.router.on_replica_failure == "fail"
    from omni.pipeline.graph import StageGraph

    summary = StageGraph(load_config(data).stages).summary()  # what `omni validate` prints
    assert "replicas=3 (least_loaded)" in summary and summary.count("replicas=") == 1
    # The default follows the caching toggle, also when an override turns caching off later.
    over = load_config(cfg, {"thinker": {"enable_prefix_caching": False}})
    assert over.stages[0].routing_policy == "least_loaded"


@pytest.mark.parametrize("fields,msg", [
    ({"replicas": 0}, "stage 'thinker': replicas: Input should be greater than or equal to 1 (got 0)"),
    ({"routing": "random"}, "stage 'thinker': routing: Input should be 'prefix_affinity', 'least_loaded' or "
                            "'round_robin' (got 'random')"),
    ({"routing": "prefix_affinity", "enable_prefix_caching": False},
     "stage 'thinker': routing: prefix_affinity routes by what each replica's prefix cache holds"),
    ({"router": {"min_match_ratio": 1.5}}, "stage 'thinker': router.min_match_ratio: Input should be less than or "
                                           "equal to 1"),
    ({"router": {"on_replica_failure": "retry_twice"}}, "stage 'thinker': router.on_replica_failure"),
])
def test_bad_replica_settings_name_the_field(fields, msg):
    data = chain_config()
    data["stages"][0].update(fields)
    assert msg in err(data)


def test_merge_stage_overrides_puts_the_users_fields_over_a_benchmarks():
    from omni.config.loader import merge_stage_overrides

    base = {"thinker": {"sampling": {"temperature": 0.0, "max_tokens": 8}}, "talker": {"replicas": 1}}
    update = {"thinker": {"sampling": {"max_tokens": 16}}, "token2wav": {"replicas": 2}}
    merged = merge_stage_overrides(base, update)
    assert merged == {"thinker": {"sampling": {"temperature": 0.0, "max_tokens": 16}}, "talker": {"replicas": 1},
                      "token2wav": {"replicas": 2}}
    assert base["thinker"]["sampling"]["max_tokens"] == 8  # the inputs are left as they were
