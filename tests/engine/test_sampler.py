import math

import pytest
import torch
from pydantic import ValidationError
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from omni.engine.runner.sampler import (Sampler, apply_logit_bias, apply_min_p, apply_output_penalties,
                                 apply_repetition_penalty, apply_top_k_top_p, ban_tokens, make_generator)
from omni.sampling_params import SamplingParams

sampler = Sampler()


def _logits(n, v, seed=0, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    logits = _logits(8, 1000)
    params = [SamplingParams(temperature=0)] * 8
    out = sampler(logits, params, [None] * 8)
    assert out.dtype == torch.long and out.shape == (8,)
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_tie_breaks_like_torch_argmax():
    logits = torch.zeros(2, 10)
    logits[0, [3, 7]] = 5.0
    logits[1, [9, 2]] = 1.0
    out = sampler(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert out.tolist() == [3, 2] == logits.argmax(-1).tolist()


def test_tiny_temperature_is_greedy_and_top_k_p_ignored():
    logits = _logits(4, 300, seed=1)
    params = [SamplingParams(temperature=1e-7, top_k=5, top_p=0.5, seed=3)] * 4
    assert sampler(logits, params, [make_generator(p) for p in params]).tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_are_argmax():
    logits = _logits(6, 50, seed=2)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0) for i in range(6)]
    out = sampler(logits, params, [None] * 6)
    assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    assert ((out >= 0) & (out < 50)).all()


def test_input_logits_not_modified_and_half_precision_ok():
    logits = _logits(3, 40, seed=3).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(top_k=3), SamplingParams()]
    out = sampler(logits, params, [None] * 3, [[1, 2, 3], [4], []])
    assert torch.equal(logits, before)
    assert out.dtype == torch.long


# ------------------------------------------------------------------ repetition penalty


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    v = 500
    logits = _logits(4, v, seed=4)
    histories = [[1, 5, 5, 499, 0], [7], list(range(0, 400, 3)), [250, 251, 250]]
    ours = apply_repetition_penalty(logits, [penalty] * 4, histories)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for i, h in enumerate(histories):
        ref = proc(torch.tensor([h]), logits[i : i + 1].clone())
        assert torch.equal(ours[i], ref[0]), i
    # The sampler's greedy pick equals argmax of HF's processed scores.
    params = [SamplingParams(temperature=0, repetition_penalty=penalty)] * 4
    assert torch.equal(sampler(logits, params, [None] * 4, histories), ours.argmax(-1))


def test_repetition_penalty_per_row_values_and_off_rows_untouched():
    v = 64
    logits = _logits(3, v, seed=5)
    histories = [[1, 2, 3], [1, 2, 3], [10, 11, 12, 200]]  # 200 >= vocab: ignored, as in HF
    ours = apply_repetition_penalty(logits, [1.5, 1.0, 0.5], histories)
    assert torch.equal(ours[1], logits[1])
    for i, pen in ((0, 1.5), (2, 0.5)):
        # The reference gets the in-vocabulary ids only: HF ignores out-of-vocabulary
        # ids since transformers 5.2x, older releases index out of bounds.
        in_vocab = [t for t in histories[i] if t < v]
        ref = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([in_vocab]), logits[i : i + 1].clone())
        assert torch.equal(ours[i], ref[0])


def test_repetition_penalty_flips_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.5, -1.0]])
    assert sampler(logits, [SamplingParams(temperature=0)], [None]).item() == 1
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    assert sampler(logits, params, [None], [[1]]).item() == 2


def test_repetition_penalty_needs_histories():
    with pytest.raises(ValueError, match="token_histories"):
        sampler(_logits(1, 10), [SamplingParams(repetition_penalty=1.2)], [None])


# ------------------------------------------------------------- logit bias


def test_logit_bias_adds_to_the_named_tokens_of_its_row_only():
    logits = _logits(3, 50, seed=9)
    biases = [{3: 2.5, 49: -100.0, 70: 1.0}, None, {0: 0.5}]  # 70 >= vocab: ignored (the stage refuses it)
    ours = apply_logit_bias(logits, biases)
    ref = logits.clone()
    ref[0, 3] += 2.5
    ref[0, 49] += -100.0
    ref[2, 0] += 0.5
    assert torch.equal(ours, ref)
    top = int(logits[1].argmin())
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={top: 100.0})]
    assert sampler(logits[:2], params, [None, None]).tolist() == [int(logits[0].argmax()), top]


