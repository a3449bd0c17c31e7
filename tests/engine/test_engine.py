"""StageEngine end to end on real transformers models (fp32, CPU)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from omni.errors import StageError
from omni.sampling_params import SamplingParams
from omni.messages import StageInput
from stages.checkpoints.tiny_lm import TINY_ARCHS
from tests.engine_utils import assert_no_leak, generate, make_engine, run_to_completion
from tests.tolerances import assert_rows_close, decoder_atol


def _prompts(vocab: int, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(path, prompts, max_new_tokens, gguf_file=None):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, gguf_file=gguf_file).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
            outs.append(gen[0, len(p):].tolist())
    return model, outs


def _trim_at_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_generate(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    engine = make_engine(path)
    prompts = _prompts(engine.model.vocab_size, [5, 17, 33, 64, 2])
    max_new = 20
    ours = generate(engine, prompts, max_tokens=max_new)
    model, ref = _hf_greedy(path, prompts, max_new)
    eos = engine.model.eos_token_id
    for o, r in zip(ours, ref):
        assert o.token_ids == _trim_at_eos(r, eos)
    assert len({tuple(o.token_ids) for o in ours}) > 1, "degenerate model: all outputs equal"
    # Last hidden states of the prompt equal transformers' forward.
    with torch.inference_mode():
        for p, o in zip(prompts, ours):
            ref_h = model.get_decoder()(torch.tensor([p])).last_hidden_state[0]
            got = torch.from_numpy(o.hidden_states[: len(p)])
            # Our paged attention and batching vs transformers' dense forward: the same sums, ordered
            # differently; longest sum: the 128-wide intermediate (prompts <= 64 positions).
            atol = decoder_atol(ref_h.numpy(), layers=TINY_ARCHS[arch], widest_sum=128)
            assert_rows_close(got.numpy(), ref_h.numpy(), atol, f"prompt of {len(p)}: hidden states")
            # Rows for every computed token: prompt + generated, minus the last sampled one.
            assert o.hidden_states.shape[0] == len(p) + len(o.token_ids) - 1
    assert_no_leak(engine)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    engine = make_engine(smollm2, num_blocks=512, block_size=16, use_chat_template=True)
    tok = engine.tokenizer
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True) for t in texts]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    ours = generate(engine, prompts, max_tokens=16)
    _, ref = _hf_greedy(smollm2, prompts, 16)
    for o, r in zip(ours, ref):
        assert o.token_ids == _trim_at_eos(r, engine.model.eos_token_id)
    assert "Paris" in ours[0].text
    assert_no_leak(engine)


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    rng = random.Random(1)
    prefix = [rng.randrange(3, 1000) for _ in range(45)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in (3, 9, 1, 14)]


def _run_scenario(path, prompts, sequential, **kw):
    engine = make_engine(path, **kw)
    if sequential:
        outs = [generate_one(engine, f"s{i}", p) for i, p in enumerate(prompts)]
    else:
        outs = generate(engine, prompts, max_tokens=12)
    assert_no_leak(engine)
    return engine, outs


def generate_one(engine, rid, prompt, **params):
    params = {"temperature": 0.0, "max_tokens": 12, **params}
    engine.add_request(StageInput(rid, prompt_token_ids=prompt, sampling_params=SamplingParams(**params)))
    return run_to_completion(engine)[rid]


@pytest.mark.parametrize("scenario", ["prefix_hit", "chunked_prefill", "preemption"])
def test_caching_on_off_identical(tiny_llama, shared_prefix_prompts, scenario):
    kw = {}
    sequential = True
    if scenario == "chunked_prefill":
        kw = dict(max_num_batched_tokens=7)
    elif scenario == "preemption":
        kw = dict(num_blocks=28)  # two requests fit at admission, not once they grow
        sequential = False
    on_engine, on = _run_scenario(tiny_llama, shared_prefix_prompts, sequential, caching=True, **kw)
    off_engine, off = _run_scenario(tiny_llama, shared_prefix_prompts, sequential, caching=False, **kw)
    # fp32 either way; cached and uncached runs compute different row counts per step, so the
    # kernels block their sums differently (CPU or GPU): the bound for the 4-layer tiny llama whose
    # longest sum is 128 terms (intermediate 128; at most 45 + 14 + 12 positions attended).
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        atol = decoder_atol(b.hidden_states, layers=TINY_ARCHS["llama"], widest_sum=128)
        assert_rows_close(a.hidden_states, b.hidden_states, atol, f"{a.request_id}: hidden states")
    if scenario == "prefix_hit":
        # Every later request reuses the 45-token prefix: 11 blocks of 4.
        assert [o.num_cached_tokens for o in on[1:]] == [44, 44, 44]
        assert on_engine.stats().prefix_cache_hit_rate > 0.5
        assert off_engine.stats().prefix_cache_hits == 0
    if scenario == "preemption":
        assert on_engine.scheduler.num_preemptions > 0
        assert off_engine.scheduler.num_preemptions > 0


def test_seeded_sampling_reproducible_regardless_of_batch(tiny_qwen2):
    prompts = _prompts(1000, [7, 12, 30], seed=3)
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10)
    alone = generate_one(make_engine(tiny_qwen2), "x", prompts[0], **params)
    engine = make_engine(tiny_qwen2)
    engine.add_request(StageInput("other1", prompt_token_ids=prompts[1],
                                  sampling_params=SamplingParams(temperature=1.0, max_tokens=10)))
    engine.add_request(StageInput("x", prompt_token_ids=prompts[0], sampling_params=SamplingParams(**params)))
    engine.add_request(StageInput("other2", prompt_token_ids=prompts[2],
                                  sampling_params=SamplingParams(temperature=1.0, seed=7, max_tokens=10)))
    batched = run_to_completion(engine)["x"]
    assert batched.token_ids == alone.token_ids


def test_abort_frees_blocks(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(StageInput("a", prompt_token_ids=list(range(3, 40)),
                                  sampling_params=SamplingParams(temperature=0, max_tokens=50)))
    engine.add_request(StageInput("b", prompt_token_ids=list(range(5, 20)),
                                  sampling_params=SamplingParams(temperature=0, max_tokens=5)))
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.abort("a")
    outs = run_to_completion(engine)
    assert outs["a"].finish_reason == "abort"
    assert outs["b"].finish_reason == "length" and len(outs["b"].token_ids) == 5
    assert_no_leak(engine)


@pytest.mark.parametrize("inp, match", [
    (StageInput("bad", prompt_token_ids=[]), "prompt"),
    (StageInput("bad", prompt_token_ids=[1, 2, 10**7]), "out of vocabulary"),
    (StageInput("bad", prompt_token_ids=[5] * 300), "max_model_len"),
    (StageInput("bad", prompt_token_ids=[5, 6], sampling_params={"temperature": -1}), "temperature"),
    (StageInput("bad", prompt_token_ids=[5, 6], sampling_params={"top_p": 0}), "top_p"),
    (StageInput("bad", prompt_token_ids=[5, 6], sampling_params={"logit_bias": {10**7: 5.0}}),
     "sampling_params.logit_bias: token id 10000000 is out of vocabulary"),
    (StageInput("bad"), "prompt"),
])
def test_bad_input_rejected_engine_keeps_serving(tiny_llama, inp, match):
    engine = make_engine(tiny_llama, max_model_len=256)
    engine.add_request(StageInput("good", prompt_token_ids=[7, 8, 9],
                                  sampling_params=SamplingParams(temperature=0, max_tokens=4)))
    with pytest.raises(ValueError, match=match):
        engine.add_request(inp)
    outs = run_to_completion(engine)
    assert len(outs["good"].token_ids) == 4
    assert_no_leak(engine)


def test_text_prompt_and_detokenize(tiny_qwen2):
    engine = make_engine(tiny_qwen2)
    engine.add_request(StageInput("t", prompt="Hello there", sampling_params=SamplingParams(temperature=0, max_tokens=6)))
    out = run_to_completion(engine)["t"]
    assert out.prompt_token_ids == engine.tokenizer("Hello there")["input_ids"]
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    s = engine.stats()
    assert s.finished == 1 and s.ttft_mean_s > 0


def test_failed_forward_fails_its_requests_and_leaves_no_unwritten_cached_blocks(tiny_llama):
    """Blocks are cached when scheduled; if the forward pass that should fill
    them fails, no later request may hit them (their KV was never written)."""
    from stages.causal_lm import CausalLMStage

    class Flaky(CausalLMStage):
        fail_next = False

        def forward(self, input_ids, inputs_embeds, positions):
            if Flaky.fail_next:
                Flaky.fail_next = False
                raise RuntimeError("injected failure")
            return super().forward(input_ids, inputs_embeds, positions)

    model = Flaky.load(tiny_llama, dtype=torch.float32, device=torch.device("cpu"))
    prompt = list(range(10, 30))  # 5 full blocks of 4
    engine = make_engine(None, model=model)
    Flaky.fail_next = True
    engine.add_request(StageInput("bad", prompt_token_ids=prompt,
                                  sampling_params=SamplingParams(temperature=0, max_tokens=4)))
    out = engine.step().finished[0]
    assert out.finish_reason == "error" and isinstance(out.error, StageError) and out.error.stage == engine.name
    assert "injected failure" in out.error.message
    assert_no_leak(engine)
    again = generate_one(engine, "again", prompt, max_tokens=4)
    assert again.num_cached_tokens == 0  # nothing unwritten was served
    fresh = generate_one(make_engine(None, model=model), "fresh", prompt, max_tokens=4)
    assert again.token_ids == fresh.token_ids
    assert engine.stats().errors == 1
    assert_no_leak(engine)


class _OutputPenalties:
    """A transformers logits processor with OpenAI's (vLLM's) presence and frequency penalties, over the tokens
    generated after the prompt (transformers has neither)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for t in set(ids):
                scores[row, t] -= ids.count(t) * self.frequency + self.presence
        return scores


