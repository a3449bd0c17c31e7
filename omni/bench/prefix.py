"""`omni bench prefix`: long-document QA with and without prefix caching.

One ~2,000-token document, then follow-up questions about it, one at a time
(as a user would send them). Mean TTFT of the questions with caching vs
without, and of the questions alone (no document, uncached): what prefix caching
can at best get down to, so `cached_over_question_alone` = cached TTFT / that is
1.0 at the physical limit (the question still attends over the cached document,
and the document's last partial block is recomputed). That attention is work the question alone does
not do: `flops_cached_over_question_alone` is the ratio of the two forwards' FLOPs (flops.py: the
layers' matmuls, the attention over every key, the sampled row's head), the bound that arithmetic puts
on `cached_over_question_alone` for this document and these questions. Plus the miss case (no
shared prefixes): throughput with caching on vs off, to show caching costs
nothing when it cannot help.
"""
from __future__ import annotations

import argparse
import random
import statistics

from omni.bench import engine_loop
from omni.bench.workloads import Timer, long_document, questions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--num-questions", type=int, default=16)
    p.add_argument("--miss-requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def make_engine(model: str, caching: bool, emit_hidden_states: bool = False, dtype: str = "float32"):
    """The causal_lm stage of `model` as engine_factory builds it (32 sequences, 4,096 tokens a step)."""
    return engine_loop.engine("bench", "causal_lm", model, enable_prefix_caching=caching, dtype=dtype,
                              emit_hidden_states=emit_hidden_states,
                              scheduler={"max_num_seqs": 32, "max_num_batched_tokens": 4096})


def run_one(engine, rid: str, ids: list[int], max_tokens: int):
    """Submit one request and run it to completion; returns its StageOutput."""
    from omni.messages import StageInput
    from omni.sampling_params import SamplingParams

    [out] = engine_loop.run(engine, [StageInput(rid, prompt_token_ids=ids, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=max_tokens))])
    return out


def qa_ttfts(engine, doc_ids: list[int], question_ids: list[list[int]], max_tokens: int = 4):
    run_one(engine, "doc", doc_ids, 1)  # the document is read once first (as in a chat session)
    outs = [run_one(engine, f"q{i}", doc_ids + q, max_tokens) for i, q in enumerate(question_ids)]
    return [o.metrics["ttft_s"] for o in outs], outs


def _flops_ratio(path, doc_ids: list[int], q_ids: list[list[int]], cached_outs) -> float:
    """Mean FLOPs of the cached questions' forwards (from each one's cached tokens to its end) over the
    questions alone (from 0), one sampled row each."""
    from omni.bench.flops import decoder_shape, forward_flops, meta_model

    shape = decoder_shape(meta_model(path))
    cached = sum(sum(forward_flops(shape, [(o.num_cached_tokens, len(doc_ids) + len(q))], 1))
                 for o, q in zip(cached_outs, q_ids))
    alone = sum(sum(forward_flops(shape, [(0, len(q))], 1)) for q in q_ids)
    return cached / alone


def qa_workload(path, args):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    doc = long_document(tok, args.doc_tokens, args.seed)
    doc_ids = tok(doc)["input_ids"]
    q_ids = [tok(q, add_special_tokens=False)["input_ids"] for q in questions(args.num_questions, args.seed)]
    return tok, doc_ids, q_ids


def run(args) -> dict:
    from omni.sampling_params import SamplingParams
    from omni.messages import StageInput
    from omni.registry import resolve_model_path

    path = resolve_model_path(args.model)
    tok, doc_ids, q_ids = qa_workload(path, args)
    print(f"document: {len(doc_ids)} tokens, {len(q_ids)} questions")
    res = {}
    answers = {}
    for caching in (True, False):
        engine = make_engine(args.model, caching)
        ttfts, outs = qa_ttfts(engine, doc_ids, q_ids)
        answers[caching] = [o.token_ids for o in outs]
        if caching:
            cached_outs = outs
        res[caching] = statistics.mean(ttfts)
        print(f"caching={caching}: mean TTFT {res[caching] * 1000:.1f} ms, "
              f"hit rate {engine.stats().prefix_cache_hit_rate:.3f}")
    assert answers[True] == answers[False], "prefix caching changed outputs"
    flops_ratio = _flops_ratio(path, doc_ids, q_ids, cached_outs)
    # The questions alone on the (warm) uncached engine: the TTFT a perfect cache would leave.
    alone = statistics.mean(run_one(engine, f"alone{i}", q, 4).metrics["ttft_s"] for i, q in enumerate(q_ids))
    print(f"question alone (no document, uncached): mean TTFT {alone * 1000:.1f} ms; "
          f"cached / alone {res[True] / alone:.2f} (their FLOPs: {flops_ratio:.2f})")

    # Miss case: unrelated prompts, batched; throughput with caching on vs off.
    rng = random.Random(args.seed + 1)
    vocab = len(tok)
    prompts = [[rng.randrange(100, vocab) for _ in range(256)] for _ in range(args.miss_requests)]
    tps = {}
    for rep in range(3):  # alternate on/off to spread machine noise over both; best of each
        for caching in (True, False):
            engine = make_engine(args.model, caching)
            run_one(engine, "warm", [100] * 8, 1)
            with Timer() as t:
                n = sum(len(o.token_ids) for o in engine_loop.run(engine, [StageInput(
                    f"m{i}", prompt_token_ids=p, sampling_params=SamplingParams(
                        temperature=0.0, max_tokens=32, ignore_eos=True)) for i, p in enumerate(prompts)]))
            tps.setdefault(caching, []).append(n / t.elapsed)
    on, off = max(tps[True]), max(tps[False])
    print(f"miss case: caching on {on:.1f} tok/s, off {off:.1f} tok/s")
    return {
        "model": str(args.model), "doc_tokens": len(doc_ids), "num_questions": len(q_ids),
        "ttft_cached_ms": res[True] * 1000, "ttft_uncached_ms": res[False] * 1000,
        "ttft_speedup": res[False] / res[True],
        "ttft_question_alone_ms": alone * 1000, "cached_over_question_alone": res[True] / alone,
        "flops_cached_over_question_alone": flops_ratio,
        "miss_tokens_per_s_cached": on, "miss_tokens_per_s_uncached": off,
        "miss_throughput_ratio": on / off,
    }