# ------------------------------------------------------------- presence / frequency penalties


def vllm_output_penalties(logits_row, output, presence, frequency):
    """OpenAI's definition (vLLM's): mu[j] - c[j] * frequency - (c[j] > 0) * presence, c[j] the count of
    token j in the output so far, one token at a time."""
    out = logits_row.clone()
    for j in set(output):
        if j < out.shape[0]:
            c = output.count(j)
            out[j] = out[j] - c * frequency - presence
    return out


def test_output_penalties_match_the_openai_definition():
    v = 300
    logits = _logits(4, v, seed=6)
    outputs = [[5, 5, 5, 9], [], [1, 2, 3, 299, 299, 400], [7]]  # 400 >= vocab: ignored
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=2.0),  # no output yet: nothing to penalise
              SamplingParams(frequency_penalty=-1.5, presence_penalty=-0.5),
              SamplingParams()]  # off: untouched
    ours = apply_output_penalties(logits, params, outputs)
    for i, (p, o) in enumerate(zip(params, outputs)):
        ref = vllm_output_penalties(logits[i], o, p.presence_penalty, p.frequency_penalty)
        # One subtraction per term in both: the same fp32 ops, so the same bits.
        assert torch.equal(ours[i], ref), i
    assert torch.equal(ours[3], logits[3]) and torch.equal(ours[1], logits[1])


def test_penalties_apply_to_the_output_only_and_after_the_repetition_penalty():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    # Token 1 is in the prompt only: no presence penalty for it (the repetition penalty sees it).
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    assert sampler(logits, [p], [None], outputs=[[]]).item() == 1
    assert sampler(logits, [p], [None], outputs=[[1]]).item() == 2  # 3.0 - 1.0 < 2.5
    # vLLM's order: the repetition penalty first (3.0 / 2 = 1.5), then the frequency penalty (1.5 - 2 * 0.5).
    p = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5)
    ours = apply_output_penalties(apply_repetition_penalty(logits, [2.0], [[1, 1]]), [p], [[1, 1]])
    assert ours[0, 1].item() == 0.5
    assert sampler(logits, [p], [None], [[1, 1]], outputs=[[1, 1]]).item() == 2
    with pytest.raises(ValueError, match="outputs"):
        sampler(logits, [p], [None], [[1, 1]])


# --------------------------------------------------------------------- min-p


@pytest.mark.parametrize("seed", range(3))
def test_min_p_matches_hf_after_temperature_top_k_top_p(seed):
    """transformers' warpers in its order (temperature, top-k, top-p, min-p) leave exactly the tokens ours
    leaves, with the same scores."""
    v = 200
    rows = [(0.7, 0, 1.0, 0.05), (1.3, 50, 1.0, 0.2), (1.0, 0, 0.9, 0.1), (0.5, 20, 0.8, 0.0), (1.0, 0, 1.0, 1.0)]
    logits = _logits(len(rows), v, seed=seed, scale=2.0)
    for i, (t, k, p, m) in enumerate(rows):
        scores = logits[i : i + 1] / t
        ours = apply_min_p(apply_top_k_top_p(scores, [k], [p]), [m])[0]
        ref = TemperatureLogitsWarper(t)(None, logits[i : i + 1].clone())
        ref = _hf_mask(ref, k, p)
        if m > 0:
            ref = MinPLogitsWarper(m)(None, ref)
        ref = ref[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (i, t, k, p, m)
        assert torch.allclose(ours[~torch.isinf(ref)], ref[~torch.isinf(ref)], rtol=0, atol=0), i
    assert int((~torch.isinf(apply_min_p(logits, [1.0] * len(rows)))).sum(-1).max()) == 1  # 1: the top only


def test_min_p_sampling_never_draws_a_dropped_token():
    base = torch.tensor([[2.0, 1.9, 0.0, -1.0]])  # probabilities ~0.45, 0.41, 0.06, 0.02
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=3)  # drops those below 0.2 * 0.45
    g = make_generator(p)
    drawn = {sampler(base, [p], [g]).item() for _ in range(500)}
    assert drawn == {0, 1}


# --------------------------------------------------------------------- top-k / top-p


