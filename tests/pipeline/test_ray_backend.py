"""Ray backend with the fake engine: same outputs as local, batching, failures, restarts.

On the session's shared Ray cluster (tests/conftest.py: `ray_cluster`).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

ray = pytest.importorskip("ray")  # GPU machines may run the suite without Ray

from omni import Omni, SamplingParams
from omni.errors import ConfigError, RequestAbortedError, RequestTimeoutError, StageError, StageStartError
from omni.messages import StageOutput
from omni.stage_info import StageInfo
from tests.fakes import chain_config, diamond_config, embeds_ids, expected_tokens, fake_factory, text_ids

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.ray, pytest.mark.slow]


def ray_chain(**runtime):
    data = chain_config(**runtime)
    data["runtime"]["backend"] = "ray"
    return data


def summary(outs):
    return [(o.request_id, o.error, {s: (so.token_ids, so.text, so.prompt_token_ids) for s, so in o.outputs.items()})
            for o in outs]


@pytest.fixture(scope="module")
def _chain():
    data = ray_chain()
    data["stages"][1]["model_kwargs"] = {"voices": ["Ethan", "Chelsie"]}  # the talker's StageInfo names them
    with Omni(data, engine_factory=fake_factory) as o:
        yield o


def assert_idle(o: Omni, timeout_s: float = 30.0) -> None:
    """Nothing in flight in the pipeline, nothing running in any stage actor (aborts land asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = o.stats()
        busy = {n: s.get("running") for n, s in st["stages"].items() if s.get("running")}
        if not busy and st["requests"]["in_flight"] == 0:
            return
        assert time.monotonic() < deadline, (busy, st["requests"])
        time.sleep(0.05)


@pytest.fixture
def chain(_chain):
    """The module's default Ray chain (its actors started once), idle again after each test."""
    yield _chain
    assert_idle(_chain)


def test_ray_and_local_give_identical_outputs(chain):
    prompts = ["hello", "world", "__error__", {"prompt_token_ids": [5, 6, 7]}, "__bad__", "x" * 50, "__value_error__"]
    with Omni(chain_config(), backend="local", engine_factory=fake_factory) as local:
        expected = summary(local.generate(prompts, use_tqdm=False))
    got = summary(chain.generate(prompts, use_tqdm=False))
    # ids restart per Omni instance; compare everything else
    assert [g[1:] for g in got] == [e[1:] for e in expected]
    # The error crossed from the actor as itself: the same typed error as on the local backend.
    assert got[2][1] == StageError("stage 'thinker' failed: fake stage error", stage="thinker", request_id="2")
    # A bare ValueError raised in the actor is the stage's fault there too, not the caller's.
    assert got[6][1] == StageError("stage 'thinker' failed: could not admit the request: ValueError: rows: expected 2 "
                                   "dimensions, got 3", stage="thinker", request_id="6")


def test_ray_and_local_identical_on_a_dag():
    data = diamond_config()
    prompts = [f"p{i}" for i in range(5)]
    with Omni(data, backend="local", engine_factory=fake_factory) as local:
        expected = summary(local.generate(prompts, use_tqdm=False))
    with Omni(data, backend="ray", engine_factory=fake_factory) as remote:
        assert remote.backend == "ray"
        got = summary(remote.generate(prompts, use_tqdm=False))
    assert got == expected


def test_hidden_states_go_actor_to_actor():
    data = ray_chain()
    data["stages"][1]["input_processor"] = "fake_hidden_to_embeds"
    with Omni(data, engine_factory=fake_factory) as o:
        [out] = o.generate("abcd", use_tqdm=False, return_hidden_states=True)
    thinker, talker = out.outputs["thinker"], out.outputs["talker"]
    assert thinker.hidden_states.shape == (4 + 3 - 1, 4)
    assert talker.prompt_token_ids == embeds_ids(thinker.hidden_states)  # the talker got the array
    assert talker.hidden_states is not None  # requested


def test_concurrent_requests_are_batched_in_the_actor():
    data = ray_chain()
    data["stages"][0]["model_kwargs"] = {"step_delay_s": 0.02}
    data["stages"][0]["sampling"] = {"max_tokens": 5}
    with Omni(data, engine_factory=fake_factory) as o:
        outs = o.generate([f"q{i}" for i in range(8)], use_tqdm=False)
        assert all(x.error is None for x in outs)
        st = o.stats()["stages"]["thinker"]
    assert st["max_batch"] >= 4, st  # one step loop serves all concurrent requests
    assert st["steps"] < 8 * 5


def test_stream_and_stats_on_ray(chain):
    events = list(chain.stream(["s1", "s2"]))
    assert len(events) == 4 and all(e.error is None for e in events)
    for rid in {e.request_id for e in events}:
        assert [e.stage for e in events if e.request_id == rid] == ["thinker", "talker"]
    st = chain.stats()
    assert st["backend"] == "ray"
    for name in ("thinker", "talker"):
        assert {"running", "waiting", "kv_usage", "prefix_cache_hit_rate", "pid", "orchestrator"} <= set(st["stages"][name])
    assert st["stages"]["thinker"]["pid"] != os.getpid()


def test_stage_info_crosses_from_the_actors_once_at_start(chain, monkeypatch):
    """Each stage's StageInfo came from its actor as the pipeline started: voices() and the other facts ask no
    actor again (no stats() round trip)."""
    def no_stats(self):
        raise AssertionError("stats() was called")

    monkeypatch.setattr(type(chain._backend), "stats", no_stats)
    assert chain._backend.infos["talker"] == StageInfo(voices=("Ethan", "Chelsie"))
    assert chain.voices() == ("Chelsie", "Ethan")
    assert chain.context_reserve() == 2 + 8 and chain.min_spoken_tokens() == 1 and chain.shows_tools() is None


def test_tokenize_runs_in_the_stage_actor_and_its_errors_keep_their_type(chain):
    """Omni.tokenize / detokenize on Ray: the entry stage's actor computes them (its pid, not the driver's), and a
    stage's refusal comes back as the stage raised it (a RequestError naming its field), not Ray's wrapper."""
    from omni.errors import RequestError

    out = chain.tokenize("hi")
    assert out["tokens"] == text_ids("hi") and out["max_model_len"] != os.getpid()  # (the fake's pid)
    assert chain.detokenize([104, 105]) == "hi"
    with pytest.raises(RequestError) as e:
        chain.tokenize("__bad__")
    assert (e.value.field, e.value.code, e.value.stage) == ("prompt", "bad_prompt", "thinker")


def test_streams_from_several_threads_at_once():
    """Omni is thread-safe: several threads stream at once, each polling the backend (the submit()
    generators one thread reads to their end must not be waited on by another)."""
    data = ray_chain()
    for s in data["stages"]:
        s.update(model_kwargs={"step_delay_s": 0.005}, sampling={"max_tokens": 10})
    with Omni(data, engine_factory=fake_factory) as o:
        def one(k: int) -> list:
            evs = []
            for i in range(10):
                evs += list(o.stream([{"prompt": "x" * (3 + 7 * j), "request_id": f"t{k}-{i}-{j}"} for j in range(5)]))
            return evs

        with ThreadPoolExecutor(4) as pool:
            events = [ev for evs in pool.map(one, range(4)) for ev in evs]
    outs = [e for e in events if isinstance(e, StageOutput)]
    assert len(outs) == 4 * 10 * 5 * 2 and all(e.error is None for e in outs), [e.error for e in outs if e.error][:3]


def test_timeout_and_abort_on_ray():
    data = ray_chain(request_timeout_s=2.0)
    data["stages"][0]["model_kwargs"] = {"step_delay_s": 0.01}
    with Omni(data, engine_factory=fake_factory) as o:
        t0 = time.monotonic()
        [hung] = o.generate(["__hang__"], use_tqdm=False)  # never finishes, by construction
        # It cannot time out before its 2 s; 60 s (30x) only catches a timeout that never fires.
        assert 2.0 <= time.monotonic() - t0 < 60
        assert isinstance(hung.error, RequestTimeoutError) and hung.error.limit == 2
        assert "timed out after 2s (runtime.request_timeout_s) waiting for stage(s) thinker" in hung.error.message
        # The stage serves the next request (after, not beside, the hung one: a request racing the
        # 2 s timeout would pass or fail with the machine's speed).
        [fine] = o.generate(["fine"], use_tqdm=False)
        assert fine.error is None

        def abort_once_submitted():  # as soon as the driver knows the request, not after a guessed delay
            deadline = time.monotonic() + 60
            while not o.abort("victim") and time.monotonic() < deadline:
                time.sleep(0.01)

        threading.Thread(target=abort_once_submitted).start()
        [aborted] = o.generate([{"prompt": "__hang__", "request_id": "victim"}], use_tqdm=False)
        assert aborted.error == RequestAbortedError("request 'victim' was aborted", request_id="victim")
        deadline = time.monotonic() + 60  # aborts reach the actor asynchronously; returns when they have
        while o.stats()["stages"]["thinker"]["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert o.stats()["stages"]["thinker"]["running"] == 0  # removed from the engine too


def test_finished_and_aborted_ids_are_reused_on_ray(chain):
    [first] = chain.generate([{"prompt": "x", "request_id": "same"}], use_tqdm=False)
    [again] = chain.generate([{"prompt": "y", "request_id": "same"}], use_tqdm=False)
    assert first.error is None and again.error is None
    assert again.outputs["thinker"].token_ids == expected_tokens("thinker", text_ids("y"), 3)
    def abort_once_running():
        deadline = time.monotonic() + 30
        while not chain.abort("gone") and time.monotonic() < deadline:
            time.sleep(0.05)

    # An id reused at once after its abort: the abort reaches the actor asynchronously, and an async actor may run
    # the new submission first; it waits for that abort (Submission.after), never failing as "already in use" nor
    # answered as aborted. Several rounds: the race went one way or the other by timing.
    for round_ in range(4):
        threading.Thread(target=abort_once_running).start()
        [aborted] = chain.stream([{"prompt": "__hang__", "request_id": "gone"}])
        assert aborted.error == RequestAbortedError("request 'gone' was aborted", stage="thinker",
                                                    request_id="gone"), round_
        [reused] = chain.generate([{"prompt": "z", "request_id": "gone"}], use_tqdm=False)
        assert reused.error is None and reused.outputs["talker"].token_ids, (round_, reused.error)


def test_killed_stage_fails_in_flight_requests_and_restarts():
    data = ray_chain(request_timeout_s=120)  # the restart loads a fresh worker
    th = data["stages"][0]
    th.update(max_restarts=1, model_kwargs={"step_delay_s": 0.05}, sampling={"max_tokens": 20})
    with Omni(data, engine_factory=fake_factory) as o:
        pid_before = o.stats()["stages"]["thinker"]["pid"]
        # The two others never finish on their own: in flight when the crash comes, on any machine.
        outs = o.generate(["__hang__ 1", "__hang__ 2", "__crash__"], use_tqdm=False)
        for out in outs:  # detected (the message), not timed out (that would name request_timeout_s)
            assert isinstance(out.error, StageError) and out.error.stage == "thinker", repr(out.error)
            assert out.error.message.startswith("stage 'thinker' failed: the stage's Ray actor died"), out.error
        # the restarted actor serves the next request
        [nxt] = o.generate(["after the crash"], use_tqdm=False)
        assert nxt.error is None
        assert nxt.outputs["thinker"].token_ids == expected_tokens("thinker", text_ids("after the crash"), 20)
        assert o.stats()["stages"]["thinker"]["pid"] != pid_before


def test_ray_kill_of_a_downstream_stage_mid_request():
    data = ray_chain(request_timeout_s=120)  # the restart loads a fresh worker
    tk = data["stages"][1]
    tk.update(max_restarts=1, model_kwargs={"step_delay_s": 0.05}, sampling={"max_tokens": 40})
    with Omni(data, engine_factory=fake_factory) as o:
        actor = o._backend.actors["talker"]
        results = {}
        t = threading.Thread(target=lambda: results.update(outs=o.generate(["a", "b"], use_tqdm=False)))
        t.start()
        deadline = time.monotonic() + 60  # a condition wait: returns once both reached the talker
        while o.stats()["stages"]["talker"].get("running", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Killed within one poll of both running; they need 40 steps of 0.05 s (2 s) to finish.
        assert o.stats()["stages"]["talker"].get("running", 0) == 2
        ray.kill(actor, no_restart=False)
        t.join(30)
        assert not t.is_alive()
        for out in results["outs"]:
            assert isinstance(out.error, StageError) and out.error.stage == "talker", repr(out.error)
            assert out.error.message.startswith("stage 'talker' failed: the stage's Ray actor died"), out.error
            assert out.outputs["thinker"].token_ids  # the thinker's part is still reported
        [nxt] = o.generate(["c"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert nxt.error is None


def test_dead_stage_without_restarts_fails_fast_and_clearly():
    data = ray_chain(request_timeout_s=120)
    data["stages"][0]["max_restarts"] = 0
    with Omni(data, engine_factory=fake_factory) as o:
        [crashed] = o.generate(["__crash__"], use_tqdm=False)
        assert "stage 'thinker' failed: the stage's Ray actor died" in crashed.error.message
        [later] = o.generate(["hello"], use_tqdm=False)
        # Fails fast: the message says the actor is dead (a wait would end naming request_timeout_s).
        assert "stage 'thinker' failed: the stage's Ray actor is dead and will not restart (max_restarts=0)" \
            in later.error.message
        assert "error" in o.stats()["stages"]["thinker"]


def test_stage_that_fails_to_start():
    def broken(stage):
        if stage.name == "talker":
            raise OSError("weights not found")
        return fake_factory(stage)

    with pytest.raises(StageStartError) as ei:
        Omni(ray_chain(), engine_factory=broken)
    assert "stage 'talker' failed to start" in str(ei.value) and "weights not found" in str(ei.value)


def test_resources_that_fit_a_node_but_are_taken_time_out_with_a_clear_error():
    # The shared cluster's one node has 8 CPUs: each stage fits it alone, not both at once. The one placed
    # second waits for CPUs that may be freed (other actors go), until its stage_start_timeout_s.
    data = ray_chain(stage_start_timeout_s=2)
    for s in data["stages"]:
        s["resources"] = {"num_cpus": 5}
    t0 = time.monotonic()
    with pytest.raises(StageStartError) as ei:
        Omni(data, engine_factory=fake_factory)
    assert time.monotonic() - t0 >= 2.0  # waited its stage_start_timeout_s; the message says which limit
    msg = str(ei.value)
    assert "did not start within 2s (runtime.stage_start_timeout_s)" in msg
    assert "Requested resources:" in msg and "'num_cpus': 5.0" in msg and "'CPU'" in msg


@pytest.mark.parametrize("resources,field,key,amount", [
    ({"num_cpus": 64}, "resources.num_cpus", "CPU", 64),
    ({"num_gpus": 4}, "resources.num_gpus", "GPU", 4),
    ({"custom": {"tpu_pod": 1}}, "resources.custom.tpu_pod", "tpu_pod", 1),
])
def test_resources_no_node_has_fail_at_once_naming_the_numbers(resources, field, key, amount):
    data = ray_chain(stage_start_timeout_s=120)  # waiting it out would take minutes
    data["stages"][1]["resources"] = resources
    most = ray.cluster_resources().get(key, 0.0)  # the shared cluster is one node: its total is the node's
    t0 = time.monotonic()
    with pytest.raises(StageStartError) as ei:
        Omni(data, engine_factory=fake_factory)
    assert time.monotonic() - t0 < 10.0  # refused, not waited for (expected: well under a second)
    e = ei.value
    assert (e.stage, e.field, e.code, e.actual, e.limit) == ("talker", field, "insufficient_resources", amount, most)
    assert str(e).startswith(f"stage 'talker': {field}: the stage's actor asks for {amount:g} {key}, but no node "
                             f"of the Ray cluster has that many (the most any of its 1 node(s) has: {most:g})")
    # Nothing was started: a pipeline that fits opens on the same cluster at once.
    with Omni(ray_chain(), engine_factory=fake_factory) as o:
        assert o.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False)[0].error is None


def test_a_demand_each_part_of_which_is_on_another_node_is_refused(monkeypatch):
    """An actor runs on one node: CPUs on one node and a GPU on another do not make a place for it."""
    from omni.config.loader import load_config
    from omni.pipeline.ray import cluster

    nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "memory": 1e9}},
             {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]  # a dead node holds nothing
    monkeypatch.setattr(cluster.ray, "nodes", lambda: nodes)
    data = ray_chain()
    data["stages"][1]["resources"] = {"num_cpus": 4, "num_gpus": 1}
    with pytest.raises(StageStartError) as ei:
        cluster.check_fits(load_config(data).stages)
    assert (ei.value.stage, ei.value.field) == ("talker", "resources")
    assert str(ei.value) == ("stage 'talker': resources: the stage's actor asks for 4 CPU, 1 GPU on one node, but "
                             "no node of the Ray cluster has all of it (its nodes: 8 CPU, 0 GPU; 2 CPU, 1 GPU; on an "
                             "autoscaling cluster, runtime.wait_for_nodes: true waits up to stage_start_timeout_s "
                             "for one)")
    data["stages"][1]["resources"] = {"num_gpus": 8}
    with pytest.raises(StageStartError, match=r"resources\.num_gpus: .* asks for 8 GPU, .*\(the most any of its "
                                              r"2 node\(s\) has: 1\)"):
        cluster.check_fits(load_config(data).stages)
    data["stages"][1]["resources"] = {"num_cpus": 2, "num_gpus": 0.5}  # fits the second node
    cluster.check_fits(load_config(data).stages)


def test_cuda_stage_without_gpu_reservation_is_a_config_error():
    data = ray_chain()
    data["stages"][0]["device"] = "cuda"
    with pytest.raises(ConfigError, match="stage 'thinker': device: 'cuda' needs resources.num_gpus > 0"):
        Omni(data, engine_factory=fake_factory)


def test_close_kills_the_actors_but_not_a_ray_it_did_not_start():
    o = Omni(ray_chain(), engine_factory=fake_factory)
    actor = o._backend.actors["thinker"]
    o.close()
    assert ray.is_initialized()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.ready.remote(), timeout=30)


def test_numpy_outputs_only(chain):
    [out] = chain.generate("np", use_tqdm=False, return_hidden_states=True)
    assert isinstance(out.outputs["thinker"].hidden_states, np.ndarray)


def test_wait_for_nodes_waits_for_a_node_instead_of_refusing():
    """An autoscaling cluster adds a node for a pending actor: runtime.wait_for_nodes leaves the demand to Ray,
    which the stage's start timeout then bounds (the timeout's error, not the refusal)."""
    data = ray_chain(stage_start_timeout_s=2)
    data["runtime"]["wait_for_nodes"] = True
    data["stages"][1]["resources"] = {"custom": {"tpu_pod": 1}}
    t0 = time.monotonic()
    with pytest.raises(StageStartError) as ei:
        Omni(data, engine_factory=fake_factory)
    assert time.monotonic() - t0 >= 2.0
    assert "did not start within 2s (runtime.stage_start_timeout_s)" in str(ei.value)
    assert ei.value.code != "insufficient_resources"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_actors_start_is_held_then_delivered_once_they_are_gone(sig):
    """Ctrl-C / SIGTERM while the stage actors load: interrupted midway, a Ray call could end in an abort in Ray's
    native code. The signal is held (cluster.HeldSignals), the wait for the actors ends within a slice, the actors
    are killed, and only then does the application's own handler run (the CLI's: exit 130 / 143)."""
    def slow(stage):  # runs in the actor while it starts
        time.sleep(30)
        return fake_factory(stage)

    seen: list[tuple[int, set[str]]] = []
    names_before = set(ray.util.list_named_actors())

    def app_handler(signum, frame):  # what the CLI installs: record, then take KeyboardInterrupt's way out
        seen.append((signum, set(ray.util.list_named_actors()) - names_before))  # stage actors still there
        raise KeyboardInterrupt

    previous = signal.signal(sig, app_handler)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), sig))
    try:
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            Omni(ray_chain(stage_start_timeout_s=60), engine_factory=slow)
        took = time.monotonic() - t0
    finally:
        timer.cancel()
        signal.signal(sig, previous)
    # Delivered once, to the application's handler, once no stage actor was left (not inside a Ray wait).
    assert seen == [(sig, set())]
    assert took < 20, took  # not the actors' 30 s load, nor the 60 s start timeout
