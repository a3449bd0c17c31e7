"""A Ctrl-C or SIGTERM while the embedded Ray starts (omni/pipeline/ray/cluster.py): held until ray.init returns,
then the node is stopped, its leftovers reaped and its temp dir removed, and the signal takes its own way out
(interrupted midway, ray.init left the node's agents orphaned for a minute and sometimes crashed the driver on
its way out). ray.init is replaced here by a stand-in that signals this process as the real one would be
signalled; no Ray starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from omni.config.schema import RuntimeConfig
from omni.pipeline.ray import cluster


@pytest.fixture
def fake_ray(monkeypatch):
    calls: list[str] = []
    made: dict[str, str] = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: calls.append("shutdown"))
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(prefix: str = "") -> str:
        made["dir"] = real_mkdtemp(prefix=prefix)
        return made["dir"]

    monkeypatch.setattr(cluster.tempfile, "mkdtemp", mkdtemp)
    return calls, made


def _handlers(sigint, sigterm):
    return signal.signal(signal.SIGINT, sigint), signal.signal(signal.SIGTERM, sigterm)


def test_ctrl_c_during_ray_init_waits_for_it_then_lets_go(fake_ray, monkeypatch):
    calls, made = fake_ray

    def init(**kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C while the node starts
        time.sleep(0.05)
        calls.append("init finished")  # not interrupted midway

    monkeypatch.setattr(cluster.ray, "init", init)
    previous = _handlers(signal.default_int_handler, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.init_ray(RuntimeConfig(), [])
        assert calls == ["init finished", "shutdown"]
        assert not os.path.exists(made["dir"])  # the temp dir went with the node
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        _handlers(*previous)


def test_sigterm_during_ray_init_takes_the_applications_way_out(fake_ray, monkeypatch):
    """ray.init sets its own SIGTERM handler (sys.exit(15)) as it begins: a SIGTERM then surfaces as SystemExit;
    the node is let go of and the application's handler (the CLI's: 143) runs, not Ray's exit code 15."""
    calls, made = fake_ray
    seen: list[int] = []

    def app_handler(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    def init(**kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init does first
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)

    monkeypatch.setattr(cluster.ray, "init", init)
    previous = _handlers(signal.default_int_handler, app_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.init_ray(RuntimeConfig(), [])
        assert seen == [signal.SIGTERM] and calls == ["shutdown"] and not os.path.exists(made["dir"])
        assert signal.getsignal(signal.SIGTERM) is app_handler  # the application's handler, not Ray's
    finally:
        _handlers(*previous)


def test_an_ignored_ctrl_c_stays_ignored(fake_ray, monkeypatch):
    calls, _ = fake_ray
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: calls.append("init"))
    previous = _handlers(signal.SIG_IGN, signal.SIG_DFL)
    try:
        owns, temp_dir, watcher = cluster.init_ray(RuntimeConfig(), [])
        assert owns and calls == ["init"] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        cluster.release([], owns, temp_dir, watcher, 5.0)
        assert not os.path.exists(temp_dir)
    finally:
        _handlers(*previous)


def test_processes_left_holding_the_nodes_files_are_reaped():
    """What ray.shutdown left of the node (agents holding its log files open) is stopped; other processes are not."""
    temp_dir = tempfile.mkdtemp(prefix="omni-ray-test-")
    log = os.path.join(temp_dir, "agent.log")
    holder = subprocess.Popen([sys.executable, "-c", f"import time; f = open({log!r}, 'w'); time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(log) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        cluster._reap(temp_dir)
        assert holder.wait(10) is not None
        assert other.poll() is None
    finally:
        for p in (holder, other):
            p.kill()
            p.wait()
        os.remove(log)
        os.rmdir(temp_dir)