def _hf_mask(scores, k, p):
    s = scores.clone()
    if k > 0:
        s = TopKLogitsWarper(k)(None, s)
    if p < 1.0:
        s = TopPLogitsWarper(p)(None, s)
    return s


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_match_hf(seed):
    v = 200
    ks = [0, 1, 5, 50, -1, 5, 20, 300, 0, 10]
    ps = [1.0, 1.0, 1.0, 1.0, 0.9, 0.5, 0.8, 0.3, 0.05, 1.0]
    scores = _logits(len(ks), v, seed=seed, scale=2.0)
    ours = apply_top_k_top_p(scores, ks, ps)
    for i, (k, p) in enumerate(zip(ks, ps)):
        ref = _hf_mask(scores[i : i + 1], min(k, v) if k > 0 else 0, p)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), (i, k, p)
        keep = ~torch.isinf(ref)
        assert torch.equal(ours[i][keep], scores[i][keep])


def test_top_k_keeps_ties_like_hf():
    scores = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    ours = apply_top_k_top_p(scores, [2], [1.0])
    ref = TopKLogitsWarper(2)(None, scores.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert (~torch.isinf(ours)).sum() == 3


def test_top_p_always_keeps_most_likely():
    scores = _logits(3, 100, seed=9)
    ours = apply_top_k_top_p(scores, [0, 0, 0], [1e-9, 1e-9, 1e-9])
    kept = ~torch.isinf(ours)
    assert kept.sum(-1).tolist() == [1, 1, 1]
    assert kept.float().argmax(-1).tolist() == scores.argmax(-1).tolist()


def test_top_k_1_samples_argmax():
    logits = _logits(5, 1000, seed=10)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(5)]
    out = sampler(logits, params, [make_generator(p) for p in params])
    assert torch.equal(out, logits.argmax(-1))


# ------------------------------------------------------------------ seeded sampling


def _run_steps(batches, steps=6, v=300):
    """batches: list of row specs (name, params); returns {name: tokens} over `steps` steps.

    Every request sees the same logits at a given step, whatever its position in the batch."""
    gens = {name: make_generator(p) for name, p in batches}
    toks = {name: [] for name, _ in batches}
    for step in range(steps):
        rows = [_logits(1, v, seed=1000 * step + sum(map(ord, name)), scale=1.0)[0] for name, _ in batches]
        out = sampler(torch.stack(rows), [p for _, p in batches], [gens[n] for n, _ in batches])
        for (name, _), t in zip(batches, out.tolist()):
            toks[name].append(t)
    return toks


def test_seeded_reproducible_regardless_of_batch():
    a = ("a", SamplingParams(temperature=1.0, seed=1234))
    b = ("b", SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=99))
    alone_a = _run_steps([a])["a"]
    alone_b = _run_steps([b])["b"]
    mixed = _run_steps([("x", SamplingParams()), b, ("g", SamplingParams(temperature=0)), a])
    reordered = _run_steps([a, ("y", SamplingParams(seed=5)), b])
    assert mixed["a"] == reordered["a"] == alone_a
    assert mixed["b"] == reordered["b"] == alone_b
    # the draws are actually random: a different seed gives a different stream
    other = _run_steps([("a", SamplingParams(temperature=1.0, seed=4321))])["a"]
    assert other != alone_a


def test_generator_stream_continues_across_steps():
    p = SamplingParams(temperature=1.0, seed=7)
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure noise
    g = make_generator(p)
    first = [sampler(logits, [p], [g]).item() for _ in range(5)]
    assert len(set(first)) > 1
    g2 = make_generator(p)
    assert [sampler(logits, [p], [g2]).item() for _ in range(5)] == first


def test_make_generator():
    assert make_generator(SamplingParams()) is None
    assert make_generator(SamplingParams(temperature=0, seed=3)) is None  # greedy needs no RNG
    g1, g2 = make_generator(SamplingParams(seed=3)), make_generator(SamplingParams(seed=3))
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


# ------------------------------------------------------------------ distribution


