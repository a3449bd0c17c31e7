"""The plan against the engines: refused before anything is built, and equal to what the engines allocate."""
import time

import pytest

from omni import Omni, SamplingParams
from omni.config.loader import load_config
from omni.errors import MemoryPlanError
from omni.planning.profile import CudaPeakMeter, HostPeakMeter, profile_pipeline, profile_stage


def _auto(path, budget_gb, **extra):
    cfg = load_config(path).model_dump()
    cfg["runtime"]["memory"] = {"budget_gb": budget_gb}
    cfg["runtime"].update(extra)
    for s in cfg["stages"]:
        s["cache"]["num_blocks"] = None
        s["cache"]["memory_budget_mb"] = None
    return load_config(cfg)


def test_a_refused_plan_fails_fast_with_nothing_allocated(store):
    built = []

    def factory(stage):
        built.append(stage.name)
        raise AssertionError("no engine may be built for a plan that does not fit")

    t0 = time.perf_counter()
    with pytest.raises(MemoryPlanError) as ei:
        Omni(_auto("stage_configs/tiny_chain.yaml", 0.05), backend="local", engine_factory=factory)
    assert time.perf_counter() - t0 < 30  # orders of magnitude above the ~10 ms it takes (torch import aside)
    assert built == []
    e = ei.value
    assert e.device == "cpu" and e.stage == "thinker" and e.limit == int(0.05 * 2**30) and e.actual > e.limit


def _allocated(engine):
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    return engine.kv.num_blocks, kv, engine.rows.store.bytes_held


def test_planned_numbers_equal_the_engines_allocations(store):
    cfg = _auto("stage_configs/tiny_chain.yaml", 0.45, plan={"concurrent_conversations": 4, "context_tokens": 64})
    with Omni(cfg, backend="local") as o:
        plan = o.memory_plan
        assert plan is not None and plan.fits
        o.generate(["Hello there, planner"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        for name, worker in o._backend.workers.items():
            p = plan.stages[name]
            blocks, kv, rows = _allocated(worker.engine)
            assert (blocks, kv, rows) == (p.num_blocks, p.kv_bytes, p.rows_bytes), name
            assert o.config.stage(name).cache.num_blocks == p.num_blocks
        assert plan.devices["cpu"].used >= 0.9 * plan.devices["cpu"].budget.budget


@pytest.mark.slow
def test_the_omni_thinkers_discovered_outputs_price_its_tensor_cache(store, tiny_omni):
    cfg = _auto("stage_configs/qwen2_5_omni_tiny.yaml", 0.6)
    record = profile_stage(cfg, "thinker")
    assert set(record.rows_per_token) == {"hidden_states", "mrope_positions"}  # found by the profile step
    assert record.rows_per_token["mrope_positions"] == 3 * 4 and record.activations > 0
    profile_pipeline(cfg, store)
    with Omni(cfg, backend="local") as o:
        plan = o.memory_plan
        assert plan.stages["thinker"].needs.activations_source == "measured by omni plan"
        o.generate(["Hello"], {"thinker": {"max_tokens": 4}, "talker": {"max_tokens": 4}}, use_tqdm=False)
        for name in ("thinker", "talker"):
            blocks, kv, rows = _allocated(o._backend.workers[name].engine)
            p = plan.stages[name]
            assert (blocks, kv, rows) == (p.num_blocks, p.kv_bytes, p.rows_bytes), name


def test_host_meter_sees_an_allocation_torch_makes():
    import torch

    if not HostPeakMeter.available():
        pytest.skip("needs Linux /proc")
    meter = HostPeakMeter()
    meter.start()
    t = torch.ones(16 * 2**20)  # 64 MiB, touched
    del t
    # the resident set moves by whole pages of everything in the process (a few may leave meanwhile)
    assert 60 * 2**20 <= meter.peak() < 96 * 2**20


class _FakeCuda:
    def __init__(self):
        self.allocated, self.peak, self.calls = 1000, 1000, []

    def synchronize(self, device):
        self.calls.append(("sync", device))

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak


def test_cuda_meter_reads_torch_cuda_counts():
    cuda = _FakeCuda()
    cuda.peak = 5000  # a peak before start() is not this step's
    meter = CudaPeakMeter("cuda:0", cuda)
    meter.start()
    cuda.allocated += 300
    cuda.peak = cuda.allocated + 700  # the step's transient peak
    cuda.allocated -= 300
    assert meter.peak() == 1000 and ("sync", "cuda:0") in cuda.calls


@pytest.mark.slow
def test_profile_step_measures_a_cpu_stage(store, tiny_qwen2):
    cfg = load_config("stage_configs/tiny_chain.yaml")
    calls = []

    class Meter(HostPeakMeter):
        def start(self):
            calls.append("start")
            super().start()

    record = profile_stage(cfg, "thinker", meter=Meter())
    assert calls == ["start"] and record.meter == "peak RSS (VmHWM)"
    assert record.rows_per_token == {"hidden_states": 64 * 4}
    # 256 tokens through a 64-wide model: more than its logits for 16 rows, far less than a GiB
    assert 16 * 151936 * 4 <= record.activations < 2**30


def test_profile_step_on_a_gpu_counts_the_graph_pools_with_faked_device_queries(store, tiny_qwen2):
    """The CUDA path of the profile step, the device's counts faked: what building the engine allocated
    beyond the weights and the KV cache (buffers, graph pools) counts with the step's peak."""
    from omni.pipeline.engine_factory import build_engine
    from omni.planning.profile import _header_weights

    cfg = load_config("stage_configs/tiny_chain.yaml")
    cuda = _FakeCuda()
    pools = 3 * 2**20

    def build(stage):
        engine = build_engine(stage)  # on the CPU: the counts below are what a GPU would report
        kv = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
        cuda.allocated += _header_weights(stage, "cuda") + kv + pools
        step = engine.step

        def counted_step():
            cuda.peak = max(cuda.peak, cuda.allocated + 5 * 2**20)  # the step's transient 5 MiB
            return step()

        engine.step = counted_step
        return engine

    record = profile_stage(cfg, "thinker", meter=CudaPeakMeter("cuda:0", cuda), build=build)
    assert record.meter == "torch.cuda.max_memory_allocated"
    assert record.activations == 5 * 2**20 + pools


def test_an_unplanned_config_is_reported_with_the_blocks_its_engines_build(store):
    from omni.planning.plan import plan_memory

    from tests.planning.conftest import fake_probe

    cfg = load_config("stage_configs/tiny_chain.yaml", {n: {"cache": {"num_blocks": None}} for n in ("thinker", "talker")})
    plan = plan_memory(cfg, probe=fake_probe(), store=store)  # no budget, no workload: nothing is 'auto'
    assert not any(p.auto for p in plan.stages.values())
    with Omni(cfg, backend="local") as o:
        assert o.memory_plan is None  # nothing declared: Omni plans nothing
        for name, worker in o._backend.workers.items():
            assert worker.engine.kv.num_blocks == plan.stages[name].num_blocks