@pytest.mark.slow
def test_presence_and_frequency_penalties_match_transformers_with_them(tiny_qwen2):
    """Greedy with the penalties (and the repetition penalty first, as vLLM orders them): the tokens
    transformers' generate gives with the same penalties as a logits processor; and not the tokens
    without them."""
    from transformers import LogitsProcessorList

    engine = make_engine(tiny_qwen2)
    prompts = _prompts(engine.model.vocab_size, [6, 19, 33], seed=5)
    # Negative: rewards the tokens already said (the random tiny model seldom repeats one by itself).
    kw = {"presence_penalty": -0.5, "frequency_penalty": -1.5, "repetition_penalty": 1.1}
    plain = generate(engine, prompts, prefix="plain", max_tokens=24)
    ours = generate(engine, prompts, prefix="pen", max_tokens=24, **kw)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, o in zip(prompts, ours):
            ids = torch.tensor([p])
            procs = LogitsProcessorList([_OutputPenalties(len(p), kw["presence_penalty"], kw["frequency_penalty"])])
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                 repetition_penalty=kw["repetition_penalty"], logits_processor=procs,
                                 pad_token_id=engine.model.eos_token_id)[0, len(p):].tolist()
            assert o.token_ids == _trim_at_eos(ref, engine.model.eos_token_id)
    assert [o.token_ids for o in ours] != [o.token_ids for o in plain]  # the penalties changed the replies
    assert_no_leak(engine)


