"""The arithmetic plan: weights from headers, the split of a device's budget, refusals, the workload."""
import pickle
import time

import pytest

from omni.config.loader import load_config
from omni.errors import ConfigError, MemoryPlanError
from omni.planning.budget import GiB
from omni.planning.plan import conversation_tokens, plan_memory
from omni.planning.report import as_dict, render
from omni.planning.weights import checkpoint_weights
from omni.pipeline.graph import StageGraph

from tests.planning.conftest import fake_probe


def _tiny(**runtime):
    cfg = load_config("stage_configs/tiny_chain.yaml").model_dump()
    cfg["runtime"].update(runtime)
    for s in cfg["stages"]:
        s["cache"]["num_blocks"] = None  # auto
    return load_config(cfg)


@pytest.mark.slow
def test_weights_from_headers_equal_the_loaded_parameters(tiny_qwen2):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32)
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    w = checkpoint_weights(tiny_qwen2, 4)
    assert w.source == "safetensors headers" and w.num_params == sum(p.numel() for p in model.parameters())
    assert w.bytes == loaded
    assert checkpoint_weights(tiny_qwen2, 2).bytes == loaded // 2  # floating weights cast to bfloat16


def test_a_shared_checkpoint_is_split_by_stage_prefix(tiny_omni):
    whole = checkpoint_weights(tiny_omni, 4).bytes
    parts = [checkpoint_weights(tiny_omni, 4, p).bytes for p in ("thinker.", "talker.", "token2wav.")]
    assert all(parts) and sum(parts) == whole


def test_auto_uses_at_least_90_percent_of_what_is_left(store):
    cfg = _tiny(memory={"budget_gb": 0.5})
    plan = plan_memory(cfg, probe=fake_probe(), store=store)
    assert plan.fits
    dev = plan.devices["cpu"]
    fixed = sum(p.needs.fixed for p in plan.stages.values())
    caches = sum(p.kv_bytes + p.rows_bytes + p.pool_bytes for p in plan.stages.values())
    assert all(p.auto for p in plan.stages.values())
    assert caches >= 0.9 * (dev.budget.budget - fixed) and dev.used <= dev.budget.budget
    # without a workload, both hold as many max_model_len sequences (equal geometry: equal blocks)
    assert plan.stages["thinker"].num_blocks == plan.stages["talker"].num_blocks


def test_a_plan_that_does_not_fit_is_refused_naming_stage_device_and_numbers(store):
    t0 = time.perf_counter()
    cfg = _tiny(memory={"budget_gb": 0.1})
    plan = plan_memory(cfg, probe=fake_probe(), store=store)
    assert not plan.fits and time.perf_counter() - t0 < 30
    e = plan.errors[0]
    assert isinstance(e, MemoryPlanError) and isinstance(e, ConfigError)
    assert e.device == "cpu" and e.stage in ("thinker", "talker") and e.field == "runtime.memory.budget_gb"
    assert e.limit == int(0.1 * GiB) and e.actual > e.limit
    assert f"stage {e.stage!r} does not fit on cpu" in str(e) and "weights" in str(e)
    assert pickle.loads(pickle.dumps(e)) == e and pickle.loads(pickle.dumps(e)).device == "cpu"
    with pytest.raises(MemoryPlanError):
        plan.raise_if_refused()
    assert "REFUSED" in render(plan)


def test_a_hand_set_block_count_is_honoured_and_checked(store):
    cfg = load_config("stage_configs/tiny_chain.yaml",
                      {"talker": {"cache": {"num_blocks": 3_000_000}}}).model_dump()
    cfg["runtime"]["memory"] = {"budget_gb": 1}
    cfg["stages"][0]["cache"]["num_blocks"] = None
    plan = plan_memory(load_config(cfg), probe=fake_probe(), store=store)
    e = plan.errors[0]
    assert e.stage == "talker" and e.field == "cache.num_blocks"
    assert plan.stages["talker"].num_blocks == 3_000_000 and not plan.stages["talker"].auto
    cfg["stages"][1]["cache"]["num_blocks"] = 300
    plan = plan_memory(load_config(cfg), probe=fake_probe(), store=store)
    assert plan.fits and plan.stages["talker"].num_blocks == 300 and plan.stages["thinker"].auto
    applied = plan.apply(load_config(cfg))
    assert applied.stage("talker").cache.num_blocks == 300
    assert applied.stage("thinker").cache.num_blocks == plan.stages["thinker"].num_blocks


