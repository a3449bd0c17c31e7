"""omni.engine.memory: cache sizes estimated before allocation, and refused when they cannot fit."""
from __future__ import annotations

import pytest

from omni.engine import engine as engine_module
from omni.engine import memory
from omni.engine.memory import AvailableMemory, StageGeometry, check_stage_memory, estimate
from omni.errors import ConfigError
from tests.engine_utils import generate, make_engine

GIB = 2**30


def probe(host: int | None, gpu: int | None = None):
    return lambda device: AvailableMemory(host, "test", gpu)


def test_estimate_equals_what_the_engine_allocates(tiny_qwen2):
    eng = make_engine(tiny_qwen2, num_blocks=32, block_size=4)
    generate(eng, [[5, 6, 7, 8, 9]], max_tokens=2)  # the tensor cache is allocated on first sight
    spec = eng.model.kv_spec()
    geo = StageGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, eng.model.hidden_size)
    est = estimate(32, 4, geo, 4, prefix_caching=True, tensor_cache=True)
    assert est.kv_bytes == sum(k.nbytes + v.nbytes for k, v in eng.runner.kv_caches)
    assert est.tensor_cache_bytes == eng.tensor_cache.bytes_held
    assert est.block_pool_bytes == 32 * (memory.POOL_BYTES_PER_BLOCK + memory.HASH_BYTES_PER_BLOCK)


def test_checkpoint_geometry_is_read_without_loading(tiny_qwen2, tiny_llama):
    from stages.causal_lm import CausalLMStage

    for path in (tiny_qwen2, tiny_llama):
        eng = make_engine(path, num_blocks=8)
        spec = eng.model.kv_spec()
        assert CausalLMStage.checkpoint_geometry(path) == StageGeometry(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, eng.model.hidden_size)
    assert CausalLMStage.checkpoint_geometry(tiny_qwen2.parent / "nowhere") is None


def test_host_limit_names_the_field_and_what_fits():
    geo = StageGeometry(num_layers=3, num_kv_heads=2, head_dim=16, hidden_size=64)
    kw = dict(block_size=4, geometry=geo, dtype_bytes=4, device="cpu", prefix_caching=True, tensor_cache=True,
              probe=probe(1 * GIB))
    with pytest.raises(ConfigError) as ei:
        check_stage_memory("thinker", "cache.num_blocks", 10**6, 10**6, **kw)
    msg = str(ei.value)
    assert msg.startswith("stage 'thinker': cache.num_blocks: 1,000,000 blocks of 4 tokens: they need ")
    assert "of host memory but only 1.00 GiB is free" in msg and "KV cache" in msg and "block pool" in msg
    fits = int(msg.split("at most ")[1].split(" blocks")[0].replace(",", ""))
    check_stage_memory("thinker", "cache.num_blocks", fits, fits, **kw)  # the advice is right...
    with pytest.raises(ConfigError):
        check_stage_memory("thinker", "cache.num_blocks", fits + 1, fits + 1, **kw)  # ...and tight


def test_kv_on_a_gpu_counts_against_the_gpu_not_the_host():
    geo = StageGeometry(num_layers=28, num_kv_heads=4, head_dim=128, hidden_size=3584)  # a 7B thinker
    kw = dict(block_size=16, geometry=geo, dtype_bytes=2, prefix_caching=True, tensor_cache=False)
    n = 50_000  # 0.9 MiB of KV per block: 43.9 GiB
    check_stage_memory("t", "cache.num_blocks", n, n, device="cuda:0", probe=probe(8 * GIB, 79 * GIB), **kw)
    with pytest.raises(ConfigError, match=r"stage 't': cache.num_blocks: 50,000 blocks .* the KV cache needs "
                                          r"42.72 GiB but cuda:0 has 20.00 GiB free"):
        check_stage_memory("t", "cache.num_blocks", n, n, device="cuda:0", probe=probe(8 * GIB, 20 * GIB), **kw)
    with pytest.raises(ConfigError, match="of host memory"):  # the same KV on a CPU stage
        check_stage_memory("t", "cache.num_blocks", n, n, device="cpu", probe=probe(8 * GIB), **kw)


def test_unknown_host_memory_skips_the_check():
    geo = StageGeometry(1, 1, 1, 1)
    check_stage_memory("t", "cache.num_blocks", 10**12, 10**12, 4, geo, 4, "cpu", prefix_caching=False,
                       tensor_cache=False, probe=probe(None))


def test_the_machine_is_asked():
    host, source = memory.host_available()
    assert host is not None and host > 0 and source
    assert memory.available_memory("cpu").gpu_bytes is None


def test_a_billion_blocks_fail_fast_before_loading(tiny_qwen2, monkeypatch):
    from stages.causal_lm import CausalLMStage

    def never(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(CausalLMStage, "load", never)
    # Fast by construction, not by the clock: neither the model nor the block pool may be built.
    monkeypatch.setattr(engine_module, "KVCacheManager", never)
    with pytest.raises(ConfigError, match=r"stage 'big': cache.num_blocks: 1,000,000,000 blocks of 4 tokens: "
                                          r"they need .* of host memory"):
        make_engine(tiny_qwen2, num_blocks=10**9, name="big", device="cpu")  # host memory, also on a GPU machine


def test_checkpoint_geometry_counts_before_loading(tiny_qwen2, monkeypatch):
    """A block pool that fits but a KV cache that does not is refused before loading too."""
    from stages.causal_lm import CausalLMStage

    monkeypatch.setattr(CausalLMStage, "load", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setattr(memory, "available_memory", probe(1 * GIB))
    with pytest.raises(ConfigError, match=r"KV cache 2.86 GiB, tensor cache 0.95 GiB"):
        make_engine(tiny_qwen2, num_blocks=10**6)
    with pytest.raises(ConfigError, match=r"stage 'test': cache.memory_budget_mb: 3000.0 gives 1,024,000 blocks"):
        make_engine(tiny_qwen2, num_blocks=None, memory_budget_mb=3000.0)


def test_a_given_model_is_checked_before_its_caches_exist(tiny_qwen2, monkeypatch):
    model = make_engine(tiny_qwen2, num_blocks=8).model
    monkeypatch.setattr(memory, "available_memory", probe(64 * 2**20))
    with pytest.raises(ConfigError, match=r"stage 'test': cache.num_blocks: 100,000 blocks"):
        make_engine(None, model=model, num_blocks=100_000)
    make_engine(None, model=model, num_blocks=1000)  # 4.3 MiB: fits
