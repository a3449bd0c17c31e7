"""Omni.close() with requests still running: each ends at once with a BackendClosedError (nothing waits for
runtime.request_timeout_s), a stream with its final error item, and the stages are released."""
from __future__ import annotations

import threading
import time

import pytest

from omni import Omni, SamplingParams
from omni.errors import BackendClosedError
from omni.messages import StageOutput
from tests.fakes import chain_config, fake_factory

HANG = "__hang__"  # the fake engine never finishes it


def hanging_chain(backend: str = "local") -> Omni:
    data = chain_config(request_timeout_s=60)  # far past what the test waits: a hang fails it
    data["runtime"]["backend"] = backend
    return Omni(data, engine_factory=fake_factory)


def wait_running(o: Omni, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while o.stats()["stages"]["thinker"].get("running", 0) == 0:
        assert time.monotonic() < deadline, "the request never reached the thinker"
        time.sleep(0.01)


def consume_in_thread(it) -> tuple[list, threading.Event]:
    """Read a stream to its end in a thread: (what it gave, or the exception it raised; set once it ended)."""
    items: list = []
    done = threading.Event()

    def consume() -> None:
        try:
            items.extend(it)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            items.append(e)
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    return items, done


def test_close_ends_a_running_stream_with_a_closed_error():
    o = hanging_chain()
    items, done = consume_in_thread(o.stream(HANG, SamplingParams(temperature=0, max_tokens=3)))
    wait_running(o)
    t0 = time.monotonic()
    o.close()
    assert done.wait(5), "the stream still blocks after close()"
    assert time.monotonic() - t0 < 5
    assert len(items) == 1 and isinstance(items[0], StageOutput), items
    assert isinstance(items[0].error, BackendClosedError) and items[0].error.code == "shutting_down"
    assert items[0].finish_reason == "abort" and items[0].stage == "thinker"
    assert o._backend.replicas == {}  # the stages are released
    counts = o._orch.stats()["requests"]
    assert (counts["aborted"], counts["finished"], counts["in_flight"]) == (1, 0, 0)


def test_close_after_next_ends_the_stream_in_the_same_thread():
    """The QA repro: next(it); close(); the rest of the iteration."""
    o = hanging_chain()
    it = o.stream("story", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert next(it).stage == "thinker"
    o.close()
    t0 = time.monotonic()
    rest = list(it)
    assert time.monotonic() - t0 < 2
    assert isinstance(rest[-1], StageOutput) and isinstance(rest[-1].error, BackendClosedError), rest
    assert all(x.error is None for x in rest[:-1])


def test_generate_in_another_thread_ends_when_the_pipeline_closes():
    result: list = []
    done = threading.Event()
    with hanging_chain() as o:
        def run() -> None:
            try:
                result.append(o.generate(["fine", HANG], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False))
            except BaseException as e:  # noqa: BLE001 - the test reads it
                result.append(e)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        wait_running(o)
        time.sleep(0.2)  # "fine" finishes meanwhile
        t0 = time.monotonic()
    assert done.wait(5), "generate() still blocks after the pipeline closed"
    assert time.monotonic() - t0 < 5
    outs = result[0]
    assert isinstance(outs, list), outs
    assert outs[0].error is None and outs[0].outputs["talker"].token_ids
    assert isinstance(outs[1].error, BackendClosedError) and outs[1].error.request_id == "1"
    with pytest.raises(BackendClosedError):
        o.generate("again", use_tqdm=False)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_close_ends_a_running_stream(ray_cluster):
    o = hanging_chain("ray")
    try:
        items, done = consume_in_thread(o.stream(HANG, SamplingParams(temperature=0, max_tokens=3)))
        wait_running(o)
    finally:
        o.close()
    assert done.wait(10), "the stream still blocks after close()"
    assert len(items) == 1 and isinstance(items[0], StageOutput), items
    assert isinstance(items[0].error, BackendClosedError)
    assert o._backend.replica_actors == {}
