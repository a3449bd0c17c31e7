"""Streaming edges through the pipeline (tiny_chain: thinker ~> talker fed its hidden states).

The talker admits a request on the thinker's first chunk and its prompt grows chunk by chunk;
everything users rely on must hold as without streaming: the same tokens, caching on/off
identical, deltas that add up to the final text, nothing leaked when requests are cut short,
and a wait for a chunk that never comes fails with an error naming the edge.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from omni import AsyncOmni, Omni, SamplingParams, StageDelta
from omni.errors import ConfigError, StageError
from tests.serve.server_utils import held

CONFIG = str(Path(__file__).resolve().parents[2] / "stage_configs" / "tiny_chain.yaml")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = ["Hello, my name is", "The capital of France is Paris, and the capital of Italy is",
           "1 2 3 4 5 6 7 8 9 10 11 12", {"prompt_token_ids": [11, 22, 33, 44, 55]}]


def streaming(chunk_tokens=3, caching=True):
    return {"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": chunk_tokens}],
                       "enable_prefix_caching": caching},
            "thinker": {"enable_prefix_caching": caching}}


def with_runtime(overrides, **runtime):
    from omni.config.loader import load_config

    cfg = load_config(CONFIG, overrides)
    return cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update=runtime)})


def assert_clean(o: Omni) -> None:
    """No block in use on any stage, KV managers consistent, nothing waiting."""
    for name, worker in o._backend.workers.items():
        engine = worker.engine
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks, f"stage {name} leaked blocks"
        assert not engine.scheduler.requests and not worker._incoming and not worker._in_flight, name


def collect(o: Omni, prompts, sp=GREEDY):
    deltas, finals = {}, {}
    for ev in o.stream(prompts, sp):
        if isinstance(ev, StageDelta):
            deltas.setdefault((ev.request_id, ev.stage), []).append(ev)
        else:
            finals[(ev.request_id, ev.stage)] = ev
    return deltas, finals


@pytest.fixture(scope="module")
def reference():
    with Omni(CONFIG, backend="local") as o:
        return o.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 64])
def test_streaming_edge_gives_the_non_streaming_outputs(reference, chunk_tokens):
    with Omni(CONFIG, backend="local", stage_overrides=streaming(chunk_tokens)) as o:
        deltas, finals = collect(o, PROMPTS)
        for ref in reference:
            rid = ref.request_id
            th, tk = finals[(rid, "thinker")], finals[(rid, "talker")]
            assert th.error is None and tk.error is None
            assert th.token_ids == ref.outputs["thinker"].token_ids
            assert tk.token_ids == ref.outputs["talker"].token_ids
            # Deltas add up to the final tokens and text of every stage.
            for stage, out in (("thinker", th), ("talker", tk)):
                ds = deltas[(rid, stage)]
                assert [t for d in ds for t in d.token_ids] == out.token_ids
                assert "".join(d.text for d in ds) == out.text
        assert_clean(o)


def test_streamed_rows_add_up_to_the_hidden_states():
    """stream(return_hidden_states=True): each delta carries the rows computed since the last one."""
    import numpy as np

    with Omni(CONFIG, backend="local", stage_overrides=streaming(3)) as o:
        rows, finals = {}, {}
        for ev in o.stream(PROMPTS[:2], GREEDY, return_hidden_states=True):
            if isinstance(ev, StageDelta):
                if ev.rows:
                    assert ev.rows_start == sum(r.shape[0] for r in rows.get((ev.request_id, ev.stage), []))
                    rows.setdefault((ev.request_id, ev.stage), []).append(ev.rows["hidden_states"])
            else:
                finals[(ev.request_id, ev.stage)] = ev
        assert len(finals) == 2 * 2  # two prompts, each with a thinker and a talker output
        for key, out in finals.items():
            np.testing.assert_array_equal(np.concatenate(rows[key]), out.hidden_states)
        assert_clean(o)


def test_talker_starts_before_the_thinker_finishes():
    """The overlap that streaming is for: the talker has computed rows while the thinker still decodes."""
    with Omni(CONFIG, backend="local", stage_overrides=streaming(2)) as o:
        sp = SamplingParams(temperature=0.0, max_tokens=24)
        seen_talker_early = False
        thinker_done = False
        for ev in o.stream(["Tell me a long story about the sea"], sp):
            if isinstance(ev, StageDelta) and ev.stage == "talker" and not thinker_done:
                seen_talker_early = True
            if isinstance(ev, StageDelta) and ev.stage == "thinker" and ev.finished:
                thinker_done = True
        assert seen_talker_early
        assert_clean(o)


@pytest.mark.slow
def test_streaming_is_deterministic_and_caching_on_off_identical():
    turn2 = {"prompt": "Hello, my name is Bob and I like"}
    runs = []
    for caching in (True, False, True):
        with Omni(CONFIG, backend="local", stage_overrides=streaming(3, caching)) as o:
            _, first = collect(o, ["Hello, my name is"])
            _, second = collect(o, [turn2])
            assert len(first) == len(second) == 2  # thinker and talker, each turn
            runs.append([{k[1]: v.token_ids for k, v in turn.items()} for turn in (first, second)])
            stats = o.stats()["stages"]
            assert (stats["thinker"]["prefix_cache_hits"] > 0) == caching
            assert_clean(o)
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.slow
def test_abort_at_random_points_leaves_no_block_in_use():
    rng = random.Random(7)
    with Omni(CONFIG, backend="local", stage_overrides=streaming(2)) as o:
        sp = SamplingParams(temperature=0.0, max_tokens=16)
        for i in range(50):
            it = o.stream([f"request number {i} says hello"], sp)
            cut = rng.randrange(0, 30)
            mode = i % 3
            for n, ev in enumerate(it):
                if n >= cut:
                    break
            if mode == 0:
                it.close()  # the iterator closed early
            elif mode == 1:
                o.abort(ev.request_id) if n >= cut else None
                it.close()
            else:
                del it
        # Let any abort that is still in flight land, then check every stage.
        for _ in range(20):
            o._orch.step(0.01)
        assert_clean(o)
        [after] = o.generate(["still serving?"], GREEDY, use_tqdm=False)
        assert after.error is None
        assert_clean(o)


def test_cancelled_async_streams_release_every_stage():
    async def main():
        async with AsyncOmni(CONFIG, backend="local", stage_overrides=streaming(2)) as o:
            async def consume(i, stop):
                n = 0
                async for _ in o.stream(f"async request {i}", SamplingParams(temperature=0.0, max_tokens=20)):
                    n += 1
                    if n == stop:
                        break
                return n

            # The talker is held until the cancel has landed, so the request to cancel cannot finish first
            # however fast the machine is; it is cancelled once it runs in the thinker (a condition, not a
            # guessed delay), and the streams go on once the talker is released.
            with held(o, "talker") as release:
                slow = asyncio.create_task(o.generate("cancel me", SamplingParams(temperature=0.0, max_tokens=200,
                                                                                  ignore_eos=True)))
                deadline = time.monotonic() + 60
                while (await o.stats())["stages"]["thinker"]["running"] == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                tasks = [asyncio.create_task(consume(i, 3 + i)) for i in range(6)]
                await asyncio.sleep(0)  # the streams are submitted before the cancel
                assert not slow.done()
                slow.cancel()
                await asyncio.sleep(0)  # the cancel reaches the request before the talker goes on
                release.set()
            assert await asyncio.gather(*tasks) == [3 + i for i in range(6)]
            with pytest.raises(asyncio.CancelledError):
                await slow
            deadline = time.monotonic() + 60  # aborts land asynchronously: returns as soon as they have
            while time.monotonic() < deadline and any(s["kv_usage"] or s["running"] or s["waiting_for_chunks"]
                                                      for s in (await o.stats())["stages"].values()):
                await asyncio.sleep(0.05)
            for s in (await o.stats())["stages"].values():
                assert s["kv_usage"] == 0.0 and s["running"] == 0 and s["waiting_for_chunks"] == 0
            out = await o.generate("after", GREEDY)
            assert out.error is None
            return o

    o = asyncio.run(main())
    assert_clean(o._omni)


def test_chunks_that_reach_the_consumer_before_its_submission_are_kept(reference):
    """On Ray a producer pushes its chunks actor to actor while the consumer's submission comes from the driver:
    nothing orders the two, so a fast producer's first chunks can reach the consumer first (a Ray pipeline lost
    them and its request waited out the chunk timeout). Here every request's submission reaches the consumer
    only after its first chunk: the same tokens, nothing left behind."""
    with Omni(CONFIG, backend="local", stage_overrides=streaming(3)) as o:
        talker = o._backend.workers["talker"]
        late: dict[str, object] = {}
        real_submit, real_push = talker.submit, talker.push_chunk

        def push(rid, seq, chunk):
            real_push(rid, seq, chunk)  # the chunk first...
            if rid in late:
                real_submit(late.pop(rid))  # ...then its submission

        talker.submit = lambda sub: late.__setitem__(sub.request_id, sub)
        talker.push_chunk = push
        deltas, finals = collect(o, PROMPTS)
        assert not late
        for ref in reference:
            assert finals[(ref.request_id, "talker")].token_ids == ref.outputs["talker"].token_ids
        del talker.submit, talker.push_chunk
        assert_clean(o)
        assert not talker._early


@pytest.mark.slow
def test_a_producer_that_holds_the_request_keeps_its_consumer_waiting():
    """The chunk timeout finds a producer that died or lost the request, not a busy one (streaming.ALIVE). The
    thinker holds the request 3 s with no token (as a stage queued behind others, or waiting on its own streamed
    upstream, does) against a 1 s timeout: it tells the talker on admission and every third of the timeout after,
    and the talker waits, then gets the tokens it gets without the wait. (4 voice-agent sessions failed at turn 7:
    the LLM queued their requests, the codec's clock ran out.)"""
    from omni.engine.interface import EngineStepOutput
    from omni.messages import StageDelta as Delta
    from omni.pipeline.streaming import ALIVE, Incoming

    with Omni(with_runtime(streaming(2), stream_chunk_timeout_s=1.0), backend="local") as o:
        thinker, talker = o._backend.workers["thinker"], o._backend.workers["talker"]
        [plain] = o.generate(["Hello there"], GREEDY, use_tqdm=False)
        seen, push, real_step = [], talker.push_chunk, thinker.engine.step
        talker.push_chunk = lambda rid, seq, chunk: (seen.append((time.monotonic(), seq)), push(rid, seq, chunk))
        until = time.monotonic() + 3.0

        def busy_step():
            if time.monotonic() < until:  # the request is held: no step makes progress on it
                time.sleep(0.01)
                return EngineStepOutput()
            return real_step()

        thinker.engine.step = busy_step
        t0 = time.monotonic()
        [held_out] = o.generate(["Hello there"], GREEDY, use_tqdm=False)
        assert held_out.error is None and time.monotonic() - t0 >= 3.0
        assert held_out.outputs["talker"].token_ids == plain.outputs["talker"].token_ids
        seqs = [seq for _, seq in seen]
        first = seqs.index(0)
        assert seqs[0] == ALIVE and first >= 7 and set(seqs[:first]) == {ALIVE}  # ~9 in the 3 s
        assert [q for q in seqs if q != ALIVE] == list(range(len(seqs) - seqs.count(ALIVE)))
        gaps = [b - a for (a, _), (b, _) in zip([(t0, None)] + seen, seen)]
        assert max(gaps[:first + 1]) < 1.0  # the talker never went a timeout without a word
        del talker.push_chunk, thinker.engine.step
        assert_clean(o)
    inc = Incoming(None, 5.0, time.monotonic() - 1.0)  # its deadline passed...
    assert inc.expired(time.monotonic())
    inc.receive(ALIVE, Delta("r", "thinker"))  # ...the upstream still has the request: 5 s from now
    assert not inc.expired(time.monotonic()) and inc.take() is None and inc.next_seq == 0
    inc.receive(0, Delta("r", "thinker", token_ids=[7]))
    assert inc.take().token_ids == [7] and inc.next_seq == 1


def test_each_consumer_hears_from_its_producer_within_a_third_of_the_timeout():
    """ALIVE is per consumer: one fed a chunk every token does not keep a producer from telling another, fed every
    100 tokens, that the request is still there."""
    from omni.messages import StageDelta as Delta
    from omni.pipeline.backend import StreamTarget
    from omni.pipeline.streaming import ALIVE, Outgoing

    fast, slow = StreamTarget("talker", 1, False), StreamTarget("other", 100, False)
    out = Outgoing("thinker", "r", [fast, slow])
    assert [(t, seq) for t, seq, _ in out.alive()] == [(fast, ALIVE), (slow, ALIVE)]  # on admission: both
    assert out.alive(0.5) == [] and out.alive_due(0.5) > time.monotonic()
    time.sleep(0.6)
    sent = out.on_delta(Delta("r", "thinker", token_ids=[5], num_computed_tokens=1), lambda a, b: {})
    assert [(t, seq) for t, seq, _ in sent] == [(fast, 0)]  # the fast one's chunk...
    assert [(t, seq) for t, seq, _ in out.alive(0.5)] == [(slow, ALIVE)]  # ...the slow one is due its signal


def test_a_chunk_that_never_comes_fails_naming_the_edge():
    with Omni(with_runtime(streaming(2), stream_chunk_timeout_s=1.0), backend="local") as o:
        talker = o._backend.workers["talker"]
        talker.push_chunk = lambda *a: None  # the edge loses every chunk
        t0 = time.monotonic()
        [out] = o.generate(["Hello there"], GREEDY, use_tqdm=False)
        # Not before its 1 s (a bound the clock cannot break); the message names the chunk timeout,
        # not request_timeout_s (120 s in tiny_chain.yaml).
        assert time.monotonic() - t0 >= 1.0
        assert isinstance(out.error, StageError) and out.error.stage == "talker", repr(out.error)
        assert "the first chunk on the streaming edge thinker -> talker did not arrive within 1s" in out.error.message
        assert out.outputs["thinker"].token_ids  # the thinker's part is kept
        del talker.push_chunk
        # The recovery request must not race the 1 s deadline itself: on a loaded machine one thinker
        # step can take longer (seen: "the next chunk ... did not arrive within 1s").
        talker.chunk_timeout_s = 300.0
        [ok] = o.generate(["Hello again"], GREEDY, use_tqdm=False)
        assert ok.error is None
        assert_clean(o)


def test_upstream_failure_mid_stream_fails_the_request_naming_the_edge():
    with Omni(CONFIG, backend="local", stage_overrides=streaming(2)) as o:
        thinker = o._backend.workers["thinker"].engine
        real_step, calls = thinker.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 4:  # mid-stream: the talker already has chunks
                raise RuntimeError("GPU fell off the bus")
            return real_step()

        thinker.step = failing_step
        [out] = o.generate(["Hello there, tell me something"], SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
        assert "stage 'thinker' failed" in out.error.message and "thinker -> talker" in out.error.message, out.error
        thinker.step = real_step
        assert_clean(o)


@pytest.mark.parametrize("change,match", [
    ({"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 0}]}}, "chunk_tokens"),
    ({"talker": {"inputs": [{"stage": "thinker", "stream": True}], "input_processor": "stages.common.processors:"
                 "hidden_to_embeds"}}, "no chunk form"),
    ({"talker": {"inputs": [{"stage": "thinker", "stream": "yes"}]}}, "stream"),
    ({"talker": {"inputs": [{"stage": "nope", "stream": True}]}}, "unknown stage 'nope'"),
])
def test_bad_streaming_edges_are_config_errors(change, match):
    from omni.config.loader import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(CONFIG, stage_overrides=change)


def test_merged_deltas_lose_nothing():
    """A caller that has not taken a stage's delta yet gets the next one merged into it (the orchestrator keeps
    one pending delta per stage): every field of both must survive (the merge once dropped the logprobs, so a
    streamed completion under load lost the logprobs of all but the last piece). Every field is set here, so a
    field added to StageDelta and forgotten by the merge fails this test."""
    import dataclasses

    import numpy as np

    from omni.messages import TokenLogprob
    from omni.pipeline.streaming import merge_chunks

    lp = lambda t: TokenLogprob(t, -0.5, f"t{t}", [(t, -0.5, f"t{t}")], 1)  # noqa: E731
    a = StageDelta("r", "thinker", [1, 2], "ab", 5, 7, False, {"hidden_states": np.ones((2, 3), np.float32)}, 5,
                   [9, 9, 9, 9, 9], np.ones(4, np.float32), 24000, [lp(1), lp(2)], "the prompt", ["the", " prompt"],
                   [None, lp(9)], 4, {"audio": 2}, {"audio": 1})
    b = StageDelta("r", "thinker", [3], "c", 5, 8, True, {"hidden_states": np.zeros((1, 3), np.float32)}, 7,
                   None, np.zeros(2, np.float32), 24000, [lp(3)])
    m = merge_chunks(a, b)
    for f in dataclasses.fields(StageDelta):  # a set every field: each is set on the merge too
        value = getattr(m, f.name)
        assert value is not None and not (isinstance(value, (list, dict, str)) and not value), f.name
    assert (m.token_ids, m.text, m.finished, m.num_computed_tokens, m.rows_start) == ([1, 2, 3], "abc", True, 8, 5)
    assert m.logprobs == [lp(1), lp(2), lp(3)] and m.prompt_token_ids == [9] * 5
    assert (m.prompt_text, m.prompt_token_texts, m.prompt_logprobs) == ("the prompt", ["the", " prompt"], [None, lp(9)])
    # the prompt's split by kind rides on the first delta only: a merge keeps it (a cancelled reply's usage needs it)
    assert (m.num_cached_tokens, m.prompt_mm_tokens, m.cached_mm_tokens) == (4, {"audio": 2}, {"audio": 1})
    np.testing.assert_array_equal(m.rows["hidden_states"], np.concatenate([np.ones((2, 3)), np.zeros((1, 3))]))
    np.testing.assert_array_equal(m.audio, np.concatenate([np.ones(4), np.zeros(2)]))
