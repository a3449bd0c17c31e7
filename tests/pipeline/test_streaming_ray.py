"""Streaming edges on Ray (tiny_chain: thinker ~> talker, chunks actor to actor), one pipeline for the module (its
two stage actors on the session's shared cluster: one start instead of one per test):
- the streamed tokens and text equal the local pipeline's; the producer killed while it streams fails the request
  naming the edge and frees the consumer's blocks; the next request, submitted while the producer restarts, waits
  for it on both stages (the consumer sent at once would start its first-chunk clock, and fail after
  stream_chunk_timeout_s however slow the producer's restart) and gives the tokens of the local pipeline;
- the consumer killed mid-request and restarted: the request it held fails naming it; the next request, submitted
  while the actor still restarts, waits for it (the producer's chunks go actor to actor, fire and forget: sent to
  a restarting actor they would be lost, and the consumer would wait for them until its chunk timeout) and gives
  the tokens of the local pipeline.

The test holds the stages (tests/gated.py: files the actors see): the thinker's engine after 10 steps of a long
request (so the kill lands while it streams into the talker), the talker's engine once a long request runs there
(so the kill lands mid-request), and each restarted engine's start (so the next request is submitted while the
actor restarts), however fast or slow the machine is."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from omni import Omni, RequestOutput, SamplingParams
from omni.errors import StageError
from omni.pipeline.backend import Submission
from tests.gated import GatedFactory, engaged, gate_files, released
from tests.pipeline.test_streaming import CONFIG, GREEDY, PROMPTS, collect, streaming, with_runtime

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # no early EOS: still streaming


@pytest.fixture(scope="module")
def reference():
    """The local pipeline's outputs of PROMPTS, then of "next"."""
    with Omni(CONFIG, backend="local", stage_overrides=streaming(3)) as o:
        return o.generate([*PROMPTS, "next"], GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    """(thinker hold, talker hold, talker start, thinker start) files."""
    thinker_dir, talker_dir = tmp_path_factory.mktemp("thinker"), tmp_path_factory.mktemp("talker")
    return gate_files(thinker_dir)[0], *gate_files(talker_dir), gate_files(thinker_dir)[1]


@pytest.fixture(scope="module")
def pipeline(ray_cluster, gates):
    thinker_hold, talker_hold, talker_start, thinker_start = gates
    factory = GatedFactory("thinker", thinker_hold, thinker_start, after_steps=10,
                           inner=GatedFactory("talker", talker_hold, talker_start))
    # tiny_chain restarts each stage's actor once (max_restarts: 1). A short chunk timeout: a chunk lost to a
    # restarting consumer fails the next request in 15 s instead of passing after 60 s.
    with Omni(with_runtime(streaming(3), backend="ray", request_timeout_s=120, stream_chunk_timeout_s=15),
              engine_factory=factory) as o:
        yield o


def killed_mid_request(ray, o: Omni, hold: str, victim: str) -> StageError:
    """Run a long request with `hold` engaged; once it runs (held) in the talker, kill `victim`'s actor and
    release the hold. The request's error."""
    results = {}
    engaged(hold)
    t = threading.Thread(target=lambda: results.update(out=o.generate(["a long one"], LONG, use_tqdm=False)))
    t.start()
    deadline = time.monotonic() + 60  # a condition wait: returns once the request runs (held) in the talker
    while o.stats()["stages"]["talker"].get("running", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert o.stats()["stages"]["talker"]["running"] == 1
    ray.kill(o._backend.actors[victim], no_restart=False)
    released(hold)
    t.join(120)
    assert not t.is_alive()
    return results["out"][0].error


def test_streaming_on_ray_matches_local_and_survives_a_killed_upstream(reference, pipeline, gates, ray_cluster):
    ray, o, (hold, _, _, start) = ray_cluster, pipeline, gates
    deltas, finals = collect(o, PROMPTS)
    for ref in reference[:len(PROMPTS)]:
        assert finals[(ref.request_id, "talker")].token_ids == ref.outputs["talker"].token_ids
        assert "".join(d.text for d in deltas[(ref.request_id, "thinker")]) == finals[(ref.request_id, "thinker")].text
    # Kill the thinker while a long request streams into the talker (held after 10 tokens, 190 to go).
    engaged(start)  # the restarted thinker will wait before it builds its engine
    err = killed_mid_request(ray, o, hold, "thinker")
    assert isinstance(err, StageError) and err.stage == "thinker", repr(err)
    assert "stage 'thinker' failed" in err.message and "thinker -> talker" in err.message, err
    # The abort reaches the talker's actor asynchronously: a condition wait, returns once it has.
    deadline = time.monotonic() + 60
    while (stats := o.stats()["stages"]["talker"])["kv_usage"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["kv_usage"] == 0.0 and stats["waiting_for_chunks"] == 0 and stats["running"] == 0
    nxt = submitted_while_restarting(o, "thinker", start)
    assert [a.stage for a in nxt.held] == ["thinker", "talker"], "the consumer was sent before its producer's restart"
    assert nxt.out.error is None, nxt.out.error
    assert nxt.out.outputs["talker"].token_ids == reference[-1].outputs["talker"].token_ids


def test_a_request_submitted_while_the_streamed_consumer_restarts_waits_for_it(reference, pipeline, gates, ray_cluster):
    ray, o, (_, hold, start, _) = ray_cluster, pipeline, gates
    engaged(start)  # the restarted talker will wait before it builds its engine
    err = killed_mid_request(ray, o, hold, "talker")
    assert isinstance(err, StageError) and err.stage == "talker", repr(err)
    assert err.message.startswith("stage 'talker' failed: the stage's Ray actor died"), err
    assert o._backend.replica_states("talker") == ["restarting"]
    nxt = submitted_while_restarting(o, "talker", start)
    assert [a.stage for a in nxt.held] == ["thinker", "talker"], "the producer was sent before its consumer's restart"
    assert nxt.out.error is None, nxt.out.error
    assert nxt.out.outputs["talker"].token_ids == reference[-1].outputs["talker"].token_ids


@dataclass
class Held:
    held: list[Submission]  # what waited behind the restarting replica's gate, in the order it waited
    out: RequestOutput  # the request's output once the replica came back


def submitted_while_restarting(o: Omni, stage: str, start: str) -> Held:
    """Submit "next" while `stage`'s actor restarts (held at its engaged `start` gate); once the submission waits
    behind the actor's gate, release the start. What waited, and the output."""
    assert o._backend.replica_states(stage) == ["restarting"]
    out = {}
    t = threading.Thread(target=lambda: out.update(out=o.generate(["next"], GREEDY, use_tqdm=False)))
    t.start()
    deadline = time.monotonic() + 60  # a condition wait: the submission waits behind the restart
    while len(o._backend._deferred.get((stage, 0), [])) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    held = list(o._backend._deferred.get((stage, 0), []))
    assert o._backend.replica_states(stage) == ["restarting"]
    released(start)
    t.join(120)
    assert not t.is_alive()
    return Held(held, out["out"][0])
