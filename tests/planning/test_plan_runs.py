"""The issue's three pipelines planned and run within the plan: each engine (each replica's) builds the
planned KV blocks, and its KV tensors and tensor cache hold the planned bytes."""
import pytest

from omni import Omni
from omni.config.loader import load_config
from omni.planning.plan import plan_memory
from omni.planning.profile import profile_pipeline

pytestmark = pytest.mark.slow


def _planned(path, budget_gb, conversations, context, **stage_changes):
    raw = load_config(path).model_dump()
    raw["runtime"]["memory"] = {"budget_gb": budget_gb}
    raw["runtime"]["plan"] = {"concurrent_conversations": conversations, "context_tokens": context}
    for s in raw["stages"]:
        s["cache"]["num_blocks"] = None
        s["cache"]["memory_budget_mb"] = None
        for key, value in stage_changes.get(s["name"], {}).items():
            s[key] = {**s[key], **value} if isinstance(value, dict) and isinstance(s.get(key), dict) else value
    return load_config(raw)


def _check_engines(o):
    plan = o.memory_plan
    assert plan is not None and plan.fits
    for name, workers in o._backend.replicas.items():
        p = plan.stages[name]
        assert len(workers) == len(p.devices)
        for w in workers:
            engine = w.engine
            if not p.needs.autoregressive:
                continue
            kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
            assert (engine.kv.num_blocks, kv) == (p.num_blocks, p.kv_bytes), name
            held = engine.rows.store.bytes_held
            assert held in (0, p.rows_bytes), name  # 0: a replica no request reached allocates no rows
    return plan


def test_small_omni_pipeline_runs_within_its_plan(store):
    cfg = _planned("stage_configs/qwen2_5_omni_small.yaml", 2.0, 4, 512,
                   talker={"sampling": {"temperature": 0.0, "max_tokens": 20, "stop_token_ids": [8292]}},
                   thinker={"scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 512, "max_model_len": 4096}})
    # The thinker emits its rotary positions per token besides its hidden states: the arithmetic plan
    # knows only the hidden states until a profile step has seen the rest (as `omni plan` does first).
    before = plan_memory(cfg, store=store).stages["thinker"].needs
    assert before.rows_source == "hidden states" and set(before.rows_per_token) == {"hidden_states"}
    assert not [r for r in profile_pipeline(cfg, store) if r.error]
    with Omni(cfg, backend="local") as o:
        assert set(o.memory_plan.stages["thinker"].needs.rows_per_token) == {"hidden_states", "mrope_positions"}
        outs = o.generate(["Hello"], {"thinker": {"max_tokens": 4}}, use_tqdm=False)
        assert outs[0].error is None
        plan = _check_engines(o)
    th, tk = plan.stages["thinker"], plan.stages["talker"]
    assert tk.tokens_per_conversation == th.tokens_per_conversation + 20
    assert th.conversations >= 4 and tk.conversations >= 4


def test_smollm2_chain_runs_within_its_plan(store, smollm2):
    cfg = _planned("stage_configs/smollm2_chain.yaml", 2.5, 4, 512)
    with Omni(cfg, backend="local") as o:
        outs = o.generate(["What is the capital of France?"], {"thinker": {"max_tokens": 4}, "talker": {"max_tokens": 2}},
                          use_tqdm=False)
        assert outs[0].error is None
        _check_engines(o)


def test_replicated_config_runs_within_its_plan(store):
    cfg = _planned("stage_configs/tiny_chain.yaml", 0.6, 8, 64,
                   talker={"replicas": 2, "routing": "round_robin"})
    with Omni(cfg, backend="local") as o:
        outs = o.generate(["Hello", "Bonjour", "Hallo"], {"thinker": {"max_tokens": 4}}, use_tqdm=False)
        assert all(out.error is None for out in outs)
        plan = _check_engines(o)
        assert all(w.engine.rows.store.bytes_held == plan.stages["talker"].rows_bytes
                   for w in o._backend.replicas["talker"])  # round robin: both replicas served
    assert plan.devices["cpu"].copies["talker"] == 2
