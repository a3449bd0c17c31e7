"""Routing decisions: the Router alone, then the orchestrator driving a scripted fake backend with replicas
(affinity, fallback on imbalance and on a short match, eviction feedback, dead and lost replicas)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from omni.config.loader import load_config
from omni.errors import StageError
from omni.messages import CacheReport, StageInput, StageOutput, error_output
from omni.pipeline.backend import StageEvent, Submission
from omni.pipeline.graph import StageGraph
from omni.pipeline.orchestrator import Orchestrator
from omni.pipeline.routing.keys import text_hashes, token_hashes
from omni.pipeline.routing.policy import Router, RouterSettings
from tests.fakes import stage


def keys(*blocks: int) -> list[bytes]:
    """Chained keys for a prefix made of the given block ids."""
    out, ids = [], []
    for b in blocks:
        ids += [b] * 4
    return token_hashes(ids, 4, 0)


def router(n=2, policy="prefix_affinity", **kw) -> Router:
    return Router("s", n, RouterSettings(policy, **kw))


UP2 = [True, True]


# ------------------------------------------------------------------ the Router alone
def test_affinity_follows_the_longest_cached_prefix():
    r = router(3)
    conv = keys(1, 2, 3, 4)
    r.started(2, conv)  # the first turn went to replica 2
    r.ended(2)
    r.started(0, keys(9, 9))  # replica 0 is busier and holds something else
    d = r.choose(keys(1, 2, 3, 4, 5, 6), [True] * 3)
    assert (d.replica, d.reason, d.matched) == (2, "affinity", 4)


def test_a_short_match_goes_to_the_least_loaded_replica():
    r = router(min_match_ratio=0.5)
    r.started(0, keys(1))  # only the shared first block is cached on replica 0, which is busy
    d = r.choose(keys(1, 5, 6, 7), UP2)
    assert (d.replica, d.reason) == (1, "short_match")
    assert r.choose(keys(1, 5), UP2).reason == "affinity"  # half the prompt: long enough


def test_imbalance_overrides_affinity_with_the_less_loaded_of_two():
    r = router(imbalance_threshold=2)
    conv = keys(1, 2, 3)
    r.started(0, conv)
    r.started(0, None)
    assert r.choose(conv, UP2).reason == "affinity"  # 2 in flight vs 0: spread 2, not above the threshold
    r.started(0, None)
    d = r.choose(conv, UP2)
    assert (d.replica, d.reason) == (1, "imbalance")


def test_evictions_reported_by_a_replica_end_its_affinity():
    r = router()
    conv = keys(1, 2, 3, 4)
    r.started(0, conv)
    r.ended(0)
    r.started(1, None)  # replica 1 busier: only affinity keeps requests on replica 0
    assert r.choose(conv, UP2).replica == 0
    r.cache_report(0, conv[1:], overflow=False)  # blocks 1.. were evicted on replica 0
    d = r.choose(conv, UP2)
    assert (d.reason, d.replica) == ("short_match", 0) and d.matched == 1  # 1 of 4 blocks: too short
    assert r.stats()["evictions_applied"] == 3
    r.cache_report(0, [], overflow=True)  # more evictions than logged: nothing known still stands
    assert r.summaries[0].match(conv) == 0 and r.stats()["summary_resets"] == 1


def test_a_hit_shorter_than_predicted_trims_the_summary():
    r = router(capacity=100)
    r.started(0, keys(7, 8, 9, 10, 11, 12))  # older entries
    conv = keys(1, 2, 3, 4)
    r.started(0, conv)
    r.finished(0, predicted=4, obtained=1, keys=conv, aligned=True)
    st = r.stats()
    assert st["shortfalls"] == 1 and st["predicted_hit_blocks"] == 4 and st["obtained_hit_blocks"] == 1
    # The 3 least recently used blocks are forgotten; the request's own blocks (cached now) stay.
    assert len(r.summaries[0]) == 10 - 3 and r.summaries[0].match(conv) == 4
    assert r.summaries[0].match(keys(7, 8, 9, 10)) == 0


def test_only_blocks_a_finished_request_left_are_a_predicted_hit():
    r = router(min_match_ratio=0.5)
    first = keys(1, 2, 3, 4)
    r.started(0, first)  # in flight: its blocks may not be computed when the next request is scheduled
    r.started(1, None)  # replica 1 busier: the next request follows the prefix, not the load
    d = r.choose(keys(1, 2, 3, 4, 5), UP2)
    assert (d.replica, d.reason, d.matched, d.expected) == (0, "affinity", 4, 0)
    r.started(0, keys(1, 2, 3, 4, 5))
    # Both were scheduled in one step: the second hit nothing, as predicted; nothing is trimmed for it.
    r.finished(0, predicted=d.expected, obtained=0, keys=keys(1, 2, 3, 4, 5), aligned=True)
    assert r.stats()["shortfalls"] == 0 and r.summaries[0].match(first) == 4
    r.finished(0, predicted=0, obtained=0, keys=first, aligned=True)
    # Finished: confirmed, so the next turn's hit is predicted (and a shorter one would be a shortfall).
    d = r.choose(keys(1, 2, 3, 4, 5, 6), UP2)
    assert (d.replica, d.matched, d.expected) == (0, 5, 5)
    r.started(0, keys(1, 2, 3, 4, 5, 6, 7))  # recorded again in flight: still confirmed
    assert r.summaries[0].confirmed(keys(1, 2, 3, 4, 5, 6, 7)) == 5


def test_summary_is_bounded_lru():
    r = router(capacity=6)
    a, b = keys(1, 2, 3, 4), keys(5, 6, 7, 8)
    r.started(0, a)
    r.started(0, b)
    assert len(r.summaries[0]) == 6 and r.summaries[0].match(b) == 4 and r.summaries[0].match(a) == 0


def test_replicas_that_are_not_live_get_nothing_while_another_is():
    r = router()
    conv = keys(1, 2, 3)
    r.started(0, conv)
    d = r.choose(conv, [False, True])
    assert d.replica == 1
    assert r.choose(conv, [False, False]).replica == 0  # none live: the backend holds it until one is back
    assert r.choose(conv, UP2, exclude=(0,)).replica == 1
    with pytest.raises(ValueError, match="no replica left"):
        r.choose(conv, UP2, exclude=(0, 1))


def test_round_robin_and_least_loaded():
    rr = router(3, "round_robin")
    assert [rr.choose(None, [True] * 3).replica for _ in range(5)] == [0, 1, 2, 0, 1]
    ll = router(3, "least_loaded")
    ll.started(0, None)
    picks = [ll.choose(None, [True] * 3).replica for _ in range(4)]
    assert set(picks) == {1, 2}  # ties rotate between the idle ones
    assert ll.summaries[0].match(keys(1)) == 0  # no summaries without prefix_affinity


def test_text_keys_share_the_conversation_prefix():
    turn1 = "system: be brief. " * 10 + "user: hello"
    turn2 = turn1 + " assistant: hi there, what can I do? user: tell me more about the weather"
    a, b = text_hashes(turn1), text_hashes(turn2)
    assert a and b[:len(a)] == a and len(b) > len(a)
    assert text_hashes(turn1, "salt")[0] != a[0]


# --------------------------------------------------- the orchestrator on a scripted backend
@dataclass
class Sub:
    stage: str
    replica: int
    rid: str
    upstream: Any
    stream_to: tuple = ()


@dataclass
class ScriptedBackend:
    """Records submissions; the test decides what each replica answers."""

    replicas: dict[str, int]
    submits: list[Sub] = field(default_factory=list)
    aborts: list[tuple[str, str, int]] = field(default_factory=list)
    events: list[StageEvent] = field(default_factory=list)
    states: dict[str, list[str]] = field(default_factory=dict)

    def submit(self, sub: Submission):
        self.submits.append(Sub(sub.stage, sub.replica, sub.request_id, sub.upstream, sub.stream_to))

    def poll(self, timeout_s):
        out, self.events = self.events, []
        return out

    def abort(self, stage, request_id, replica=0):
        self.aborts.append((stage, request_id, replica))

    def replica_states(self, stage):
        return self.states.get(stage, ["up"] * self.replicas[stage])

    def stats(self):
        return {}

    def close(self):
        pass

    def where(self, stage, rid) -> int:
        return [s.replica for s in self.submits if s.stage == stage and s.rid == rid][-1]

    def finish(self, stage, rid, prompt, output, cached=0, report=None, replica=None):
        replica = self.where(stage, rid) if replica is None else replica
        out = StageOutput(rid, stage, prompt_token_ids=list(prompt), token_ids=list(output),
                          num_cached_tokens=cached, cache_report=report)
        self.events.append(StageEvent(stage, rid, out, handle=f"{stage}/{rid}", replica=replica))


def orchestrator(*stages: dict, **top) -> tuple[Orchestrator, ScriptedBackend]:
    cfg = load_config({"name": "t", "runtime": {"backend": "local"}, "stages": list(stages), **top})
    graph = StageGraph(cfg.stages)
    backend = ScriptedBackend({s.name: s.replicas for s in cfg.stages})
    return Orchestrator(graph, backend), backend


BLOCK = 4


def chain(replicas=2, **router_kw):
    cache = {"block_size": BLOCK}
    return orchestrator(
        stage("thinker", replicas=replicas, cache=cache, router=router_kw, sampling={"max_tokens": 2}),
        stage("talker", inputs=["thinker"], input_processor="fake_hidden_to_embeds", replicas=replicas, cache=cache,
              router=router_kw, final_output="tokens"))


def run_turn(orch, be, rid, prompt, reply=(7, 8), cached=(0, 0)):
    orch.add_request(StageInput(rid, prompt_token_ids=prompt))
    orch.step()
    be.finish("thinker", rid, prompt, reply, cached=cached[0])
    orch.step()
    be.finish("talker", rid, [0] * (len(prompt) + len(reply) - 1), [1], cached=cached[1])
    orch.step()
    out = orch.pop_result(rid)
    assert out is not None and out.error is None, out
    return out


def test_conversations_keep_their_replicas_at_every_stage():
    orch, be = chain()
    conv = {c: list(range(100 * c + 1, 100 * c + 21)) for c in (1, 2)}  # 5 blocks each, different
    for turn in range(3):
        for c in (1, 2):
            rid = f"c{c}t{turn}"
            run_turn(orch, be, rid, conv[c])
            conv[c] = conv[c] + [7, 8] + [c] * 6  # the reply and the next user message
    homes = {c: {(s.stage, s.replica) for s in be.submits if s.rid.startswith(f"c{c}")} for c in (1, 2)}
    assert all(len({r for st, r in h if st == "thinker"}) == 1 for h in homes.values()), homes
    assert all(len({r for st, r in h if st == "talker"}) == 1 for h in homes.values()), homes
    th = [r for st, r in homes[1] if st == "thinker"] + [r for st, r in homes[2] if st == "thinker"]
    assert sorted(th) == [0, 1]  # the two conversations were spread over both replicas
    stats = orch.stats()["routers"]
    assert stats["thinker"]["decisions"]["affinity"] >= 4 and stats["talker"]["decisions"]["affinity"] >= 4
    assert stats["thinker"]["in_flight"] == [0, 0]  # every finished request released its replica


def test_eviction_reported_in_a_summary_sends_the_next_turn_by_load():
    orch, be = chain()
    prompt = list(range(1, 21))
    run_turn(orch, be, "a", prompt)
    home = be.where("thinker", "a")
    run_turn(orch, be, "a2", prompt + [7, 8, 3, 3])
    decisions = orch.stats()["routers"]["thinker"]["decisions"]
    assert be.where("thinker", "a2") == home and decisions["affinity"] == 1
    # Whatever request the home replica finishes next carries its evictions: the conversation's blocks.
    orch.add_request(StageInput("other", prompt_token_ids=[900] * 8))
    orch.step()
    evicted = token_hashes(prompt + [7, 8, 3, 3, 7, 8], BLOCK, 0)
    be.finish("thinker", "other", [900] * 8, [1], report=CacheReport(evicted), replica=home)
    orch.step()
    assert orch.stats()["routers"]["thinker"]["evictions_applied"] == len(evicted)
    orch.add_request(StageInput("a3", prompt_token_ids=prompt + [7, 8, 3, 3, 7, 8, 4, 4]))
    decisions = orch.stats()["routers"]["thinker"]["decisions"]
    assert decisions["affinity"] == 1 and decisions["short_match"] == 3  # turn 1, "other", and now turn 3


def test_a_streaming_consumer_replica_is_chosen_with_its_producer():
    orch, be = orchestrator(
        stage("thinker", replicas=2, sampling={"max_tokens": 2}),
        stage("talker", inputs=[{"stage": "thinker", "stream": True}], replicas=2, final_output="tokens"))
    for i in range(4):
        orch.add_request(StageInput(f"r{i}", prompt_token_ids=[i + 1] * 40))
    producers = [s for s in be.submits if s.stage == "thinker"]
    consumers = {s.rid: s.replica for s in be.submits if s.stage == "talker"}
    for p in producers:
        [target] = p.stream_to
        assert target.stage == "talker" and target.replica == consumers[p.rid]  # chunks go to that replica
    assert set(consumers.values()) == {0, 1}


def test_a_lost_request_is_retried_once_on_another_replica_and_answered_once():
    orch, be = chain()
    prompt = list(range(1, 21))
    orch.add_request(StageInput("r", prompt_token_ids=prompt))
    orch.step()
    first = be.where("thinker", "r")
    be.states["thinker"] = ["up", "up"]
    be.states["thinker"][first] = "restarting"
    be.events.append(StageEvent("thinker", "r", error_output("thinker", "r", f"replica {first}: died"),
                                replica=first, replica_lost=True))
    orch.step()
    second = be.where("thinker", "r")
    assert second != first and ("thinker", "r", first) in be.aborts
    # A late answer from the replica it left is dropped; the new replica's answer counts.
    be.finish("thinker", "r", prompt, [5], replica=first)
    orch.step()
    assert not any(s.stage == "talker" for s in be.submits)
    be.finish("thinker", "r", prompt, [5], replica=second)
    orch.step()
    be.finish("talker", "r", [0] * 20, [1])
    orch.step()
    out = orch.pop_result("r")
    assert out.error is None and orch.pop_result("r") is None
    assert orch.stats()["stages"]["thinker"]["retried"] == 1
    assert orch.stats()["requests"]["finished"] == 1


def test_a_second_loss_or_the_fail_policy_fails_clearly():
    orch, be = chain(on_replica_failure="fail")
    orch.add_request(StageInput("r", prompt_token_ids=[1] * 12))
    orch.step()
    rep = be.where("thinker", "r")
    be.events.append(StageEvent("thinker", "r", error_output("thinker", "r", f"replica {rep}: the actor died"),
                                replica=rep, replica_lost=True))
    orch.step()
    out = orch.pop_result("r")
    assert out.error == StageError(f"stage 'thinker' failed: replica {rep}: the actor died "
                                   "(not retried: router.on_replica_failure is 'fail')", stage="thinker", request_id="r")

    orch, be = chain()
    orch.add_request(StageInput("r", prompt_token_ids=[1] * 12))
    orch.step()
    for _ in range(2):
        rep = be.where("thinker", "r")
        be.events.append(StageEvent("thinker", "r", error_output("thinker", "r", "died"), replica=rep,
                                    replica_lost=True))
        orch.step()
    assert orch.pop_result("r").error == StageError(
        "stage 'thinker' failed: died (not retried: it was retried once already)", stage="thinker", request_id="r")


def test_dead_replicas_are_never_chosen_while_another_serves():
    orch, be = chain()
    be.states["thinker"] = ["dead", "up"]
    for i in range(5):
        orch.add_request(StageInput(f"r{i}", prompt_token_ids=[i + 1] * 12))
    assert {s.replica for s in be.submits if s.stage == "thinker"} == {1}
    be.states["thinker"] = ["up", "restarting"]
    orch.add_request(StageInput("x", prompt_token_ids=[1] * 12))  # replica 1 holds its prefix, but restarts
    assert be.where("thinker", "x") == 0


def test_a_downstream_stage_is_retried_with_the_same_upstream_output():
    orch, be = chain()
    prompt = list(range(1, 13))
    orch.add_request(StageInput("r", prompt_token_ids=prompt))
    orch.step()
    be.finish("thinker", "r", prompt, [5, 6])
    orch.step()
    [first] = [s for s in be.submits if s.stage == "talker"]
    assert first.upstream == {"thinker": "thinker/r"}
    be.events.append(StageEvent("talker", "r", error_output("talker", "r", "died"), replica=first.replica,
                                replica_lost=True))
    orch.step()
    second = [s for s in be.submits if s.stage == "talker"][-1]
    assert second.replica != first.replica and second.upstream == first.upstream  # the thinker is not rerun
    assert [s.stage for s in be.submits].count("thinker") == 1
    be.finish("talker", "r", [0] * 13, [1])
    orch.step()
    assert orch.pop_result("r").error is None


def test_requests_in_one_voice_share_their_voice_blocks_whatever_they_say():
    """A text-to-speech prompt starts with its voice's reference: the voice is whole text blocks of its own, so two
    requests in one voice share a prefix key (prefix affinity sends them where the reference is cached)."""
    from omni.messages import StageInput
    from omni.pipeline.routing.keys import prompt_text

    def keys(text: str, **extra) -> list[bytes]:
        return text_hashes(prompt_text(StageInput("r", prompt=text, extra=extra)))

    a, b = keys("The sun rises.", speaker="alice"), keys("Rain tomorrow.", speaker="alice")
    c = keys("The sun rises.", speaker="bob")
    assert a[0] == b[0] and a[0] != c[0]
    assert keys("Hi.", reference_text="My own clip's words.")[0] != a[0]
    assert keys("x" * 64) == text_hashes("x" * 64)  # no voice: the prompt's text alone, as before
