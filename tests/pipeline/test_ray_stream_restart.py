"""Ray: the consumer of a streaming edge killed mid-request and restarted. The request it held fails naming it;
the next request, submitted while the actor still restarts, waits for it (the producer's chunks go actor to actor,
fire and forget: sent to a restarting actor they would be lost, and the consumer would wait for them until its
chunk timeout) and gives the tokens of the local pipeline.

The test holds the talker (tests/gated.py: files the actors see): its engine once the long request runs there,
so the kill lands mid-request, and its restarted engine's start, so the next request is submitted while the
actor restarts, however fast the machine is."""
from __future__ import annotations

import threading
import time

import pytest

from omni import Omni, SamplingParams
from omni.errors import StageError
from tests.gated import GatedFactory, engaged, gate_files, released
from tests.pipeline.test_streaming import CONFIG, GREEDY, streaming, with_runtime

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_request_submitted_while_the_streamed_consumer_restarts_waits_for_it(ray_cluster, tmp_path):
    ray = ray_cluster
    overrides = streaming(3)
    overrides["talker"]["max_restarts"] = 1
    with Omni(CONFIG, backend="local", stage_overrides=overrides) as local:
        [ref] = local.generate(["next"], GREEDY, use_tqdm=False)
    hold, start = gate_files(tmp_path)
    factory = GatedFactory("talker", hold, start)
    # A short chunk timeout: a lost chunk fails the next request in 15 s instead of passing after 60 s.
    with Omni(with_runtime(overrides, backend="ray", request_timeout_s=120, stream_chunk_timeout_s=15),
              engine_factory=factory) as o:
        results = {}
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        engaged(hold)
        t = threading.Thread(target=lambda: results.update(out=o.generate(["a long one"], long, use_tqdm=False)))
        t.start()
        deadline = time.monotonic() + 60  # a condition wait: returns once the request runs (held) in the talker
        while o.stats()["stages"]["talker"].get("running", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert o.stats()["stages"]["talker"]["running"] == 1
        engaged(start)  # the restarted talker waits before it builds its engine
        ray.kill(o._backend.actors["talker"], no_restart=False)
        released(hold)
        t.join(120)
        assert not t.is_alive()
        err = results["out"][0].error
        assert isinstance(err, StageError) and err.stage == "talker", repr(err)
        assert err.message.startswith("stage 'talker' failed: the stage's Ray actor died"), err
        assert o._backend.replica_states("talker") == ["restarting"]
        nxt_out = {}
        t = threading.Thread(target=lambda: nxt_out.update(out=o.generate(["next"], GREEDY, use_tqdm=False)))
        t.start()
        deadline = time.monotonic() + 60  # a condition wait: the submission waits behind the talker's restart
        while not o._backend._deferred.get(("talker", 0)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert o._backend._deferred.get(("talker", 0)), "the next request was not held for the restarting talker"
        assert o._backend.replica_states("talker") == ["restarting"]
        released(start)
        t.join(120)
        assert not t.is_alive()
        [nxt] = nxt_out["out"]
        assert nxt.error is None, nxt.error
        assert nxt.outputs["talker"].token_ids == ref.outputs["talker"].token_ids
