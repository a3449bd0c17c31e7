"""Omni starts (and stops) its own local Ray when none is running and no address is given (`own_ray`:
the session's shared cluster is shut down first, so this runs at the end of the session)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")  # GPU machines may run the suite without Ray

from omni import Omni
from tests.fakes import chain_config, expected_tokens, fake_factory, text_ids

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = str(Path(__file__).resolve().parents[2])


def test_embedded_ray_is_started_and_shut_down(monkeypatch, own_ray):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", REPO)  # the actors import the fake engine from tests/
    assert not ray.is_initialized()  # own_ray: the shared cluster is down
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
        # a watcher removes the dir if this driver is SIGKILLed (tests/pipeline/test_temp_reaper.py)
        watcher = o._backend._temp_watcher
        assert watcher.poll() is None and watcher.args[-2:] == [str(os.getpid()), temp_dir]
        assert os.environ["RAY_AUTH_MODE"] == "disabled"
        [out] = o.generate("embedded", use_tqdm=False)
        assert out.outputs["thinker"].token_ids == expected_tokens("thinker", text_ids("embedded"), 3)
    finally:
        o.close()
    assert not ray.is_initialized()
    assert not os.path.exists(temp_dir)
    assert watcher.poll() is not None  # stopped with the backend

