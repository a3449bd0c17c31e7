"""`omni serve` for tests, two ways, one `Server` handle (the real `openai` client, raw HTTP, /metrics):

- `serve_in_process(CONFIG, *ARGS)`: the same options, parsed by omni's own parser, and the same app
  (`create_app` over an `AsyncOmni`) served by uvicorn on a thread of this process on 127.0.0.1 and a free
  port: real HTTP (streams, disconnects, curl, the examples) without a new interpreter importing torch.
  `engine_factory=` puts fake engines (tests/fakes.py) under it where the model does not matter, and
  `held(server, stage)` stops a stage from making progress, for requests that must not finish.
- `omni_serve(CONFIG, *ARGS)`: the real CLI in a subprocess (the smoke test of `omni serve` itself, and
  Ray Serve), stopped (SIGTERM, then SIGKILL) by its process group.

New server tests: a module-scoped fixture `with serve_in_process(CHAIN, "--backend", "local") as s: yield s`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import stop_tree

REPO = Path(__file__).resolve().parents[2]
CHAIN = REPO / "stage_configs" / "tiny_chain.yaml"
OMNI = REPO / "stage_configs" / "qwen2_5_omni_tiny.yaml"
START_TIMEOUT_S = 240


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    omni: Any = None  # serve_in_process: the AsyncOmni under the app
    proc: subprocess.Popen | None = None  # omni_serve: the process and its log
    log: Path | None = None
    app: Any = None  # serve_in_process: the app, and uvicorn's event loop it runs in
    loop: Any = None

    def drain(self, grace_s: float) -> Any:
        """serve_in_process: start the app's drain (what `omni serve` does on SIGTERM) in the server's loop;
        returns a concurrent Future of its result (True: everything finished within `grace_s`)."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(self.app.state.omni.drain.drain(grace_s), self.loop)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def client(self, api_key: str = "unused", **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=120, **kw)

    def async_client(self, api_key: str = "unused", **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=120, **kw)

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        """Raw POST (bytes, or JSON-encoded): (status, headers, parsed JSON body or text)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        return _send(req)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        return _send(urllib.request.Request(self.url + path, headers=headers or {}))

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """/metrics parsed with prometheus_client's parser: (sample name, sorted labels) -> value."""
        status, _, text = self.get("/metrics")
        assert status == 200, text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def stage_gauges(self, name: str) -> dict[str, float]:
        return {dict(labels)["stage"]: v for (n, labels), v in self.metrics().items() if n == name}


