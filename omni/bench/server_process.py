"""`omni serve CONFIG` as a child process: started, waited for, stopped.

    with serve_process("stage_configs/tiny_chain.yaml", "--port", "0") as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="none") ...

One helper for everything that needs the real command in a process of its own: `omni bench serve`
(HTTP against in-process, side by side) and the tests' smoke tests of the command itself. The server is
up once it printed its address line (`omni serve: NAME on http://HOST:PORT`, so `--port 0` works) and
/health answers 200. It runs in a session of its own, so stopping it reaches whatever it started.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

LISTEN_RE = re.compile(r"omni serve: \S+ on (http://[\w.:\[\]]+)")


@dataclass
class ServeProcess:
    url: str  # http://HOST:PORT
    proc: subprocess.Popen
    log: Path  # stdout and stderr of the server


def healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    return False


def terminate(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM (the server drains and closes its pipeline), then SIGKILL to its session past `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextlib.contextmanager
def serve_process(config: str | os.PathLike[str], *args: str, env: dict[str, str] | None = None,
                  cwd: str | os.PathLike[str] | None = None, start_timeout_s: float = 600.0,
                  stop: Callable[[subprocess.Popen], None] = terminate) -> Iterator[ServeProcess]:
    """Run `python -m omni.cli serve CONFIG ARGS...`; yields once it serves; `stop(proc)` on the way out."""
    log = Path(tempfile.mkstemp(prefix="omni-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "omni.cli", "serve", str(config), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
    try:
        deadline, url = time.monotonic() + start_timeout_s, None
        while url is None or not healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"omni serve exited with status {proc.returncode} before it served:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"omni serve did not serve within {start_timeout_s:g} s:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            m = LISTEN_RE.search(log.read_text(errors="replace"))
            url = m.group(1) if m else None
            time.sleep(0.1)
        yield ServeProcess(url, proc, log)
    finally:
        stop(proc)
        log.unlink(missing_ok=True)
