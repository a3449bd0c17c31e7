"""Qwen3-Omni on Ray, a stage killed mid-request (issue 25): that request fails clearly, naming the stage, and the
pipeline serves the next one (the stage's actor restarted) with the output it gave before the crash.

The talker's engine is held by the test (tests/gated.py: a file the actor sees) once the request runs there, so
the request is still in the talker when `ray.kill` lands, however fast the machine is."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from omni import Omni
from omni.config_loader import load_config
from omni.errors import StageError
from tests.gated import GatedFactory, engaged, gate_files, released

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = Path(__file__).resolve().parents[2] / "stage_configs" / "qwen3_omni_tiny.yaml"
# Streaming edges (as the small config has them); a restarted talker loads a fresh worker, hence the long timeout.
OVERRIDES = {"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}], "max_restarts": 1},
             "code2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 2}]}}
# More than one talker step (min_tokens masks the codec eos): the request is still running after its first step.
LONG = {"talker": {"temperature": 0.0, "max_tokens": 40, "min_tokens": 40, "repetition_penalty": 1.05}}


def test_a_talker_killed_mid_request_fails_it_and_the_pipeline_serves_the_next(ray_cluster, tmp_path):
    ray = ray_cluster
    cfg = load_config(CONFIG, OVERRIDES).model_dump()
    cfg["runtime"]["request_timeout_s"] = 120
    hold, _ = gate_files(tmp_path)
    with Omni(load_config(cfg), engine_factory=GatedFactory("talker", hold)) as o:
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