def test_logit_bias_steers_greedy_decoding(tiny_qwen2):
    """+100 on a token makes greedy decoding pick it at every step; -100 on the free run's first token
    makes greedy decoding pick the runner-up there (what transformers' generate picks with that token's
    logit lowered by 100, `sequence_bias`), and the other requests of the batch are untouched."""
    engine = make_engine(tiny_qwen2)
    prompts = _prompts(engine.model.vocab_size, [9, 14], seed=8)
    free = generate(engine, prompts, prefix="free", max_tokens=6)
    forced = 1234
    biased = generate(engine, prompts[:1], prefix="up", max_tokens=6, logit_bias={forced: 100.0})
    assert biased[0].token_ids == [forced] * 6
    first = free[0].token_ids[0]
    engine.add_request(StageInput("down", prompt_token_ids=prompts[0],
                                  sampling_params=SamplingParams(temperature=0, max_tokens=6, logit_bias={first: -100})))
    engine.add_request(StageInput("other", prompt_token_ids=prompts[1], sampling_params=SamplingParams(
        temperature=0, max_tokens=6)))
    outs = run_to_completion(engine)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             sequence_bias={(first,): -100.0}, pad_token_id=engine.model.eos_token_id)
    assert outs["down"].token_ids == _trim_at_eos(ref[0, len(prompts[0]):].tolist(), engine.model.eos_token_id)
    assert outs["down"].token_ids[0] != first and outs["other"].token_ids == free[1].token_ids
    assert_no_leak(engine)