def upload_voice(server, name: str, clip: bytes | None, text: str | None) -> tuple[int, dict]:
    """POST /v1/audio/voices as a multipart form (as curl -F sends it)."""
    fields = {"name": name, "consent": "recorded-with-consent", **({"ref_text": text} if text is not None else {})}
    parts = [f'--B\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()]
    if clip is not None:
        parts.append(b'--B\r\nContent-Disposition: form-data; name="audio_sample"; filename="voice.wav"\r\n'
                     b"Content-Type: audio/wav\r\n\r\n" + clip + b"\r\n")
    status, _, body = server.post("/v1/audio/voices", b"".join(parts) + b"--B--\r\n",
                                  {"Content-Type": "multipart/form-data; boundary=B"})
    return status, body


def delete_voice(server, name: str) -> tuple[int, dict]:
    status, _, body = _send(urllib.request.Request(f"{server.url}/v1/audio/voices/{name}", method="DELETE"))
    return status, body


def _send(req: urllib.request.Request) -> tuple[int, dict[str, str], Any]:
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    text = raw.decode("utf-8", errors="replace")
    with contextlib.suppress(ValueError):
        return status, headers, json.loads(text)
    return status, headers, text


@contextlib.contextmanager
def omni_serve(config: Path | str, *args: str, env: dict[str, str] | None = None, port: int = 0,
               stop_grace_s: float = 20) -> Iterator[Server]:
    """Start `omni serve CONFIG --port PORT ARGS...` (the bench's own helper, omni.bench.server_process);
    yields once /health answers 200. Stopped with SIGTERM (the server closes its pipeline and whatever Ray
    it started), then SIGKILL to it and every process below it past `stop_grace_s`."""
    from omni.bench.server_process import serve_process

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with serve_process(config, "--port", str(port), *args, env=env, cwd=REPO, start_timeout_s=START_TIMEOUT_S,
                       stop=lambda proc: stop_tree(proc, grace_s=stop_grace_s, group=False)) as srv:
        yield Server(srv.url, proc=srv.proc, log=srv.log)


@contextlib.contextmanager
def serve_in_process(config: Path | str, *args: str, env: dict[str, str] | None = None,
                     engine_factory: Callable[[Any], Any] | None = None) -> Iterator[Server]:
    """`omni serve CONFIG ARGS...` in this process (see the module docstring); yields once it listens.
    `env`: variables the options read (OMNI_API_KEY). --host and --port are ignored: 127.0.0.1, a free port.
    On the way out uvicorn stops (requests in flight get UVICORN_SHUTDOWN_S), then the pipeline closes."""
    import uvicorn

    from omni.async_api import AsyncOmni
    from omni.cli.entry import build_parser
    from omni.config.loader import load_config
    from omni.serve.app import create_app
    from omni.serve.launch import UVICORN_SHUTDOWN_S, settings_from_args, with_voice_dir

    ns = build_parser().parse_args(["serve", str(config), *args])
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        settings = settings_from_args(ns)
    config = with_voice_dir(load_config(ns.config, ns.stage_overrides), ns.voice_dir)
    omni = AsyncOmni(config, backend=ns.backend, engine_factory=engine_factory)
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        # log_config=None: uvicorn leaves logging alone (its records reach pytest's capture)
        app = create_app(omni, settings)
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None,
                                               timeout_graceful_shutdown=UVICORN_SHUTDOWN_S))
        loops: list[Any] = []

        async def serve() -> None:  # uvicorn's Server.run, keeping its loop for Server.drain
            loops.append(asyncio.get_running_loop())
            await server.serve(sockets=[sock])

        thread = threading.Thread(target=asyncio.run, args=(serve(),), name="omni-serve-test", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                pytest.fail("the in-process server did not start (see the captured log)")
            time.sleep(0.02)
        try:
            yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", omni=omni, app=app, loop=loops[0])
        finally:
            server.should_exit = True
            thread.join(UVICORN_SHUTDOWN_S + 10)
    finally:
        sock.close()
        omni.shutdown()


@contextlib.contextmanager
def held(server: Any, stage: str, after_steps: int = 0,
         until: Callable[[Any], bool] | None = None) -> Iterator[threading.Event]:
    """While inside: `stage` (local backend, in this process; `server` is a Server or an AsyncOmni) makes
    no progress once its next `after_steps` engine steps ran, or, with `until`, once `until(engine)` is
    true (checked after each real step, in the step's own thread, so no step slips in between): each step
    then waits a moment and reports nothing (no token, no finish, not an error), so a request there cannot
    finish however fast the machine is. Yields the release event: set it, or leave, to let the stage go on."""
    from omni.engine.interface import EngineStepOutput

    omni = getattr(server, "omni", None) or server
    engine = omni._omni._backend.workers[stage].engine
    real_step = engine.step
    release = threading.Event()
    left = after_steps
    holding = until is not None and until(engine)

    def step() -> Any:
        nonlocal left, holding
        if until is None and left > 0:
            left -= 1
            return real_step()
        if until is not None and not holding:
            out = real_step()
            holding = until(engine)
            return out
        if release.wait(0.01):  # released while waiting: carry on
            return real_step()
        return EngineStepOutput()

    engine.step = step
    try:
        yield release
    finally:
        release.set()
        del engine.step  # the class's step again


@contextlib.contextmanager
def produced(server: Any, stage: str) -> Iterator[dict[str, list[int]]]:
    """While inside: request id -> the token ids `stage` generated for it, read off its engine's finished outputs
    (local backend, in this process; aborted requests are not in it): what usage must count."""
    omni = getattr(server, "omni", None) or server
    engine = omni._omni._backend.workers[stage].engine
    real_step = engine.step
    got: dict[str, list[int]] = {}

    def step() -> Any:
        out = real_step()
        for o in out.finished:
            if o.error is None:
                got[o.request_id] = list(o.token_ids)
        return out

    engine.step = step
    try:
        yield got
    finally:
        del engine.step


def generating(n: int) -> Callable[[Any], bool]:
    """For `held(until=...)`: `n` requests of the stage have sampled at least one token."""
    return lambda engine: sum(r.num_output_tokens > 0 for r in engine.scheduler.running) >= n


def wait_idle(server: Server, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no stage runs, waits for or holds anything (KV usage 0); the KV usage per stage."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        kv = {dict(k[1])["stage"]: v for k, v in m.items() if k[0] == "omni_stage_kv_cache_usage_ratio"}
        busy = [k for k, v in m.items() if k[0] in ("omni_stage_running_requests", "omni_stage_waiting_requests",
                                                    "omni_pending_requests", "omni_pipeline_requests_in_flight")
                and v]
        if kv and not any(kv.values()) and not busy:
            return kv
        if time.monotonic() > deadline:
            pytest.fail(f"the pipeline still holds work {timeout_s}s later: kv={kv} busy={busy}")
        time.sleep(0.1)
