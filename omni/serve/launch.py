"""`omni serve CONFIG`: the app on uvicorn (or on Ray Serve with --ray-serve).

    omni serve stage_configs/qwen2_5_omni_tiny.yaml [--host 127.0.0.1] [--port 8000]
               [--stage-overrides JSON] [--api-key KEY] [--backend ray|local] [--ray-serve] ...

The pipeline starts first (models load; a bad config exits 2 before anything listens), then the
server prints one line `omni serve: NAME on http://HOST:PORT` and serves until Ctrl-C / SIGTERM.
The first signal drains the app (http/shutdown.py: new requests 503, those in flight run on for
--shutdown-grace-s, then each one left is ended with an error and streams with [DONE]); then uvicorn
stops and the pipeline closes. Exit 0 when everything in flight finished within the grace period,
else 143 (SIGTERM) / 130 (Ctrl-C). A second signal ends what is in flight at once.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from omni.serve.generation.tool_parser import PARSERS as TOOL_CALL_PARSERS

# uvicorn's own graceful wait, once the drain is over: only the last bytes of responses already
# ended are left to send by then.
UVICORN_SHUTDOWN_S = 5
# Size options are given in MiB, ServeSettings holds bytes: settings field -> (option, its argparse dest). Their
# errors speak in the option's unit: the bound converted back to MiB and the value as it was typed, not bytes.
_SIZE_FLAGS = {"max_body_bytes": ("--max-body-mb", "max_body_mb"),
               "max_media_bytes": ("--max-media-mb", "max_media_mb"),
               "max_conversation_bytes": ("--max-conversation-mb", "max_conversation_mb")}
_MIB = 2**20
_BOUNDS = {"ge": "greater than or equal to", "gt": "greater than", "le": "less than or equal to", "lt": "less than"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`omni serve`'s options besides CONFIG and --stage-overrides (no heavy imports here)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: $OMNI_API_KEY)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the pipeline's name)")
    p.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend")
    p.add_argument("--ray-serve", action="store_true", help="serve as a Ray Serve ingress deployment")
    p.add_argument("--max-body-mb", type=float, help="largest request body in MiB (default 32)")
    p.add_argument("--max-media-items", type=int, help="images + audio clips per request (default 8)")
    p.add_argument("--max-media-mb", type=float, help="largest decoded image or audio clip in MiB (default 64)")
    p.add_argument("--audio-chunk-ms", type=float, help="streamed audio chunk length (default 100 ms)")
    p.add_argument("--shutdown-grace-s", type=float, help="on SIGTERM / Ctrl-C, how long requests in flight may "
                   "finish before they are ended with an error (default 10)")
    p.add_argument("--max-sessions", type=int, help="concurrent /v1/realtime sessions (default 16)")
    p.add_argument("--session-idle-timeout-s", type=float, help="close a /v1/realtime session idle this long "
                   "(default 600)")
    p.add_argument("--max-session-responses", type=int, help="responses one /v1/realtime session runs at once "
                   "(default 4)")
    p.add_argument("--max-conversation-items", type=int, help="items a /v1/realtime conversation holds "
                   "(default 1024)")
    p.add_argument("--max-conversation-mb", type=float, help="MiB a /v1/realtime conversation holds: text, audio, "
                   "images (default 64)")
    p.add_argument("--default-modalities", help="a chat request's output modalities when it names none: text "
                   "(default, OpenAI's) or text,audio (vLLM-Omni's)")
    p.add_argument("--voice-map", help="OpenAI voice names -> the pipeline's voices, e.g. alloy=Chelsie,echo=Ethan "
                   "(default: none, OpenAI's names are refused)")
    p.add_argument("--voice-dir", help="a folder of NAME.wav + NAME.txt (its transcript) pairs: the voices a "
                   "text-to-speech stage clones, by NAME (default: the config's model_kwargs.voices)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help='chat tool_choice "auto" (the default with tools): calls read from the reply (needs '
                        "--tool-call-parser), as vLLM's flag")
    p.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS),
                   help="the model's tool-call format for \"auto\": hermes (Qwen2.5 / Qwen3 templates)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's")


def _mib_bytes(flag: str, value: float | None) -> int | None:
    """A size option's MiB as the bytes ServeSettings holds (ConfigError for nan / inf, which have none)."""
    if value is None:
        return None
    if not math.isfinite(value):
        from omni.errors import ConfigError

        raise ConfigError(f"{flag}: expected a finite number of MiB (got {value:g})", field=flag)
    return int(value * _MIB)