def test_a_workload_sizes_each_stage_for_its_own_sequence(store):
    cfg = load_config("stage_configs/qwen2_5_omni_small.yaml").model_dump()
    for s in cfg["stages"]:
        s["cache"] = {"block_size": 16}
    cfg["runtime"]["plan"] = {"concurrent_conversations": 8, "context_tokens": 1024}
    cfg["runtime"]["memory"] = {"budget_gb": 4}
    cfg = load_config(cfg)
    graph = StageGraph.of(cfg)
    tokens = conversation_tokens(cfg, graph, 1024)
    assert (tokens["thinker"], tokens["talker"]) == (1024, 1024 + 250)  # the talker: + its 250 codes a turn
    plan = plan_memory(cfg, probe=fake_probe(), store=store)
    th, tk, wav = plan.stages["thinker"], plan.stages["talker"], plan.stages["token2wav"]
    assert plan.fits and th.conversations >= 8 and tk.conversations >= 8
    assert tk.wanted_blocks == 8 * -(-1274 // 16) and th.wanted_blocks == 8 * (1024 // 16)
    # the rest is split in proportion to what each wants: the talker gets more blocks than the thinker
    assert tk.num_blocks > th.num_blocks
    assert th.needs.weights and tk.needs.weights and wav.needs.weights and wav.num_blocks == 0
    # a budget short of the workload scales both alike, and says so
    fixed = sum(p.needs.fixed for p in plan.stages.values())
    wanted = sum(p.wanted_blocks * p.needs.device_per_block() for p in plan.stages.values())
    half = (fixed + wanted / 2) / GiB  # half of the workload's blocks
    cfg2 = load_config({**cfg.model_dump(), "runtime": {**cfg.model_dump()["runtime"], "memory": {"budget_gb": half}}})
    short = plan_memory(cfg2, probe=fake_probe(), store=store)
    assert short.fits and short.stages["talker"].verdict.startswith("holds ")
    assert short.stages["talker"].conversations < 8 and short.stages["thinker"].conversations < 8
    assert abs(short.stages["talker"].num_blocks / tk.wanted_blocks - 0.5) < 0.02  # scaled alike
    assert abs(short.stages["thinker"].num_blocks / th.wanted_blocks - 0.5) < 0.02


def test_smollm2_chain_planned(store, smollm2):
    cfg = load_config("stage_configs/smollm2_chain.yaml", {n: {"cache": {"memory_budget_mb": "auto"}}
                                                           for n in ("thinker", "talker")})
    plan = plan_memory(cfg, probe=fake_probe(host_gb=4), store=store)
    th = plan.stages["thinker"]
    assert plan.fits and th.auto and th.needs.weights > 500 * 2**20  # 135 M params in float32
    assert th.needs.kv_per_block == 2 * 30 * 16 * 3 * 64 * 4  # 30 layers, 3 KV heads of 64, fp32
    assert plan.devices["cpu"].budget.budget == int(4 * GiB * 0.9)
    assert as_dict(plan)["stages"]["thinker"]["kv_blocks"] == th.num_blocks


def test_replicas_count_once_per_copy(store):
    one = plan_memory(_tiny(memory={"budget_gb": 1}), probe=fake_probe(), store=store)
    cfg = _tiny(memory={"budget_gb": 1}).model_dump()
    cfg["stages"][1]["replicas"] = 2
    two = plan_memory(load_config(cfg), probe=fake_probe(), store=store)
    assert two.fits and two.devices["cpu"].copies == {"thinker": 1, "talker": 2}
    tk = two.stages["talker"]
    assert len(tk.devices) == 2
    used = two.stages["thinker"].on("cpu") + 2 * tk.on("cpu")
    assert two.devices["cpu"].used == used <= two.devices["cpu"].budget.budget
    assert tk.num_blocks < one.stages["talker"].num_blocks  # two copies share what one had
    # a replicated config whose copies do not fit is refused
    cfg["stages"][1]["replicas"] = 12
    assert not plan_memory(load_config(cfg), probe=fake_probe(), store=store).fits


def test_gpu_stages_share_one_gpu_budget_and_keep_their_tensor_cache_on_the_host(store):
    cfg = _tiny(memory={"gpu_memory_utilization": 0.5, "budget_gb": 2}).model_dump()
    for s in cfg["stages"]:
        s["device"] = "cuda"
        s["resources"]["num_gpus"] = 0.5
    cfg = load_config(cfg)
    plan = plan_memory(cfg, probe=fake_probe(gpus=((0.9, 1.0),)), store=store)
    assert set(plan.devices) == {"cpu", "cuda:0"} and plan.fits
    gpu = plan.devices["cuda:0"]
    assert gpu.budget.budget == int(0.5 * GiB) and "gpu_memory_utilization" in gpu.budget.source
    assert gpu.copies == {"thinker": 1, "talker": 1}
    th = plan.stages["thinker"]
    assert th.on("cuda:0") == th.needs.fixed + th.kv_bytes  # weights, activations, KV on the GPU
    assert th.on("cpu") == th.rows_bytes + th.pool_bytes  # tensor cache and block pool in host RAM
    assert gpu.used >= 0.9 * gpu.budget.budget
    # two GPUs and whole-GPU stages: one each
    two = load_config({**cfg.model_dump(), "stages": [{**s, "resources": {"num_gpus": 1}}
                                                       for s in cfg.model_dump()["stages"]]})
    plan2 = plan_memory(two, probe=fake_probe(gpus=((0.9, 1.0), (0.9, 1.0))), store=store)
    assert plan2.stages["thinker"].devices == ["cuda:0"] and plan2.stages["talker"].devices == ["cuda:1"]
    # no budget: 90% of what the GPU has free
    cfg3 = _tiny().model_dump()
    for s in cfg3["stages"]:
        s["device"] = "cuda"
        s["cache"]["memory_budget_mb"] = "auto"
    plan3 = plan_memory(load_config(cfg3), probe=fake_probe(gpus=((0.3, 1.0),)), store=store)
    assert plan3.devices["cuda:0"].budget.budget == int(0.3 * GiB * 0.9)


def test_measurements_in_the_store_replace_the_estimates(store):
    from omni.planning.profile_store import ProfileRecord

    cfg = _tiny(memory={"budget_gb": 1})
    before = plan_memory(cfg, probe=fake_probe(), store=store)
    th = before.stages["thinker"].needs
    assert th.activations_source == "estimated" and th.rows_per_token == {"hidden_states": 64 * 4}
    store.put(th.profile_key, ProfileRecord(activations=12345, rows_per_token={"hidden_states": 256, "x": 12}))
    after = plan_memory(cfg, probe=fake_probe(), store=store)
    th2 = after.stages["thinker"].needs
    assert th2.activations == 12345 and th2.activations_source == "measured by omni plan"
    assert th2.rows_per_block == 16 * 0 + th2.block_size * (256 + 12)


def test_a_cuda_stage_on_a_machine_without_one_is_refused_naming_the_field(store):
    """`device: cuda` where no GPU is visible: a ConfigError naming the stage and `device`, not a torch traceback
    from asking a GPU that is not there for its memory (the engine says the same if it gets that far)."""
    cfg = load_config("stage_configs/tiny_chain.yaml", {"talker": {"device": "cuda"}})
    with pytest.raises(ConfigError, match=r"stage 'talker': device: cuda, but no CUDA device is visible") as e:
        plan_memory(cfg, probe=fake_probe(gpus=()), store=store)
    assert e.value.stage == "talker" and e.value.field == "device"
    plan = plan_memory(cfg, probe=fake_probe(gpus=((80.0, 80.0),)), store=store)  # with one: placed on it
    assert plan.stages["talker"].devices == ["cuda:0"]


def test_the_engine_refuses_cuda_without_one():
    import torch

    from omni.engine.loading import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="stage talker: device: cuda, but torch sees no CUDA device"):
        resolve_device("talker", "cuda")
    assert resolve_device("talker", "auto") == torch.device("cpu")