def assert_frequencies(freq, expected, n):
    """Each category's frequency over n draws within 5 binomial standard deviations,
    5 * sqrt(p (1 - p) / n), of its probability: a false alarm has probability < 6e-7 per category
    whatever the RNG stream (seeded here, but the draws' kernels may differ by machine), while a wrong
    temperature or top-k moves some probability by 0.05 or more (10+ sigma at these n)."""
    bound = 5 * torch.sqrt(expected * (1 - expected) / n)
    assert bool(((freq - expected).abs() <= bound).all()), (freq, expected, bound)


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(0)
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    temp = 0.7
    rows = 4000
    params = [SamplingParams(temperature=temp)] * rows
    counts = torch.zeros(5)
    for _ in range(10):
        out = sampler(base.expand(rows, 5), params, [None] * rows)
        counts += torch.bincount(out, minlength=5)
    freq = counts / counts.sum()
    expected = torch.softmax(base / temp, -1)
    assert_frequencies(freq, expected, int(counts.sum()))


def test_seeded_top_k_distribution():
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = SamplingParams(temperature=1.0, top_k=3, seed=11)
    g = make_generator(p)
    counts = torch.zeros(6)
    for _ in range(6000):
        counts[sampler(base, [p], [g]).item()] += 1
    freq = counts / counts.sum()
    expected = torch.zeros(6)
    expected[:3] = torch.softmax(base[0, :3], -1)
    assert counts[3:].sum() == 0
    assert_frequencies(freq, expected, int(counts.sum()))


# ------------------------------------------------------------------ validation


def test_defaults_and_descriptions():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens) == (1.0, 0, 1.0, None, 16)
    assert (p.stop_token_ids, p.ignore_eos, p.repetition_penalty) == ([], False, 1.0)
    for name, field in SamplingParams.model_fields.items():
        assert field.description, name
    SamplingParams(top_k=-1, top_p=1.0, temperature=0, seed=2**64 - 1, max_tokens=1, stop_token_ids=[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.1"),
        ({"temperature": math.nan}, r"temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, r"temperature must be a finite number >= 0"),
        ({"top_k": -2}, r"top_k must be 0 or -1 \(off\) or an integer >= 1, got -2"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": math.nan}, r"top_p must be in \(0, 1\]"),
        ({"seed": 2**64}, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, got 0"),
        ({"stop_token_ids": [3, -1]}, r"stop_token_ids must be token ids >= 0, got \[-1\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0 \(1 = off\), got 0.0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty must be a finite number > 0"),
        ({"max_tokens": 1.5}, r"max_tokens"),
        ({"top_k": "many"}, r"top_k"),
        ({"stop_token_ids": 5}, r"stop_token_ids"),
        ({"temprature": 0.5}, r"temprature\n  Extra inputs are not permitted"),
        ({"min_tokens": -1}, r"min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must be <= max_tokens \(4\)"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\] \(0 = off\), got 2.5"),
        ({"frequency_penalty": math.nan}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\] \(0 = off\), got -0.1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias maps token ids >= 0 to biases in \[-100, 100\], got \{5: 101.0\}"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias maps token ids >= 0"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValidationError, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)  # callers may catch plain ValueError
    assert list(kwargs)[0] in str(info.value)  # the message names the field


def test_assignment_is_validated():
    p = SamplingParams()
    with pytest.raises(ValidationError, match="top_p must be in"):
        p.top_p = 0


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        sampler(_logits(2, 10), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="2-D"):
        sampler(torch.zeros(10), [SamplingParams()], [None])
    assert sampler(torch.zeros(0, 10), [], []).shape == (0,)


def test_banned_tokens_are_never_sampled_and_other_rows_untouched():
    logits = _logits(3, 11, seed=4)
    top = logits.argmax(dim=-1).tolist()
    banned = [[top[0], 99], [], [top[2], (top[2] + 1) % 11]]  # 99: past the vocabulary, ignored
    params = [SamplingParams(temperature=0)] * 3
    out = sampler(logits, params, [None] * 3, banned=banned).tolist()
    assert out[0] != top[0] and out[1] == top[1] and out[2] not in banned[2]
    assert out[0] == ban_tokens(logits, banned)[0].argmax().item()
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for _ in range(20):  # random rows too
        drawn = sampler(logits, [SamplingParams(temperature=5.0, seed=1)] * 3, gens, banned=banned).tolist()
        assert drawn[0] != top[0] and drawn[2] not in banned[2]
    assert torch.isfinite(logits).all()  # the caller's logits are not modified
