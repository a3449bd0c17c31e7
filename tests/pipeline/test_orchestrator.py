"""Request routing on the local backend with the fake engine (no model, fast)."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from omni import Omni, RequestOutput, SamplingParams, StageOutput
from omni.errors import (BackendClosedError, ConfigError, RequestAbortedError, RequestError, RequestTimeoutError,
                         StageError, StageStartError)
from omni.messages import StageInput
from omni.pipeline.stage_worker import build_stage_input, passthrough_tokens, summarize
from tests.fakes import (HIDDEN, chain_config, diamond_config, expected_tokens, fake_factory, stage,
                         text_ids)


@pytest.fixture
def chain():
    with Omni(chain_config(), engine_factory=fake_factory) as o:
        yield o


def test_chain_routes_tokens_downstream(chain):
    [out] = chain.generate("hi", use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.error is None and out.finished
    think = expected_tokens("thinker", text_ids("hi"), 3)
    talk = expected_tokens("talker", think, 2)
    assert list(out.outputs) == ["thinker", "talker"]
    assert out.outputs["thinker"].token_ids == think
    assert out.outputs["talker"].prompt_token_ids == think  # passthrough of generated ids
    assert out.outputs["talker"].token_ids == talk
    assert out.text == "thinker:" + ",".join(map(str, think)) and out.prompt == "hi"


def test_results_in_input_order_and_batched(chain):
    prompts = [f"prompt {i}" for i in range(12)]
    outs = chain.generate(prompts, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for p, o in zip(prompts, outs):
        assert o.outputs["thinker"].token_ids == expected_tokens("thinker", text_ids(p), 3)
    stats = chain.stats()
    assert stats["stages"]["thinker"]["max_batch"] == 12  # all requests shared the steps
    assert stats["requests"]["finished"] == 12 and stats["requests"]["in_flight"] == 0
    assert stats["stages"]["talker"]["orchestrator"]["completed"] == 12


def test_fan_out_fan_in():
    with Omni(diamond_config(), engine_factory=fake_factory) as o:
        [out] = o.generate("x", use_tqdm=False)
    a = expected_tokens("a", text_ids("x"), 2)
    b, c = expected_tokens("b", a, 2), expected_tokens("c", a, 3)
    d_prompt = [1000] + b + [1001] + c  # tagged_concat of both upstreams, in `inputs` order
    assert list(out.outputs) == ["d"]
    assert out.outputs["d"].prompt_token_ids == d_prompt
    assert out.outputs["d"].token_ids == expected_tokens("d", d_prompt, 2)


def test_fan_in_waits_for_the_slowest_upstream():
    data = diamond_config()
    data["stages"][2]["sampling"] = {"max_tokens": 9}  # c is much slower than b
    with Omni(data, engine_factory=fake_factory) as o:
        [out] = o.generate("x", use_tqdm=False)
        assert o.stats()["stages"]["d"]["orchestrator"]["submitted"] == 1
    assert out.error is None and len(out.outputs["d"].prompt_token_ids) == 1 + 2 + 1 + 9


def test_default_fan_in_concatenates_in_inputs_order():
    data = diamond_config()
    data["stages"][3].pop("input_processor")
    with Omni(data, engine_factory=fake_factory) as o:
        [out] = o.generate("x", use_tqdm=False)
    a = expected_tokens("a", text_ids("x"), 2)
    assert out.outputs["d"].prompt_token_ids == expected_tokens("b", a, 2) + expected_tokens("c", a, 3)


@pytest.mark.parametrize("bad,error", [
    ("__error__", StageError("stage 'thinker' failed: fake stage error", stage="thinker", request_id="1")),
    ("__bad__", RequestError("stage 'thinker' failed: prompt: contains __bad__", stage="thinker", field="prompt",
                             request_id="1")),
    # a bare ValueError is no request check: the stage's fault (a 500), not the caller's
    ("__value_error__", StageError("stage 'thinker' failed: could not admit the request: ValueError: rows: expected 2 "
                                   "dimensions, got 3", stage="thinker", request_id="1")),
])
def test_error_in_one_request_does_not_affect_others(chain, bad, error):
    outs = chain.generate(["ok 1", bad, "ok 2"], use_tqdm=False)
    assert [o.error for o in outs] == [None, error, None]  # typed: the class, stage, code and request id
    assert outs[1].outputs == {} and outs[1].finished
    assert outs[2].outputs["talker"].token_ids  # the stage kept serving
    assert chain.stats()["requests"]["failed"] == 1


def test_a_bare_value_error_in_a_stage_fails_that_request_as_the_stages_with_its_traceback(chain, caplog):
    with caplog.at_level(logging.ERROR, logger="omni.pipeline.stage_worker"):
        bad, ok = chain.generate(["__value_error__", "ok"], use_tqdm=False)
    assert isinstance(bad.error, StageError) and not isinstance(bad.error, RequestError)
    assert bad.error.code == "stage_failed" and bad.error.stage == "thinker"
    [record] = [r for r in caplog.records if "admitting" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is ValueError  # the traceback is in the log
    assert ok.error is None and ok.outputs["talker"].token_ids  # the stage kept serving
    assert chain.generate(["fine"], use_tqdm=False)[0].error is None


def test_engine_step_exception_fails_in_flight_requests_only(chain):
    outs = chain.generate(["__step_raise__"], use_tqdm=False)
    assert outs[0].error == StageError("stage 'thinker' failed: engine step failed: RuntimeError: boom",
                                       stage="thinker", request_id="0")
    assert chain.generate(["fine"], use_tqdm=False)[0].error is None


def test_error_in_downstream_stage_names_it_and_keeps_upstream_output():
    data = chain_config()
    data["stages"][1]["input_processor"] = "tests.pipeline.test_orchestrator:exploding_processor"
    with Omni(data, engine_factory=fake_factory) as o:
        [out] = o.generate("hi", use_tqdm=False)
    assert isinstance(out.error, StageError) and out.error.stage == "talker"
    assert out.error.message.startswith("stage 'talker' failed: input processor")
    assert "KeyError" in out.error.message
    assert out.outputs["thinker"].token_ids  # what did finish is still reported


def exploding_processor(upstream, request):
    raise KeyError("no such thing")


def test_timeout_fails_the_request_clearly():
    with Omni(chain_config(request_timeout_s=1.0), engine_factory=fake_factory) as o:
        t0 = time.monotonic()
        outs = o.generate(["__hang__", "fast"], use_tqdm=False)  # __hang__ never finishes, by construction
        # It cannot time out before its 1 s; 60 s (60x) only catches a timeout that never fires.
        assert 1.0 <= time.monotonic() - t0 < 60
        assert outs[0].error == RequestTimeoutError(
            "request '0' timed out after 1s (runtime.request_timeout_s) waiting for stage(s) thinker",
            stage="thinker", limit=1.0, request_id="0")
        assert outs[1].error is None
        st = o.stats()
        assert st["requests"]["timed_out"] == 1 and st["stages"]["thinker"]["running"] == 0  # aborted there


def test_abort_from_another_thread():
    data = chain_config()
    data["stages"][0]["model_kwargs"] = {"step_delay_s": 0.01}
    with Omni(data, engine_factory=fake_factory) as o:
        def abort_once_submitted():  # retried until the driver knows the request: no guessed delay
            deadline = time.monotonic() + 60
            while not o.abort("victim") and time.monotonic() < deadline:
                time.sleep(0.01)

        threading.Thread(target=abort_once_submitted).start()
        outs = o.generate([{"prompt": "__hang__", "request_id": "victim"}, "fine"], use_tqdm=False)
        assert outs[0].error == RequestAbortedError("request 'victim' was aborted", request_id="victim")
        assert outs[1].error is None
        assert o.abort("victim") is False  # no longer running
        st = o.stats()
        assert st["requests"]["aborted"] == 1 and st["stages"]["thinker"]["running"] == 0


def test_stream_yields_final_outputs_as_stages_finish(chain):
    events = list(chain.stream(["a", "__error__"]))
    by_req = {}
    for ev in events:
        assert isinstance(ev, StageOutput)
        by_req.setdefault(ev.request_id, []).append(ev)
    ok, bad = by_req["0"], by_req["1"]
    assert [e.stage for e in ok] == ["thinker", "talker"]  # thinker's text before talker's tokens
    assert len(bad) == 1 and bad[0].stage == "thinker" and "fake stage error" in bad[0].error.message


def test_final_outputs_carry_what_their_input_stages_generated():
    """The chain's talker output says how many tokens its thinker generated (a vocoder's says its talker's: usage's
    audio tokens), in generate's outputs and in a stream; the entry stage's has no inputs."""
    with Omni(chain_config(), engine_factory=fake_factory) as o:
        [out] = o.generate("hi", use_tqdm=False)
        streamed = [ev for ev in o.stream("hi") if isinstance(ev, StageOutput)]
    assert out.outputs["talker"].upstream_tokens == {"thinker": 3} and out.outputs["thinker"].upstream_tokens == {}
    assert [(e.stage, e.upstream_tokens) for e in streamed] == [("thinker", {}), ("talker", {"thinker": 3})]


def test_a_final_output_polled_before_its_producer_waits_for_its_count():
    """On Ray a consumer on a streaming edge may be polled finished before its producer (two actors, no order
    between their events): its output reaches the caller only once the producer's count is known, with it."""
    from omni.config.loader import load_config
    from omni.pipeline.backend import StageEvent
    from omni.pipeline.graph import StageGraph
    from omni.pipeline.orchestrator import Orchestrator

    cfg = load_config({"name": "voice", "runtime": {"backend": "local"}, "stages": [
        stage("thinker", final_output="text"), stage("talker", inputs=["thinker"]),
        stage("vocoder", inputs=[{"stage": "talker", "stream": True}], final_output="audio")]})

    class Scripted:  # the events the test hands it, in its order
        def __init__(self):
            self.submitted, self.events = [], []

        def submit(self, sub):
            self.submitted.append(sub.stage)

        def poll(self, timeout_s):
            events, self.events = self.events, []
            return events

        def abort(self, stage, request_id, replica=0):
            pass

    backend = Scripted()
    orch = Orchestrator(StageGraph(cfg.stages), backend)
    orch.add_request(StageInput("r", prompt="hi"), stream=True)
    done = lambda stage, n: StageEvent(stage, "r", StageOutput("r", stage, token_ids=list(range(n))))  # noqa: E731
    backend.events = [done("thinker", 4)]
    orch.step()
    assert backend.submitted == ["thinker", "talker", "vocoder"]
    assert [(e.stage, e.upstream_tokens) for e in orch.pop_events("r")] == [("thinker", {})]
    backend.events = [done("vocoder", 0)]
    orch.step()
    assert orch.pop_events("r") == [] and not orch.is_done("r")  # held: the talker's count is not known yet
    backend.events = [done("talker", 7)]
    orch.step()
    assert [(e.stage, e.upstream_tokens) for e in orch.pop_events("r")] == [("vocoder", {"talker": 7})]
    assert orch.pop_result("r").outputs["vocoder"].upstream_tokens == {"talker": 7}


