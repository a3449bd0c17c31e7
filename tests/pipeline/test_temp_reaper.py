"""The watcher that removes an embedded Ray's temp dir when its driver dies without cleaning up."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

from omni.pipeline.ray import temp_reaper


def wait_gone(path: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)


def test_dir_is_removed_when_the_driver_is_killed():
    driver = subprocess.Popen(["sleep", "60"])
    path = tempfile.mkdtemp(prefix="omni-reaper-test-")
    open(os.path.join(path, "session.log"), "w").write("x")
    watcher = temp_reaper.watch(path, driver.pid)
    try:
        time.sleep(1.5)
        assert os.path.isdir(path)  # the driver lives: the dir stays
        os.kill(driver.pid, signal.SIGKILL)
        # not reaped yet: a zombie counts as dead. The watcher polls every 0.5 s: 60 s (120 polls)
        # only fails a watcher that never reaps.
        assert wait_gone(path, 60)
        watcher.wait(60)
    finally:
        driver.kill()
        driver.wait()
        temp_reaper.stop(watcher)


def test_watcher_ends_when_the_dir_is_removed_normally():
    path = tempfile.mkdtemp(prefix="omni-reaper-test-")
    watcher = temp_reaper.watch(path)
    os.rmdir(path)
    assert watcher.wait(10) == 0
    temp_reaper.stop(watcher)  # idempotent on a finished watcher
