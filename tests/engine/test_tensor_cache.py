"""Stage tensor cache: outputs with caching on equal outputs with caching off."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from omni.engine.runner.forward_context import get_forward_context
from omni.sampling_params import SamplingParams
from omni.engine.tensor_cache import StageTensorCache
from omni.messages import StageInput
from stages.causal_lm import CausalLMStage
from stages.checkpoints.tiny_lm import TINY_ARCHS
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion
from tests.tolerances import assert_rows_close, decoder_atol, reorder_atol


class FeatureStage(CausalLMStage):
    """A stage model with an extra per-token output and 1-D per-request metadata."""

    @classmethod
    def load(cls, model_path: Path, **kw):
        stage = super().load(model_path, **kw)
        g = torch.Generator().manual_seed(0)
        stage.proj = torch.randn(stage.hidden_size, 16, generator=g) / stage.hidden_size**0.5
        return stage

    def forward(self, input_ids, inputs_embeds, positions):
        out = super().forward(input_ids, inputs_embeds, positions)
        out["mm_feature"] = torch.tanh(out["hidden_states"] @ self.proj)  # [T, 16]: cached
        out["seq_len_meta"] = get_forward_context().attn_metadata.seq_lens.clone()  # [num_seqs]: passthrough
        return out


@pytest.fixture(scope="module")
def feature_model(tiny_llama):
    return FeatureStage.load(tiny_llama, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def prefix():
    rng = random.Random(5)
    return [rng.randrange(3, 1000) for _ in range(32)]  # exactly 8 blocks of 4


def _tail(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _params(max_tokens=6):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _run(model, batches, caching, **kw):
    """batches: list of lists of (rid, prompt) submitted together, run to completion in order."""
    engine = make_engine(None, model=model, caching=caching, **kw)
    outs = {}
    for batch in batches:
        for rid, prompt in batch:
            engine.add_request(StageInput(rid, prompt_token_ids=prompt, sampling_params=_params()))
        outs.update(run_to_completion(engine))
    assert_no_leak(engine)
    return engine, outs


def _assert_same(on, off, proj):
    assert on.keys() and on.keys() == off.keys()
    # |proj| summed over its 64 inputs, per output column: how much an error in h can grow in h @ proj.
    gain = float(proj.abs().sum(0).max())
    for rid in on:
        a, b = on[rid], off[rid]
        assert a.token_ids == b.token_ids, rid
        n = len(a.prompt_token_ids) + len(a.token_ids) - 1
        assert a.hidden_states.shape == b.hidden_states.shape == (n, 64), rid
        # Cached rows were computed in other steps (other row counts) than recomputed ones, so their
        # sums are blocked differently: the bound for the 4-layer tiny llama, longest sum 128 terms.
        atol_h = decoder_atol(b.hidden_states, layers=TINY_ARCHS["llama"], widest_sum=128)
        assert_rows_close(a.hidden_states, b.hidden_states, atol_h, f"{rid}: hidden states")
        assert a.mm_outputs.keys() == b.mm_outputs.keys() == {"mm_feature"}
        assert a.mm_outputs["mm_feature"].shape == (n, 16)
        # tanh(h @ proj): tanh is 1-Lipschitz; h's error grows by at most `gain`, plus the 64-term
        # sum's own reordering at the scale max|h| * gain.
        atol_mm = atol_h * gain + reorder_atol(64, float(np.abs(b.hidden_states).max()) * gain)
        assert_rows_close(a.mm_outputs["mm_feature"], b.mm_outputs["mm_feature"], atol_mm, f"{rid}: mm_feature")
        # The 1-D per-request tensor passes through, never cached/concatenated:
        # its last value is the sequence length of the request's last forward.
        assert int(a.passthrough["seq_len_meta"]) == n == int(b.passthrough["seq_len_meta"])


SCENARIOS = {
    # a k-block hit (prefix of 8 blocks + 5 new tokens)
    "k_block_hit": dict(batches=lambda p: [[("a", p + _tail(5, 1))], [("b", p + _tail(7, 2))]]),
    # prompt an exact multiple of the block size: the last token is never a hit
    "exact_multiple": dict(batches=lambda p: [[("a", p)], [("b", p)]]),
    # chunked prefill with a budget smaller than the prompt
    "chunked_prefill": dict(batches=lambda p: [[("a", p + _tail(9, 3))], [("b", p + _tail(3, 4))]],
                            kw=dict(max_num_batched_tokens=5)),
    # preemption and recompute
    "preemption": dict(batches=lambda p: [[(f"r{i}", p + _tail(6 + i, 10 + i)) for i in range(4)]],
                       kw=dict(num_blocks=20)),
    # two requests with the same prefix in the same step
    "same_step": dict(batches=lambda p: [[("a", p + _tail(2, 5)), ("b", p + _tail(6, 6))]]),
    # eviction and reallocation: a small pool, unrelated requests in between
    "eviction": dict(batches=lambda p: [[("a", p + _tail(3, 7))],
                                        [(f"x{i}", _tail(30, 20 + i)) for i in range(2)],
                                        [("b", p + _tail(4, 8))]],
                     kw=dict(num_blocks=22)),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_outputs_equal_with_and_without_cache(feature_model, prefix, name):
    sc = SCENARIOS[name]
    batches = sc["batches"](prefix)
    kw = sc.get("kw", {})
    on_engine, on = _run(feature_model, batches, True, **kw)
    _, off = _run(feature_model, batches, False, **kw)
    _assert_same(on, off, feature_model.proj)
    stats = on_engine.stats().as_dict()
    if name in ("k_block_hit", "exact_multiple", "same_step"):
        assert on["b"].num_cached_tokens == (28 if name == "exact_multiple" else 32)
        assert stats["tensor_cache_rows_served"] >= on["b"].num_cached_tokens
    if name == "preemption":
        assert on_engine.scheduler.num_preemptions > 0
    assert stats["tensor_cache_bytes"] == on_engine.kv.num_blocks * 4 * (64 + 16) * 4


def test_reallocated_block_rows_are_overwritten(feature_model):
    """A block evicted and reused by another request serves the new rows, never stale ones."""
    engine = make_engine(None, model=feature_model, caching=True, num_blocks=6)
    a = _tail(12, 30)
    engine.add_request(StageInput("a", prompt_token_ids=a, sampling_params=_params(3)))
    run_to_completion(engine)
    c = _tail(16, 31)  # needs 5 of the 6 blocks: reallocates (evicts) a's cached blocks
    engine.add_request(StageInput("c", prompt_token_ids=c, sampling_params=_params(3)))
    out_c = run_to_completion(engine)["c"]
    engine.add_request(StageInput("c2", prompt_token_ids=c + [9], sampling_params=_params(3)))
    out_c2 = run_to_completion(engine)["c2"]
    assert out_c2.num_cached_tokens == 16
    # c2's first 16 rows are served from the cache c wrote: a copy, so bitwise equal (a stale row
    # from a's evicted blocks would differ by its whole magnitude).
    np.testing.assert_array_equal(out_c2.hidden_states[:16], out_c.hidden_states[:16])
    assert_no_leak(engine)


def test_decode_rows_come_from_the_cache(feature_model, prefix):
    """Generated tokens' rows are cached too: a follow-up turn that includes them hits them."""
    engine = make_engine(None, model=feature_model, caching=True)
    engine.add_request(StageInput("t1", prompt_token_ids=prefix, sampling_params=_params(9)))
    t1 = run_to_completion(engine)["t1"]
    turn2 = prefix + t1.token_ids + _tail(3, 40)
    engine.add_request(StageInput("t2", prompt_token_ids=turn2, sampling_params=_params(2)))
    t2 = run_to_completion(engine)["t2"]
    assert t2.num_cached_tokens == 40  # 32 prompt + 8 computed generated tokens = 10 full blocks
    np.testing.assert_array_equal(t2.hidden_states[:40], t1.hidden_states[:40])  # copies of t1's rows
    off = make_engine(None, model=feature_model, caching=False)
    off.add_request(StageInput("t2", prompt_token_ids=turn2, sampling_params=_params(2)))
    ref = run_to_completion(off)["t2"].hidden_states
    # Recomputed in one prefill vs cached from t1's prefill and decode steps: reordered sums only.
    assert_rows_close(t2.hidden_states, ref, decoder_atol(ref, layers=TINY_ARCHS["llama"], widest_sum=128))


def test_tensor_cache_unit():
    tc = StageTensorCache(num_blocks=4, block_size=2)
    rows = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    meta = torch.tensor([1.0])  # not per-token: ignored
    tc.write(torch.tensor([2, 3, 6, 7, 0, 1]), {"h": rows, "meta": meta, "flat": torch.arange(6.0)})
    assert set(tc.caches) == {"h"}
    got = tc.read([1, 3, 0], 5)["h"]
    assert torch.equal(got, torch.cat([rows[:4], rows[4:5]]))  # a copy: bitwise
    assert tc.rows_served == 5 and tc.bytes_held == 4 * 2 * 3 * 4
    with pytest.raises(ValueError, match="changed shape"):
        tc.write(torch.tensor([0]), {"h": torch.zeros(1, 4)})


def test_caching_off_has_no_tensor_cache(tiny_llama):
    engine = make_engine(tiny_llama, caching=False)
    assert engine.tensor_cache is None and engine.kv.block_hasher is None
