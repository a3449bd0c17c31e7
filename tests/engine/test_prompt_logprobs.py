"""Prompt log-probabilities (SamplingParams.prompt_logprobs, vLLM's): every prompt token's log-probability given the
tokens before it equals transformers' log-softmax of its own logits, whether the prompt is prefilled in one step or
in chunks, and whether or not its blocks were cached (the request recomputes them: a hit has no logits)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from omni.errors import RequestError
from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _hf_logprobs(path, prompt: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [P, V]: position p predicts p + 1


def _ask(engine, rid: str, prompt: list[int], k: int = 3) -> None:
    engine.add_request(StageInput(rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=2, prompt_logprobs=k)))


def test_prompt_logprobs_equal_transformers_chunked_cached_or_not(tiny_qwen2):
    prompt = _prompt(0, 30)
    ref = _hf_logprobs(tiny_qwen2, prompt)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()
    whole = make_engine(tiny_qwen2, caching=True, max_num_batched_tokens=512)
    engine_free = whole
    engine_free.add_request(StageInput("plain", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=2)))
    run_to_completion(engine_free)  # the prompt's blocks are cached now
    chunked = make_engine(tiny_qwen2, caching=False, max_num_batched_tokens=8)  # 30 tokens in 4 steps
    for engine in (whole, chunked):
        _ask(engine, "lp", prompt)
        out = run_to_completion(engine)["lp"]
        assert out.num_cached_tokens == 0  # recomputed, not read from the cache
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        assert [e.token_id for e in lps[1:]] == prompt[1:]
        np.testing.assert_allclose([e.logprob for e in lps[1:]], want, atol=1e-4)
        for p, e in enumerate(lps[1:]):
            assert len(e.top) == 3 and e.top[0][1] == pytest.approx(float(ref[p].max()), abs=1e-4)
            assert e.token is not None  # the token's text
            assert e.rank == 1 + int((ref[p] > ref[p, prompt[p + 1]]).sum())
        assert out.logprobs is None and len(out.token_ids) == 2  # generation unaffected
        assert_no_leak(engine)


def test_prompt_logprobs_refusals(tiny_qwen2):
    engine = make_engine(tiny_qwen2)
    with pytest.raises(ValueError, match="prompt_logprobs must be None or 0..20"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(RequestError) as e:
        engine.add_request(StageInput("f", prompt_token_ids=_prompt(1, 5), sampling_params=SamplingParams(
            prompt_logprobs=1, forced_token_ids=[5, 6])))
    assert e.value.field == "sampling_params.prompt_logprobs"
    assert_no_leak(engine)
