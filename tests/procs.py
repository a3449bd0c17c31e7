"""Helpers for tests that start real processes (a Ray cluster, `omni serve`): free ports, process
trees, log tails. Everything they start is stopped by pid or process group, never by name."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def descendants(pid: int) -> set[int]:
    """All processes below `pid` (Ray's workers start their own sessions, so the process group misses them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_tree(proc: subprocess.Popen, grace_s: float = 5.0, *, group: bool = True) -> None:
    """SIGTERM `proc`'s process group (started with start_new_session=True; `group=False`: `proc` alone, which
    then shuts down what it started itself), give it `grace_s`, then SIGKILL whatever of it (or below it) is left."""
    spawned = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in spawned):
        time.sleep(0.2)
    for p in spawned:
        if alive(p):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_until_up(proc: subprocess.Popen, log: Path, url: Callable[[], str | None], what: str,
                  timeout_s: float, interval_s: float = 0.2) -> str:
    """Wait until GET url() answers 200 (url() may be None until the process says where it listens); fails
    the test with the log's tail if the process exits first or `timeout_s` passes. Returns the URL."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        if (address := url()) is not None:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(address, timeout=5) as r:
                    if r.status == 200:
                        return address
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not come up within {timeout_s:g}s:\n{tail(log)}")
        time.sleep(interval_s)