def _size_error(err: Any, flag: str, given: float) -> str:
    """A size option's validation error in MiB, as the option was given (the settings' bound is in bytes)."""
    ctx = err.get("ctx") or {}
    bound = next(((words, ctx[k]) for k, words in _BOUNDS.items() if k in ctx), None)
    msg = (f"Input should be {bound[0]} {bound[1] / _MIB:.10g} MiB" if bound is not None
           else err["msg"].removeprefix("Value error, "))
    return f"{flag}: {msg} (got {given:g})"


def _listed(value: str | None) -> list[str] | None:
    """A comma-separated option as its items (validated by ServeSettings, which names the option)."""
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _voice_map(value: str | None) -> dict[str, str] | None:
    """--voice-map alloy=Chelsie,echo=Ethan -> {"alloy": "Chelsie", "echo": "Ethan"} (names lower-cased)."""
    if value is None:
        return None
    pairs = [item.partition("=") for item in _listed(value) or []]
    bad = [f"{name}{eq}{voice}" for name, eq, voice in pairs if not (name.strip() and eq and voice.strip())]
    if bad:
        from omni.errors import ConfigError

        raise ConfigError(f"--voice-map: expected NAME=VOICE pairs separated by commas, got {bad[0]!r}",
                          field="--voice-map")
    return {name.strip().lower(): voice.strip() for name, _, voice in pairs}


def settings_from_args(args: argparse.Namespace) -> Any:
    from omni.serve.settings import ServeSettings

    return ServeSettings.from_env(
        host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
        max_body_bytes=_mib_bytes("--max-body-mb", args.max_body_mb), max_media_items=args.max_media_items,
        max_media_bytes=_mib_bytes("--max-media-mb", args.max_media_mb), audio_chunk_ms=args.audio_chunk_ms,
        shutdown_grace_s=args.shutdown_grace_s, log_level=args.log_level, max_sessions=args.max_sessions,
        session_idle_timeout_s=args.session_idle_timeout_s, max_session_responses=args.max_session_responses,
        max_conversation_items=args.max_conversation_items,
        max_conversation_bytes=_mib_bytes("--max-conversation-mb", args.max_conversation_mb),
        default_modalities=_listed(args.default_modalities), voice_map=_voice_map(args.voice_map),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser)


def with_voice_dir(config: Any, voice_dir: str | None) -> Any:
    """--voice-dir DIR: the config with `model_kwargs.voice_dir` set on its text-to-speech stages (StageInfo.
    speaks_prompt); ConfigError when DIR is no folder or no stage clones voices."""
    if voice_dir is None:
        return config
    from omni.errors import ConfigError
    from omni.registry import stage_model_entry

    folder = Path(voice_dir).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--voice-dir: {folder} is not a directory", field="--voice-dir")
    stages = [s if not stage_model_entry(s.model).info.speaks_prompt else
              s.model_copy(update={"model_kwargs": {**s.model_kwargs, "voice_dir": str(folder.resolve())}})
              for s in config.stages]
    if stages == list(config.stages):
        raise ConfigError(f"--voice-dir: no stage of pipeline {config.name!r} is a text-to-speech model that clones "
                          "voices", field="--voice-dir")
    return config.model_copy(update={"stages": stages})


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Listening from here on: a client that connects as soon as the address line is printed waits in the
    # backlog until uvicorn accepts, instead of being refused in between.
    sock.listen(2048)
    return sock


