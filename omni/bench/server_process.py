"""`omni serve CONFIG` as a child process: started, waited for, stopped.

    with serve_process("stage_configs/tiny_chain.yaml", "--port", "0") as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="none") ...

One helper for everything that needs the real command in a process of its own: `omni bench serve`
(HTTP against in-process, side by side), `omni bench realtime` (its servers start at once: serve_processes)
and the tests' smoke tests of the command itself. The server is
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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
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
    with serve_processes([(config, args)], env=env, cwd=cwd, start_timeout_s=start_timeout_s, stop=stop) as (srv,):
        yield srv


@contextlib.contextmanager
def serve_processes(servers: list[tuple[str | os.PathLike[str], Sequence[str]]], env: dict[str, str] | None = None,
                    cwd: str | os.PathLike[str] | None = None, start_timeout_s: float = 600.0,
                    stop: Callable[[subprocess.Popen], None] = terminate) -> Iterator[list[ServeProcess]]:
    """Several servers (CONFIG, ARGS) started at once (their start-ups overlap); yields once all serve, in order."""
    started: list[tuple[subprocess.Popen, Path]] = []
    try:
        for config, args in servers:
            log = Path(tempfile.mkstemp(prefix="omni-serve-", suffix=".log")[1])
            cmd = [sys.executable, "-m", "omni.cli", "serve", str(config), *args]
            with open(log, "wb") as out:
                started.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                                 start_new_session=True), log))
        deadline = time.monotonic() + start_timeout_s
        yield [ServeProcess(_serving(proc, log, deadline, start_timeout_s), proc, log) for proc, log in started]
    finally:
        with ThreadPoolExecutor(max(1, len(started))) as pool:  # stopped at once too: their drains overlap
            list(pool.map(lambda started_one: stop(started_one[0]), started))
        for _, log in started:
            log.unlink(missing_ok=True)


def _serving(proc: subprocess.Popen, log: Path, deadline: float, start_timeout_s: float) -> str:
    """The server's URL once it printed its address and /health answers 200."""
    url = None
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
    return url
