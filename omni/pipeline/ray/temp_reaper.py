"""Removes an embedded Ray's temp dir when the driver that made it dies without cleaning up.

`RayBackend.close()` (cluster.release) removes the dir itself, and so do Ctrl-C and SIGTERM on the way out.
A driver killed with SIGKILL runs no code at all, so a tiny watcher process starts with the
dir: in its own session (a Ctrl-C to the driver's process group leaves it alone), with the
stdlib only (`python -I`), it polls the driver's pid and, once the driver is gone and Ray's
processes (which share the driver's fate) have let go of the dir, removes it.
"""
from __future__ import annotations

import os
import subprocess
import sys

_WATCHER = """
import os, shutil, sys, time
pid, path = int(sys.argv[1]), sys.argv[2]

def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead, only not reaped yet
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True

while os.path.exists(path) and alive(pid):
    time.sleep(0.5)
for _ in range(60):  # Ray's processes may still be writing logs for a moment
    if not os.path.exists(path):
        break
    shutil.rmtree(path, ignore_errors=True)
    time.sleep(0.5)
"""


def watch(temp_dir: str, pid: int | None = None) -> subprocess.Popen[bytes]:
    """Start the watcher of `temp_dir` for process `pid` (default: this one). Kill it when done."""
    return subprocess.Popen(
        [sys.executable, "-I", "-c", _WATCHER, str(pid or os.getpid()), temp_dir],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def stop(watcher: subprocess.Popen[bytes] | None) -> None:
    if watcher is not None and watcher.poll() is None:
        watcher.kill()
        watcher.wait()