def _server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose exit signals (SIGINT, SIGTERM: uvicorn installs `handle_exit` for both)
        start the app's drain; uvicorn is told to exit only once the drain is over. The signal is not
        handed on to uvicorn, which would raise it again once it stopped (the exit status is ours)."""

        def __init__(self, config: Any, drain: Any, grace_s: float):
            super().__init__(config)
            self.drain, self.grace_s = drain, grace_s
            self.signal: int | None = None
            self.clean = True
            self._loop: asyncio.AbstractEventLoop | None = None
            self._task: asyncio.Task | None = None

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self._loop is None:  # not serving yet: nothing to drain
                self.should_exit = True
                return
            # A Python signal handler runs between two bytecodes of the loop's thread: schedule, do not act.
            self._loop.call_soon_threadsafe(self._on_signal, sig)

        def _on_signal(self, sig: int) -> None:
            if self.signal is not None:  # a second signal: end what is in flight now
                self.drain.stop_now()
                return
            self.signal = sig
            name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
            print(f"omni serve: {name}: draining (new requests get 503; requests in flight have "
                  f"{self.grace_s:g} s to finish)", file=sys.stderr, flush=True)
            self._task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            self.clean = await self.drain.drain(self.grace_s)
            self.should_exit = True

    return DrainingServer


def serve_uvicorn(config: Any, settings: Any, backend: str | None) -> int:
    """Start the pipeline, then serve until a signal and its drain; the pipeline is closed on the way out.
    Returns the exit status: 0 after a clean drain (or no signal), 128 + the signal when the grace period
    ran out."""
    import uvicorn
    from sse_starlette.sse import AppStatus

    from omni.async_api import AsyncOmni
    from omni.serve.app import create_app

    sock = _bind(settings.host, settings.port)  # before the models load: a taken port fails at once
    host, port = sock.getsockname()[:2]
    try:
        omni = AsyncOmni(config, backend=backend)
    except BaseException:
        sock.close()
        raise
    try:
        app = create_app(omni, settings)
        # The drain ends omni's streams itself; sse-starlette must not cut them when uvicorn is told to exit.
        AppStatus.disable_automatic_graceful_drain()
        # a realtime frame as large as the audio a session may buffer (base64: 4/3 of --max-media-mb) arrives and
        # is answered as an event (uvicorn's 16 MiB default closed the socket, 1009, before the session saw it)
        ws_max = max(16 * 2**20, settings.max_media_bytes * 4 // 3 + 2**20)
        server = _server_class()(uvicorn.Config(app, log_level=settings.log_level, lifespan="off", ws_max_size=ws_max,
                                                timeout_graceful_shutdown=UVICORN_SHUTDOWN_S),
                                 app.state.omni.drain, settings.shutdown_grace_s)
        shown = f"[{host}]" if ":" in host else host
        # the name clients send as `model` (--served-model-name, else the pipeline's)
        print(f"omni serve: {settings.served_model_name or config.name} on http://{shown}:{port} "
              f"(backend {omni.config.runtime.backend})",
              flush=True)
        server.run(sockets=[sock])
    finally:
        omni.shutdown()
    if server.signal is None or server.clean:
        return 0
    print(f"omni serve: the grace period ({settings.shutdown_grace_s:g} s) ran out: the requests still in "
          "flight were ended with an error", file=sys.stderr, flush=True)
    return 128 + server.signal


def main(args: argparse.Namespace) -> int:
    """`omni serve`; exit status as the rest of the CLI (2: bad config or options)."""
    from pydantic import ValidationError

    from omni.async_api import AsyncOmni
    from omni.commands import error
    from omni.errors import ConfigError

    try:
        config = AsyncOmni.load_config(args.config, args.stage_overrides, memory_gb=getattr(args, "memory_gb", None),
                                       check_paths=True)
        config = with_voice_dir(config, args.voice_dir)
        settings = settings_from_args(args)
    except ConfigError as e:
        return error(str(e))
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a rule across options (--enable-auto-tool-choice needs --tool-call-parser): it names them
            return error(msg)
        name = str(err["loc"][0])
        if name in _SIZE_FLAGS:
            flag, dest = _SIZE_FLAGS[name]
            return error(_size_error(err, flag, getattr(args, dest)))
        return error(f"--{name.replace('_', '-')}: {msg} (got {err.get('input')!r})")
    if args.ray_serve:
        from omni.serve.ray_serve import run

        run(config, settings, args.backend)
    else:
        try:
            return serve_uvicorn(config, settings, args.backend)
        except ConfigError as e:  # an option the started pipeline refuses (--voice-map naming no voice of it)
            return error(str(e))
        except OSError as e:  # the address is taken, or not ours to bind
            return error(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", 1)
    return 0
