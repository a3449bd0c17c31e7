"""transformers' decoder LMs as a user without omni runs them (the reference of `omni bench throughput`):
`generate` on one left-padded batch, and transformers' continuous batching (`generate_batch`'s manager),
each timed on the same requests after a warm-up.
"""
from __future__ import annotations

import torch

from omni.bench.workloads import Timer


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, reqs, device) -> tuple[float, int]:
    max_len = max(len(r.prompt_token_ids) for r in reqs)
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    ids = torch.full((len(reqs), max_len), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):  # left padding, as decoder-only generation needs
        ids[i, max_len - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, max_len - len(r.prompt_token_ids):] = 1
    max_new = max(r.max_tokens for r in reqs)
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():  # warm-up (kernel selection, cuBLAS handles) outside the timing
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
    with torch.inference_mode(), Timer() as t:
        model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, pad_token_id=pad)
        sync(device)
    # Only the tokens each request asked for are useful output.
    return t.elapsed, sum(r.max_tokens for r in reqs)


def _continuous_batching_limits(reqs) -> dict:
    """transformers' continuous batching with omni's engine limits here (64 sequences, 2,048 tokens a batch)
    and a KV cache the workload fits in: left to itself it sizes its cache from the device's free memory
    (on a CPU, most of the machine's RAM, faulted in while the first request waits: seconds for one request
    of the tiny model). transformers without ContinuousBatchingConfig (before 5.2x) keeps its own sizing."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return {}
    page = 256
    blocks = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page) for r in reqs) + len(reqs) + 1
    return {"continuous_batching_config": ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=2048, max_requests_per_batch=64)}


def generate_batch(model, reqs) -> tuple[float, int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs),
                           eos_token_id=None, pad_token_id=model.config.eos_token_id)
    manager = model.init_continuous_batching(generation_config=cfg, **_continuous_batching_limits(reqs))
    manager.start()
    try:
        # Warm-up (as for `generate`): the manager's thread builds its cache and first batch outside the timing.
        warm = manager.add_request(list(reqs[0].prompt_token_ids[:16]), max_new_tokens=2)
        while (res := manager.get_result(timeout=600)) is not None and not (res.request_id == warm and res.is_finished()):
            pass
        if res is None:
            raise RuntimeError("transformers continuous batching stopped without a result")
        produced = 0
        with Timer() as t:
            ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens) for r in reqs]
            pending = set(ids)
            while pending:
                res = manager.get_result(timeout=600)
                if res is None:
                    raise RuntimeError("transformers continuous batching stopped without a result")
                if res.is_finished():
                    pending.discard(res.request_id)
                    produced += len(res.generated_tokens)
    finally:
        manager.stop(block=True, timeout=60)
    return t.elapsed, produced
