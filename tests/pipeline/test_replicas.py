"""Stage replicas on the local backend: real tiny engines (hit rates, the driver's tokenizer, eviction
reports) and the fake engine (streaming edges to the chosen replica, per-replica stats)."""
from __future__ import annotations

import random

import pytest

from omni import Omni, SamplingParams
from tests.fakes import fake_factory, stage

TINY = "stage_configs/tiny_chain.yaml"


def replicated(n: int, policy: str = "prefix_affinity") -> dict:
    return {s: {"replicas": n, "routing": policy} for s in ("thinker", "talker")}


def conversations(o: Omni, num: int, turns: int, seed: int = 0) -> list[list]:
    """`num` conversations sharing a system prompt, their turns interleaved in a shuffled order; each turn
    resends the conversation so far (replies included). Returns each conversation's outputs per turn."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 1000) for _ in range(32)]
    convs = [system + [rng.randrange(100, 1000) for _ in range(40)] for _ in range(num)]
    outs: list[list] = [[] for _ in range(num)]
    for _ in range(turns):
        order = list(range(num))
        rng.shuffle(order)
        prompts = [{"prompt_token_ids": convs[c]} for c in order]
        for c, out in zip(order, o.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)):
            assert out.error is None, out.error
            outs[c].append(out)
            convs[c] = convs[c] + out.outputs["thinker"].token_ids + [rng.randrange(100, 1000) for _ in range(12)]
    return outs


@pytest.mark.slow
def test_multi_turn_conversations_keep_their_hit_rate_with_replicas():
    results = {}
    for n in (1, 2):
        with Omni(TINY, stage_overrides=replicated(n), backend="local") as o:
            outs = conversations(o, num=4, turns=3)
            results[n] = (outs, o.stats()["stages"])
    (single, s1), (multi, s2) = results[1], results[2]
    # Same tokens whichever replica served them.
    assert [[t.outputs["talker"].token_ids for t in c] for c in single] == \
           [[t.outputs["talker"].token_ids for t in c] for c in multi]
    # The thinker hits exactly as much as with one replica: every follow-up turn landed where its
    # conversation is cached (the shared system prompt is computed once per replica: not a hit there,
    # but a 32-token prefix is under min_match_ratio, so turn 1 spreads by load).
    for c1, c2 in zip(single, multi):
        assert [t.outputs["thinker"].num_cached_tokens for t in c1[1:]] == \
               [t.outputs["thinker"].num_cached_tokens for t in c2[1:]]
    assert s2["thinker"]["prefix_cache_hit_rate"] >= 0.95 * s1["thinker"]["prefix_cache_hit_rate"]
    assert s2["talker"]["prefix_cache_hit_rate"] >= 0.9 * s1["talker"]["prefix_cache_hit_rate"]
    for name in ("thinker", "talker"):  # the talker routed by the conversation's lineage, predicted exactly
        router = s2[name]["router"]
        assert router["decisions"]["affinity"] == 4 * 2, (name, router)
        assert router["obtained_hit_blocks"] == router["predicted_hit_blocks"] > 0 and router["shortfalls"] == 0
    replicas = s2["thinker"]["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and all(r["finished"] > 0 for r in replicas)
    assert {"prefix_cache_hit_rate", "kv_usage", "running", "waiting", "state"} <= set(replicas[0])
    assert s2["thinker"]["finished"] == 12 == sum(r["finished"] for r in replicas)


@pytest.mark.slow
def test_text_and_chat_prompts_are_tokenized_in_the_driver_like_the_stage():
    over = {"thinker": {"replicas": 2, "use_chat_template": True}, "talker": {"replicas": 1}}
    sp = SamplingParams(temperature=0, max_tokens=4)
    with Omni(TINY, stage_overrides=over, backend="local") as o:
        messages = [{"role": "system", "content": "You answer in riddles. " * 12}, {"role": "user", "content": "Hi"}]
        for turn in range(3):
            [out] = o.generate({"prompt": messages}, sp, use_tqdm=False)
            assert out.error is None
            if turn:
                assert out.outputs["thinker"].num_cached_tokens >= 32  # the conversation so far
            messages = messages + [{"role": "assistant", "content": out.text}, {"role": "user", "content": "More"}]
        router = o.stats()["stages"]["thinker"]["router"]
    # The driver's token ids were the stage's (checked on every finished request), and every follow-up
    # turn went to the replica that held the conversation.
    assert router["driver_tokenizer"] == "ok"
    assert router["decisions"]["affinity"] == 2 and router["shortfalls"] == 0


@pytest.mark.slow
def test_evictions_reported_by_the_replicas_reach_the_router():
    over = {"thinker": {"replicas": 2, "cache": {"block_size": 4, "num_blocks": 24}},
            "talker": {"replicas": 1}}
    with Omni(TINY, stage_overrides=over, backend="local") as o:
        rng = random.Random(1)
        prompts = [{"prompt_token_ids": [rng.randrange(100, 1000) for _ in range(40)]} for _ in range(8)]
        for p in prompts:  # one at a time: each evicts what the previous ones left on its replica
            [out] = o.generate(p, SamplingParams(max_tokens=2), use_tqdm=False)
            assert out.error is None
        router = o.stats()["stages"]["thinker"]["router"]
    assert router["evictions_applied"] > 0
    assert max(router["summary_blocks"]) <= 24  # bounded by the replica's cache (num_blocks)


def test_a_streaming_edge_feeds_the_replica_chosen_for_the_consumer():
    def config(replicas: int) -> dict:
        return {"name": "s", "runtime": {"backend": "local"}, "stages": [
            stage("thinker", final_output="text", replicas=replicas, sampling={"max_tokens": 9}),
            stage("talker", inputs=[{"stage": "thinker", "stream": True, "chunk_tokens": 2}], replicas=replicas,
                  final_output="tokens", sampling={"max_tokens": 3})]}

    prompts = [{"prompt_token_ids": [i + 1] * (10 + i)} for i in range(6)]
    with Omni(config(1), engine_factory=fake_factory) as o:
        expected = [out.outputs["talker"].token_ids for out in o.generate(prompts, use_tqdm=False)]
    with Omni(config(2), engine_factory=fake_factory) as o:
        got = o.generate(prompts, use_tqdm=False)
        talkers = o._backend.replicas["talker"]
        assert all(w.engine.finished > 0 for w in talkers)  # both consumer replicas were fed
    assert [out.outputs["talker"].token_ids for out in got] == expected