def test_logprobs_are_transformers_raw_log_softmax(tiny_qwen2):
    """SamplingParams.logprobs: each generated token's log-probability and the k most likely at its step,
    from the raw logits (vLLM's default): transformers' forward over the same sequence, log-softmaxed, within
    the bound the two evaluation orders allow (tests/tolerances.py), the same k tokens in the same order
    where their gaps exceed it; in the stream's deltas the same entries as in the final output; a request
    of the batch that did not ask gets none, and the penalties do not change them (raw)."""
    from tests.tolerances import logprobs_atol

    engine = make_engine(tiny_qwen2)
    prompts = _prompts(engine.model.vocab_size, [7, 20], seed=11)
    engine.add_request(StageInput("lp", prompt_token_ids=prompts[0], stream=True, sampling_params=SamplingParams(
        temperature=0, max_tokens=6, logprobs=3, repetition_penalty=1.3)))
    engine.add_request(StageInput("plain", prompt_token_ids=prompts[1], stream=True,
                                  sampling_params=SamplingParams(temperature=0, max_tokens=6)))
    deltas, outs = {}, {}
    while len(outs) < 2:
        step = engine.step()
        for d in step.deltas:
            deltas.setdefault(d.request_id, []).append(d)
        outs.update({o.request_id: o for o in step.finished})
    out = outs["lp"]
    assert outs["plain"].logprobs is None and all(d.logprobs is None for d in deltas["plain"])
    assert [e for d in deltas["lp"] for e in d.logprobs] == out.logprobs
    assert [e.token_id for e in out.logprobs] == out.token_ids
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32).eval()
    seq = prompts[0] + out.token_ids
    with torch.inference_mode():
        ref = model(torch.tensor([seq]), output_hidden_states=True)
    steps = range(len(prompts[0]) - 1, len(seq) - 1)  # the positions whose logits chose the output tokens
    ref_lp = ref.logits[0].log_softmax(-1)[list(steps)].numpy()
    hidden = ref.hidden_states[-1][0][list(steps)].numpy()
    atol = logprobs_atol(hidden, model.lm_head.weight.detach().numpy(), layers=TINY_ARCHS["qwen2"], widest_sum=128)
    # The bound tells raw from processed log-probabilities: at a temperature of 0.7 those of the same tokens
    # lie further than it from the raw ones.
    scaled = (ref.logits[0] / 0.7).log_softmax(-1)[list(steps)].numpy()
    assert max(abs(scaled[i, e.token_id] - ref_lp[i, e.token_id]) for i, e in enumerate(out.logprobs)) > 4 * atol
    for i, e in enumerate(out.logprobs):
        assert abs(e.logprob - ref_lp[i, e.token_id]) <= atol, (i, e.logprob, ref_lp[i, e.token_id], atol)
        assert len(e.top) == 3 and e.top[0][0] == e.token_id == int(ref_lp[i].argmax())  # greedy: the best
        assert all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
        order = np.argsort(-ref_lp[i])[:4]
        for rank, (tid, lp, text, raw) in enumerate(e.top):
            assert abs(lp - ref_lp[i, tid]) <= atol and text == engine.tokenizer.decode([tid])
            assert raw.decode("utf-8", "replace") == text  # (the token's own bytes: tests/engine/test_token_bytes.py)
            if ref_lp[i, order[rank]] - ref_lp[i, order[rank + 1]] > 2 * atol:
                assert tid == order[rank], (i, rank)
    assert_no_leak(engine)


def test_min_tokens_matches_transformers_min_new_tokens(tiny_llama):
    """vLLM's min_tokens = transformers' min_new_tokens: the eos and the stop tokens cannot be sampled
    before that many tokens; afterwards they stop the request as usual. A stop token taken from the free
    run makes the difference visible: without min_tokens it ends the request early."""
    engine = make_engine(tiny_llama)
    prompts = _prompts(engine.model.vocab_size, [7, 21, 40], seed=3)
    eos = engine.model.eos_token_id
    free = generate(engine, prompts, prefix="free", max_tokens=24)
    stops = sorted({o.token_ids[2] for o in free} - {eos})
    early = generate(engine, prompts, prefix="early", max_tokens=24, stop_token_ids=stops)
    forced = generate(engine, prompts, prefix="min", max_tokens=24, stop_token_ids=stops, min_tokens=12)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, e, f in zip(prompts, early, forced):
            ids = torch.tensor([p])
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=12,
                                 do_sample=False, eos_token_id=[eos, *stops], pad_token_id=eos)[0, len(p):].tolist()
            cut = next((i for i, t in enumerate(ref) if t in (eos, *stops)), len(ref) - 1)
            assert f.token_ids == ref[: cut + 1]
            assert len(f.token_ids) >= 12 and not set(f.token_ids[:11]) & {eos, *stops}
            assert len(e.token_ids) <= 3  # the free run's third token is a stop token now
    assert any(len(f.token_ids) > 12 for f in forced) or any(f.token_ids[-1] in stops for f in forced)
    assert_no_leak(engine)
