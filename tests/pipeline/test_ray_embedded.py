"""Omni starts (and stops) its own local Ray when none is running and no address is given."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")  # GPU machines may run the suite without Ray

from omni import Omni
from tests.pipeline.test_fake_engine import chain_config, expected_tokens, fake_factory, text_ids

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = str(Path(__file__).resolve().parents[2])


def test_embedded_ray_is_started_and_shut_down(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", REPO)  # the actors import the fake engine from tests/
    if ray.is_initialized():
        ray.shutdown()
    data = chain_config()
    data["runtime"]["backend"] = "ray"
    def handler(signum, frame):  # the application's own, e.g. a server's graceful shutdown
        pass

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        o = Omni(data, engine_factory=fake_factory)
        assert signal.getsignal(signal.SIGTERM) is handler  # ray.init must not take it over
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        temp_dir = o._backend._temp_dir
        assert ray.is_initialized() and temp_dir and os.path.isdir(temp_dir)
        assert os.environ["RAY_AUTH_MODE"] == "disabled"
        [out] = o.generate("embedded", use_tqdm=False)
        assert out.outputs["thinker"].token_ids == expected_tokens("thinker", text_ids("embedded"), 3)
    finally:
        o.close()
    assert not ray.is_initialized()
    assert not os.path.exists(temp_dir)


_DRIVER = """
import time
from omni import Omni
from tests.pipeline.test_fake_engine import chain_config, fake_factory
data = chain_config()
data["runtime"]["backend"] = "ray"
o = Omni(data, engine_factory=fake_factory)
print(o._backend._temp_dir, flush=True)
time.sleep(300)
"""


def test_temp_dir_of_a_sigkilled_driver_is_removed():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = REPO
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        temp_dir = driver.stdout.readline().strip()
        assert temp_dir and os.path.isdir(temp_dir), "the driver did not start its embedded Ray"
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        deadline = time.monotonic() + 60
        while os.path.exists(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(temp_dir)
    finally:
        driver.kill()
        driver.wait()