def test_stream_close_aborts_the_rest():
    with Omni(chain_config(), engine_factory=fake_factory) as o:
        it = o.stream(["a", "__hang__"])
        first = next(it)
        assert first.request_id == "0"
        it.close()  # request 0 still runs on the talker, request 1 on the thinker
        st = o.stats()
        assert st["requests"]["in_flight"] == 0 and st["requests"]["aborted"] == 2
        assert st["stages"]["thinker"]["running"] == 0 and st["stages"]["talker"]["running"] == 0


def test_sampling_params_forms(chain):
    talk_default = 2
    # one SamplingParams: every stage
    [o1] = chain.generate("p", SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(o1.outputs["thinker"].token_ids) == 4 and len(o1.outputs["talker"].token_ids) == 4
    # per stage by name; a dict is merged over the stage defaults
    [o2] = chain.generate("p", {"talker": {"max_tokens": 5}}, use_tqdm=False)
    assert len(o2.outputs["thinker"].token_ids) == 3 and len(o2.outputs["talker"].token_ids) == 5
    # a list: one per stage in config order (None = defaults)
    [o3] = chain.generate("p", [SamplingParams(max_tokens=1), None], use_tqdm=False)
    assert len(o3.outputs["thinker"].token_ids) == 1 and len(o3.outputs["talker"].token_ids) == talk_default
    # a dict of fields: merged over every stage's defaults
    [o4] = chain.generate("p", {"max_tokens": 6}, use_tqdm=False)
    assert [len(o4.outputs[s].token_ids) for s in ("thinker", "talker")] == [6, 6]


@pytest.mark.parametrize("sp,msg", [
    ([SamplingParams()], "a list needs one entry per stage (2: thinker, talker), got 1"),
    ({"talkr": {"max_tokens": 1}}, "'talkr' is neither a stage"),
    ({"talker": {"max_tokens": 0}}, "sampling_params for stage 'talker': max_tokens: max_tokens must be"),
    ({"talker": 3}, "expected a SamplingParams or a dict"),
    (7, "expected a SamplingParams, a list or a dict"),
])
def test_sampling_params_errors(chain, sp, msg):
    with pytest.raises(ValueError) as ei:
        chain.generate("p", sp, use_tqdm=False)
    assert msg in str(ei.value)
    assert chain.stats()["requests"]["total"] == 0  # nothing was started


def test_prompt_forms(chain):
    outs = chain.generate([
        "text",
        {"prompt": "text"},
        {"prompt_token_ids": text_ids("text")},
        StageInput("mine", prompt="text"),
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"prompt_embeds": np.ones((3, HIDDEN)), "cache_salt": "s"},
        {"prompt": "x", "multi_modal_data": {"image": np.zeros((2, 2, 3)), "audio": (np.zeros(8), 16000)}},
    ], use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids == outs[3].token_ids
    assert outs[3].request_id == "mine"


@pytest.mark.parametrize("prompt,msg", [
    ({"role": "user", "content": "hi"}, "chat messages go under 'prompt'"),
    ({"promt": "x"}, "unknown key 'promt'"),
    ({"cache_salt": "x"}, "needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'"),
    ({"prompt_token_ids": ["a"]}, "prompt_token_ids: expected a list of ints"),
    ({"prompt": 3}, "expected text or a list of chat messages"),
    ({"prompt_embeds": np.ones(3)}, "prompt_embeds: expected shape [num_tokens, hidden]"),
    ({"prompt": "x", "multi_modal_data": {"smell": 1}}, "unknown modality 'smell'"),
    ({"prompt": "x", "multi_modal_data": {"video": 1}}, "multi_modal_data.video[0]: expected frames as a TxHxWxC"),
    ([1, 2, 3], "a list of ints is ambiguous"),
    (3.5, "expected a str, a dict"),
])
def test_prompt_errors(chain, prompt, msg):
    with pytest.raises(ValueError) as ei:
        chain.generate(prompt, use_tqdm=False)
    assert msg in str(ei.value)


def test_duplicate_request_id_is_rejected(chain):
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        chain.generate([{"prompt": "a", "request_id": "x"}, {"prompt": "b", "request_id": "x"}], use_tqdm=False)
    assert chain.stats()["requests"]["in_flight"] == 0  # the first one was withdrawn
    assert chain.generate([{"prompt": "a", "request_id": "x"}], use_tqdm=False)[0].error is None


def test_hidden_states_stripped_unless_requested(chain):
    [plain] = chain.generate("abc", use_tqdm=False)
    assert plain.outputs["thinker"].hidden_states is None
    [full] = chain.generate("abc", use_tqdm=False, return_hidden_states=True)
    h = full.outputs["thinker"].hidden_states
    assert h.shape == (3 + 3 - 1, HIDDEN) and h.dtype == np.float32


def test_final_output_hidden_keeps_hidden_states():
    data = chain_config()
    data["stages"][1]["final_output"] = "hidden"
    with Omni(data, engine_factory=fake_factory) as o:
        [out] = o.generate("abc", use_tqdm=False)
    assert out.outputs["talker"].hidden_states is not None
    assert out.outputs["thinker"].hidden_states is None


def test_intermediate_summary_is_small():
    out = StageOutput("r", "s", token_ids=[1], hidden_states=np.ones((2, 2)), mm_outputs={"x": np.ones((2, 1))},
                      audio=np.ones(4))
    small = summarize(out, None, keep_hidden=True)
    assert small.hidden_states is None and small.mm_outputs == {} and small.audio is None
    assert small.token_ids == [1] and out.hidden_states is not None  # the original is untouched
    final = summarize(out, "audio", keep_hidden=False)
    assert final.hidden_states is None and final.mm_outputs == {} and final.audio is not None
    assert final.passthrough == out.passthrough
    kept = summarize(out, "text", keep_hidden=True)
    assert kept.hidden_states is not None and "x" in kept.mm_outputs


def test_build_stage_input():
    req = StageInput("r", prompt="p", cache_salt="salt")
    entry = build_stage_input(None, req, None, SamplingParams(max_tokens=2))
    assert entry.prompt == "p" and entry.sampling_params.max_tokens == 2 and req.sampling_params is None
    up = {"a": StageOutput("r", "a", token_ids=[1, 2]), "b": StageOutput("r", "b", token_ids=[3])}
    down = build_stage_input(passthrough_tokens, req, up, None)
    assert down.prompt_token_ids == [1, 2, 3] and down.cache_salt == "salt" and down.request_id == "r"
    with pytest.raises(Exception, match="expected a StageInput"):
        build_stage_input(lambda u, r: "nope", req, up, None)


def test_engine_factory_failure_is_a_stage_start_error():
    def broken(stage):
        raise OSError("no weights here")

    with pytest.raises(StageStartError, match="stage 'thinker' failed to start: OSError: no weights here"):
        Omni(chain_config(), engine_factory=broken)


def test_backend_argument_and_close():
    with pytest.raises(ConfigError, match="backend: must be 'ray' or 'local'"):
        Omni(chain_config(), backend="k8s", engine_factory=fake_factory)
    o = Omni({**chain_config(), "runtime": {"backend": "ray"}}, backend="local", engine_factory=fake_factory)
    assert o.backend == "local" and o.stage_names == ["thinker", "talker"]
    o.close()
    o.close()  # idempotent
    with pytest.raises(BackendClosedError):
        o.generate("x", use_tqdm=False)


def test_stage_overrides_reach_the_engines():
    seen = {}

    def factory(stage):
        seen[stage.name] = stage.enable_prefix_caching
        return fake_factory(stage)

    with Omni(chain_config(), stage_overrides={"talker": {"enable_prefix_caching": False}}, engine_factory=factory):
        pass
    assert seen == {"thinker": True, "talker": False}


def test_several_entry_stages_get_the_prompt():
    data = {"runtime": {"backend": "local"}, "stages": [
        stage("t1", sampling={"max_tokens": 1}), stage("t2", sampling={"max_tokens": 2}),
        stage("fuse", inputs=["t1", "t2"], final_output="tokens", sampling={"max_tokens": 1})]}
    with Omni(data, engine_factory=fake_factory) as o:
        [out] = o.generate("q", use_tqdm=False)
    ids = text_ids("q")
    assert out.outputs["fuse"].prompt_token_ids == expected_tokens("t1", ids, 1) + expected_tokens("t2", ids, 2)


def test_tqdm_progress_bar(chain, capsys):
    chain.generate(["a", "b"], use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


@pytest.mark.slow
def test_pipeline_is_closed_at_interpreter_exit():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = (
        "from tests.fakes import chain_config, fake_factory\n"
        "from omni import Omni\n"
        "d = chain_config()\n"
        "d['stages'][0]['model_kwargs'] = {'announce_close': True}\n"
        "o = Omni(d, engine_factory=fake_factory)\n"
        "o.generate('x', use_tqdm=False)\n"
        "print('exiting', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["exiting", "closed", "thinker"]


def test_backend_submit_failure_fails_only_that_request(chain, monkeypatch):
    worker = chain._backend.workers["talker"]
    original = worker.submit

    def flaky(sub):
        if sub.request.prompt == "boom":
            raise ConnectionError("lost the stage")
        return original(sub)

    monkeypatch.setattr(worker, "submit", flaky)
    outs = chain.generate(["boom", "fine"], use_tqdm=False)
    assert outs[0].error == StageError("stage 'talker' failed: could not submit the request: ConnectionError: "
                                       "lost the stage", stage="talker", request_id="0")
    assert outs[0].outputs["thinker"].token_ids  # the thinker's part is kept
    assert outs[1].error is None



def test_stage_facts_are_read_once_at_start_not_through_stats(monkeypatch):
    """Omni.voices() / context_reserve() / min_spoken_tokens() / shows_tools() / input_media() answer from each
    stage's StageInfo, read once as the stages started: no stats() round trip to the stages (nor any other call to
    them)."""
    from omni.pipeline.local import LocalBackend
    from tests.fakes import FakeEngine

    asked: list[str] = []
    info = FakeEngine.info

    def counted_info(self):
        asked.append(self.name)
        return info(self)

    def no_stats(self):
        raise AssertionError("stats() was called")

    monkeypatch.setattr(FakeEngine, "info", counted_info)
    data = chain_config()
    data["stages"][1]["model_kwargs"] = {"voices": ["Ethan", "Chelsie"]}
    with Omni(data, engine_factory=fake_factory) as o:
        assert sorted(asked) == ["talker", "thinker"]  # once per stage, as the pipeline started
        monkeypatch.setattr(LocalBackend, "stats", no_stats)
        monkeypatch.setattr(FakeEngine, "stats", no_stats)
        assert o.voices() == ("Chelsie", "Ethan")
        # the talker (autoregressive) leaves room for its max_tokens and the markers; no max_model_len is known
        assert o.context_reserve() == 2 + 8
        assert o.min_spoken_tokens() == 1 and o.shows_tools() is None
        assert o.input_media() == ()  # the fakes render no prompt of their own: they take no media
        assert sorted(asked) == ["talker", "thinker"]
