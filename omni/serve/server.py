"""`omni serve CONFIG`: the app on uvicorn (or on Ray Serve with --ray-serve).

    omni serve stage_configs/qwen2_5_omni_tiny.yaml [--host 127.0.0.1] [--port 8000]
               [--stage-overrides JSON] [--api-key KEY] [--backend ray|local] [--ray-serve] ...

The pipeline starts first (models load; a bad config exits 2 before anything listens), then the
server prints one line `omni serve: NAME on http://HOST:PORT` and serves until Ctrl-C / SIGTERM,
which finish the requests in flight (up to a grace period) and close the pipeline.
"""
from __future__ import annotations

import argparse
import socket
from typing import Any

GRACEFUL_SHUTDOWN_S = 10
_FLAGS = {"max_body_bytes": "--max-body-mb", "max_media_bytes": "--max-media-mb"}  # settings field -> option


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
    p.add_argument("--audio-chunk-ms", type=float, help="streamed pcm16 chunk length (default 100 ms)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's")


def settings_from_args(args: argparse.Namespace) -> Any:
    from omni.serve.settings import ServeSettings

    mb = lambda v: None if v is None else int(v * 2**20)  # noqa: E731
    return ServeSettings.from_env(
        host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
        max_body_bytes=mb(args.max_body_mb), max_media_items=args.max_media_items,
        max_media_bytes=mb(args.max_media_mb), audio_chunk_ms=args.audio_chunk_ms, log_level=args.log_level)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve_uvicorn(config: Any, settings: Any, backend: str | None) -> None:
    """Start the pipeline, then serve until interrupted; the pipeline is closed on the way out."""
    import uvicorn

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
        server = uvicorn.Server(uvicorn.Config(app, log_level=settings.log_level, lifespan="off",
                                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        shown = f"[{host}]" if ":" in host else host
        print(f"omni serve: {config.name} on http://{shown}:{port} (backend {omni.config.runtime.backend})",
              flush=True)
        server.run(sockets=[sock])
    finally:
        omni.shutdown()


def main(args: argparse.Namespace) -> int:
    """`omni serve`; exit status as the rest of the CLI (2: bad config or options)."""
    from pydantic import ValidationError

    from omni.commands import error, load_checked
    from omni.errors import ConfigError

    try:
        config, _ = load_checked(args.config, args.stage_overrides)
        settings = settings_from_args(args)
    except ConfigError as e:
        return error(str(e))
    except ValidationError as e:
        err = e.errors()[0]
        flag = _FLAGS.get(str(err["loc"][0]), "--" + str(err["loc"][0]).replace("_", "-"))
        return error(f"{flag}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})")
    if args.ray_serve:
        from omni.serve.ray_serve import run

        run(config, settings, args.backend)
    else:
        try:
            serve_uvicorn(config, settings, args.backend)
        except OSError as e:  # the address is taken, or not ours to bind
            return error(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", 1)
    return 0
