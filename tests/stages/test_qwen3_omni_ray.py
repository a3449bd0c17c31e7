"""Qwen3-Omni on Ray (issue 25), one streamed pipeline for the module (its three stage actors on the session's
shared cluster: one start instead of one per test):
- the thinker's rows reach the talker and the talker's frames reach code2wav actor to actor, streamed; text and
  waveform equal transformers' generate;
- a stage killed mid-request: that request fails clearly, naming the stage, and the pipeline serves the next one
  (the stage's actor restarted) with the output it gave before the crash.

The talker's engine is held by the test (tests/gated.py: a file the actor sees) once the request runs there, so
the request is still in the talker when `ray.kill` lands, however fast the machine is."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from omni import Omni
from omni.config.loader import load_config
from omni.errors import StageError
from omni.pipeline.threads import stage_threads
from tests.gated import GatedFactory, engaged, gate_files, released
from tests.stages.qwen3_omni_utils import cases, hf_reference

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = Path(__file__).resolve().parents[2] / "stage_configs" / "qwen3_omni_tiny.yaml"
# Streaming edges (as the small config has them), the sampling transformers' reference runs with (qwen3_omni_utils);
# a restarted talker loads a fresh worker, hence the long timeout.
OVERRIDES = {"thinker": {"sampling": {"temperature": 0.0, "max_tokens": 10}},
             "talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}], "max_restarts": 1,
                        "sampling": {"temperature": 0.0, "max_tokens": 30, "repetition_penalty": 1.05}},
             "code2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 2}]}}
# More than one talker step (min_tokens masks the codec eos): the request is still running after its first step.
LONG = {"talker": {"temperature": 0.0, "max_tokens": 40, "min_tokens": 40, "repetition_penalty": 1.05}}


@pytest.fixture(scope="module")
def hold(tmp_path_factory):
    return gate_files(tmp_path_factory.mktemp("gates"))[0]


@pytest.fixture(scope="module")
def pipeline(ray_cluster, hold):
    cfg = load_config(CONFIG, OVERRIDES).model_dump()
    cfg["runtime"]["request_timeout_s"] = 120
    data = load_config(cfg)
    with Omni(data, engine_factory=GatedFactory("talker", hold)) as o:  # not held until the test says so
        yield data, o


def test_streamed_pipeline_on_ray_actor_to_actor(pipeline):
    data, omni = pipeline
    inputs = [inp for inp in cases() if inp.request_id in ("short", "audio")]
    prompts = [{"prompt": inp.prompt, "request_id": inp.request_id,
                **({"multi_modal_data": {"audio": (inp.mm_inputs[0].data, 16000)}} if inp.mm_inputs else {})}
               for inp in inputs]
    outs = {r.request_id: r for r in omni.generate(prompts, use_tqdm=False)}
    # The waveform is bit for bit transformers' when both sum in the same order: on as many torch threads as
    # the code2wav actor runs (its num_cpus), whatever this process's count (`make test` workers: 1; one
    # process, PYTEST_WORKERS=0: every core).
    [c2w] = [s for s in data.stages if s.name == "code2wav"]
    threads = stage_threads(c2w.resources.num_cpus)
    for inp in inputs:
        r = outs[inp.request_id]
        assert r.error is None, r.error
        ref_tokens, _, ref_wav = hf_reference("tiny", inp, threads=threads)
        assert r.outputs["thinker"].token_ids == ref_tokens
        np.testing.assert_array_equal(r.outputs["code2wav"].audio, ref_wav)


def test_a_talker_killed_mid_request_fails_it_and_the_pipeline_serves_the_next(pipeline, hold, ray_cluster):
    ray = ray_cluster
    _, o = pipeline
    [before] = o.generate([{"prompt": "Hello there, who are you?", "request_id": "before"}], use_tqdm=False)
    assert before.error is None, before.error
    pid_before = o.stats()["stages"]["talker"]["pid"]
    engaged(hold)
    results = {}
    t = threading.Thread(target=lambda: results.update(out=o.generate(
        [{"prompt": "Tell me a long story.", "request_id": "killed"}], LONG, use_tqdm=False)))
    t.start()
    deadline = time.monotonic() + 60  # a condition wait: returns once the request runs (held) in the talker
    while o.stats()["stages"]["talker"].get("running", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert o.stats()["stages"]["talker"]["running"] == 1  # held mid-request
    # ... and the thinker done with it (a loaded machine may still be generating its reply): its part is reported
    while o.stats()["stages"]["thinker"].get("running", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert o.stats()["stages"]["thinker"]["running"] == 0
    ray.kill(o._backend.actors["talker"], no_restart=False)
    released(hold)  # the restarted talker runs freely
    t.join(120)
    assert not t.is_alive()
    [killed] = results["out"]
    # Detected (the actor died), not timed out (that message would name request_timeout_s).
    assert isinstance(killed.error, StageError) and killed.error.stage == "talker", repr(killed.error)
    assert killed.error.message.startswith("stage 'talker' failed: the stage's Ray actor died"), killed.error
    assert killed.outputs["thinker"].token_ids  # the thinker's part is still reported
    # The restarted talker serves the next request, with the same text and waveform as before the crash.
    [after] = o.generate([{"prompt": "Hello there, who are you?", "request_id": "after"}], use_tqdm=False)
    assert after.error is None, after.error
    assert o.stats()["stages"]["talker"]["pid"] != pid_before
    assert after.outputs["thinker"].token_ids == before.outputs["thinker"].token_ids
    assert len(after.outputs["code2wav"].audio) > 0
    np.testing.assert_array_equal(after.outputs["code2wav"].audio, before.outputs["code2wav"].audio)


def test_a_video_with_its_processor_setting_crosses_to_the_thinker_actor(pipeline):
    """A video named by path (read into its bytes by the API) and the request's mm_processor_kwargs reach the thinker
    actor; its reply equals transformers' generate on the same tensors, and the talker voices it."""
    from tests.stages.qwen3_omni_utils import hf_thinker_tokens
    from tests.stages.video_utils import DATA, QUESTION, video_request

    _, omni = pipeline
    [r] = omni.generate([{"prompt": QUESTION, "multi_modal_data": {"video": str(DATA / "video" / "plain.mp4")},
                          "mm_processor_kwargs": {"use_audio_in_video": False}, "request_id": "video"}],
                        use_tqdm=False)
    assert r.error is None, r.error
    want = hf_thinker_tokens(video_request("ref", "plain", False))
    assert isinstance(want, list) and r.outputs["thinker"].token_ids == want
    assert r.outputs["code2wav"].audio.size > 0
