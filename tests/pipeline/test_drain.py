"""Nothing ready waits behind anything else: every output a stage produced in a step leaves in the same
round (the stage worker, the backend's poll, the orchestrator), whatever else that step produced.

vLLM-Omni's orchestrator once took one output per stage replica per polling round, so a first audio
packet queued behind other requests' internal outputs (their issue #4561). Here a step in which one
request's voice stage yields its first audio while many other requests finish an intermediate stage (outputs
the driver routes on, never shown to the caller) must hand the audio to the caller in that very round.
"""
from __future__ import annotations

import time

import pytest

from omni import Omni, SamplingParams, StageDelta
from omni.messages import StageInput
from tests.fakes import AUDIO_SAMPLES, fake_factory, stage

BUSY = 8  # requests whose internal outputs share the round with the first audio


def voice_config(backend: str = "local"):
    return {
        "name": "fake_voice",
        "runtime": {"backend": backend},
        "stages": [
            stage("thinker", sampling={"max_tokens": 1}),
            stage("voice", inputs=["thinker"], final_output="tokens", sampling={"max_tokens": 3},
                  model_kwargs={"audio_deltas": True}),
        ],
    }


def audio_of(events, stage_name="voice"):
    return [e for e in events if isinstance(e, StageDelta) and e.stage == stage_name and e.audio is not None]


def test_first_audio_leaves_in_the_round_of_its_step_with_other_requests_internal_outputs():
    with Omni(voice_config(), engine_factory=fake_factory) as o:
        orch = o._orch
        orch.add_request(StageInput("b", prompt="first audio"), stream=True)
        orch.step()  # b: the thinker's step; its output is routed to the voice stage
        assert not audio_of(orch.pop_events("b"))
        for i in range(BUSY):
            orch.add_request(StageInput(f"a{i}", prompt=f"busy {i}"))
        # One round: the thinker finishes a0..a7 (outputs routed to the voice stage, not shown to any caller)
        # and the voice stage, stepped in the same round, yields b's first audio.
        orch.step()
        first = audio_of(orch.pop_events("b"))
        assert len(first) == 1 and first[0].audio.shape == (AUDIO_SAMPLES,)
        assert all({"thinker"} <= orch._reqs[f"a{i}"].finished for i in range(BUSY))  # same round, all of them
        # The next round: the voice stage has every busy request; none of them waits another round.
        orch.step()
        assert o._backend.workers["voice"].engine.max_batch == BUSY + 1
        assert len(audio_of(orch.pop_events("b"))) == 1


def test_every_delta_of_a_step_reaches_the_caller_in_that_round():
    """Many streamed requests' audio pieces of one step all reach their callers in the round of that step."""
    with Omni(voice_config(), engine_factory=fake_factory) as o:
        orch = o._orch
        rids = [f"r{i}" for i in range(BUSY)]
        for rid in rids:
            orch.add_request(StageInput(rid, prompt=f"hello {rid}"), stream=True)
        orch.step()  # the thinker, all of them in one step
        for n in (1, 2, 3):  # then each voice step's pieces, every request's, in its round
            orch.step()
            for rid in rids:
                assert len(audio_of(orch.pop_events(rid))) == 1, (rid, n)
        assert not orch.has_unfinished()


def test_streamed_audio_adds_up_on_the_public_api():
    with Omni(voice_config(), engine_factory=fake_factory) as o:
        events = list(o.stream(["x", "y"], SamplingParams(max_tokens=3)))
    for rid in {e.request_id for e in events}:
        pieces = audio_of([e for e in events if e.request_id == rid])
        final = [e for e in events if e.request_id == rid and not isinstance(e, StageDelta) and e.stage == "voice"]
        assert len(final) == 1
        assert [int(round(p.audio[0] * 1000)) for p in pieces] == final[0].token_ids


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_ray_driver_takes_every_ready_reply_of_every_actor_in_one_poll():
    """On Ray: once the voice actor has produced every request's audio and output, one poll of the driver
    hands out all of them (each request's submit() stream: its audio delta, then its output), not one
    per actor or per request."""
    pytest.importorskip("ray")
    config = voice_config("ray")
    config["stages"] = [stage("voice", final_output="tokens", sampling={"max_tokens": 1},
                              model_kwargs={"audio_deltas": True})]
    with Omni(config, engine_factory=fake_factory) as o:
        orch = o._orch
        for i in range(BUSY):
            orch.add_request(StageInput(f"r{i}", prompt=f"hello {i}"), stream=True)
        deadline = time.monotonic() + 60
        while o._backend.stats()["voice"].get("finished") != BUSY:
            assert time.monotonic() < deadline, "the voice actor did not finish"
            time.sleep(0.05)
        time.sleep(1.0)  # the actor's replies reach the driver's object store (milliseconds; a margin for load)
        events = o._backend.poll(0.0)
        audio = {e.request_id for e in events if e.delta is not None and e.delta.audio is not None}
        outputs = {e.request_id for e in events if e.summary is not None}
        assert audio == outputs == {f"r{i}" for i in range(BUSY)}
