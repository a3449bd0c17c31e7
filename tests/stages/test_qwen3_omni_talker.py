"""The Qwen3-Omni talker inside the engine: preemption by recompute replays the same frames, seeded sampling
is reproducible, and its prefix cache hits only on identical thinker rows."""
from __future__ import annotations

import dataclasses

import numpy as np

from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from stages.qwen3_omni.edges import thinker2talker
from tests.engine_utils import make_engine, run_to_completion
from tests.stages.qwen3_omni_utils import PROMPTS, TALKER_SAMPLING, frames_of, make_chain, run_chain, stages


def _talker_inputs():
    inputs = [StageInput(name, prompt=p) for name, p in PROMPTS.items()]
    results = run_chain(make_chain("tiny"), inputs)
    return {inp.request_id: (thinker2talker({"thinker": results[inp.request_id][0]}, inp), results[inp.request_id][1])
            for inp in inputs}


def _run_talker(inputs, **kw):
    _, talker, _ = stages("tiny")
    engine = make_engine(None, model=talker, name="talker", **kw)
    for inp in inputs:
        engine.add_request(inp)
    return engine, run_to_completion(engine)


def test_preempted_requests_recompute_to_the_same_frames():
    """A KV cache too small for the batch: requests are preempted and recomputed from scratch (their generated
    positions included, the last one's frame predicted in the same forward); the frames are those of the run
    with room to spare, and every request's per-request state is released."""
    cases = _talker_inputs()
    sampling = SamplingParams(**TALKER_SAMPLING)
    engine, outs = _run_talker([inp for inp, _ in cases.values()], caching=False, num_blocks=24, block_size=4,
                               max_num_seqs=3, default_sampling=sampling)
    assert engine.scheduler.num_preemptions > 0
    for rid, (inp, ref) in cases.items():
        assert outs[rid].token_ids == ref.token_ids, rid
        np.testing.assert_array_equal(frames_of(outs[rid], inp), frames_of(ref, inp), err_msg=rid)
    assert not stages("tiny")[1]._requests


def test_seeded_sampling_is_reproducible():
    inp, _ = _talker_inputs()["long"]
    runs = []
    for seed in (7, 7, 8):
        sampling = SamplingParams(temperature=0.9, top_k=50, max_tokens=20, repetition_penalty=1.05, seed=seed)
        _, outs = _run_talker([StageInput(inp.request_id, sampling_params=sampling, payload=inp.payload)], caching=False)
        runs.append(frames_of(outs[inp.request_id], inp))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[0].shape != runs[2].shape or not np.array_equal(runs[0], runs[2])


def test_prefix_cache_hits_only_on_identical_thinker_rows():
    inp, _ = _talker_inputs()["long"]
    sampling = SamplingParams(**TALKER_SAMPLING)
    embeds = np.array(inp.payload.embeds, copy=True)
    embeds[3] += 1e-3  # one thinker row in the first user tokens differs: no talker block may be shared
    changed = dataclasses.replace(inp.payload, embeds=embeds)
    _, talker, _ = stages("tiny")
    engine = make_engine(None, model=talker, name="talker", default_sampling=sampling)
    outs = {}
    for rid, payload in (("a", inp.payload), ("same", inp.payload), ("changed", changed)):
        engine.add_request(StageInput(rid, payload=payload))
        outs.update(run_to_completion(engine))
    assert outs["same"].num_cached_tokens > 0
    assert outs["changed"].num_cached_tokens == 0
    assert outs["same"].token_ids == outs["a"].token_ids


def test_sampling_talker_samples_residual_codes_too():
    """transformers mirrors the talker's do_sample onto the code predictor: a sampling request draws its residual
    codes (seeded: reproducibly), a greedy one takes the argmax. Forcing the first codebook to the greedy run's
    (top_k=1) isolates the residual codes: they differ from the greedy ones only because they are sampled."""
    inp, _ = _talker_inputs()["long"]

    def frames(**params):
        sampling = SamplingParams(max_tokens=12, repetition_penalty=1.05, **params)
        _, outs = _run_talker([StageInput(inp.request_id, sampling_params=sampling, payload=inp.payload)], caching=False)
        return frames_of(outs[inp.request_id], inp)

    greedy = frames(temperature=0.0)
    a, b = frames(temperature=1.0, top_k=1, seed=3), frames(temperature=1.0, top_k=1, seed=3)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[0, 0], greedy[0, 0])  # the same first frame's c0 (top_k=1)...
    assert not np.array_equal(a[0, 1:], greedy[0, 1:])  # ...but its residual codes were sampled


def test_each_stage_loads_its_part_exactly_as_the_full_model():
    """A stage loads its part of the checkpoint alone; its weights equal the full model's (the talker's experts
    are stored one by one and must be fused on load, as transformers does for the full model)."""
    import torch

    from tests.stages.qwen3_omni_utils import hf_model

    thinker, talker, code2wav = stages("tiny")
    full = hf_model("tiny")
    pairs = ((thinker.thinker, full.thinker), (talker.talker, full.talker), (code2wav.code2wav, full.code2wav))
    for ours, ref in pairs:
        theirs = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            assert torch.equal(p, theirs[name]), name


def test_batched_code_predictor_equals_transformers_generate_per_frame():
    """The code predictor's own pass (stages/qwen3_omni/code_predictor.py: transformers' modules without its
    generic forward) over a batch of frames gives each frame the codes transformers' `generate` gives it alone,
    bitwise, frame after frame with the same preallocated K/V (4 code groups: a two-position first pass, then
    single positions)."""
    import torch

    _, talker, _ = stages("tiny")
    cp = talker.code_predictor
    groups = cp.num_groups - 1
    rng = torch.Generator().manual_seed(0)
    for batch in (1, 3, 2, 3):  # a batch size seen before reuses its K/V, overwritten
        past = torch.randn(batch, talker.hidden_size, generator=rng)
        c0 = torch.randn(batch, talker.hidden_size, generator=rng)
        ours = cp.predict(past, c0)
        for i in range(batch):
            x = torch.stack([past[i:i + 1], c0[i:i + 1]], dim=1)
            ref = cp.cp.generate(inputs_embeds=x, max_new_tokens=groups, min_new_tokens=groups, do_sample=False)
            assert ours[i].tolist() == ref[0, -groups:].tolist(), (batch, i)
