"""The FastAPI app of `omni serve`: OpenAI's API on an AsyncOmni pipeline.

    app = create_app(AsyncOmni("stage_configs/tiny_chain.yaml"), ServeSettings())

    POST /v1/chat/completions   text, images (data: URLs), audio (base64); text and audio replies; SSE
    POST /v1/completions        text or token ids, one prompt or a batch (a choice per prompt and n)
    POST /v1/audio/speech       text -> speech (speech/): wav / pcm / flac / mp3 / opus, streamed or SSE
    POST /v1/audio/transcriptions, /v1/audio/translations
                                speech -> text by the pipeline's thinker (transcription/): json / text, SSE
    WS   /v1/realtime           the Realtime protocol: one conversation per socket (realtime/)
    GET|POST /v1/audio/voices, DELETE /v1/audio/voices/{name}
                                the voices a request may name; reference voices uploaded to clone (voices/)
    GET  /v1/models             the one model: the pipeline
    GET  /v1/models/{model}     that model (404 naming `model` for any other name)
    GET  /health                200 while the pipeline serves (HEAD too); GET|POST /ping: the same (vLLM's)
    POST /tokenize, /detokenize vLLM's: text or chat messages <-> the entry stage's tokens (chat/serving_tokenize.py)
    GET  /version               {"version": omni's version}
    GET  /metrics               Prometheus text

The app does not own the pipeline: whoever made it closes it (the CLI, the Ray Serve deployment),
after `await app.state.omni.drain.drain(grace_s)` lets the requests in flight finish (http/shutdown.py).
Every error is OpenAI-shaped (http/errors.py), a 404 or 405 of an unknown route included; an unexpected
exception is a 500 that names its type, never a traceback (http/middleware.py, where it is also counted).
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni.async_api import AsyncOmni
from omni.serve.chat.serving_chat import chat_completions
from omni.serve.chat.serving_completion import completions
from omni.serve.chat.serving_tokenize import detokenize, tokenize
from omni.serve.generation.openai_shapes import model_card, models
from omni.serve.http.errors import ApiError
from omni.serve.http.metrics import CONTENT_TYPE
from omni.serve.http.middleware import ServerMiddleware
from omni.serve.http.shutdown import shutting_down
from omni.serve.realtime.websocket import RealtimeHub, deny, realtime_endpoint
from omni.serve.settings import ServeSettings
from omni.serve.speech.serving import create_speech
from omni.serve.state import PipelineInfo, ServerState, check_model, checked_voice_map
from omni.serve.transcription.serving import create_transcription, create_translation
from omni.serve.voices.serving import delete_voice, list_voices, upload_voice

logger = logging.getLogger(__name__)
STATS_TIMEOUT_S = 10.0  # a scrape waits this long for the stages' stats


def omni_version() -> str:
    """The installed package's version (the project's own constant when it is not installed)."""
    try:
        return importlib.metadata.version("omni")
    except importlib.metadata.PackageNotFoundError:
        from omni import __version__

        return __version__


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def _endpoint(state: ServerState, handler: Callable[[ServerState, Request], Awaitable[Response]]
              ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(state, request)

    return endpoint


def create_app(omni: AsyncOmni, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    info = PipelineInfo.of(omni.config, settings.served_model_name, omni.voices(), omni.shows_tools(),
                           omni.context_reserve(), omni.min_spoken_tokens(), omni.input_media(),
                           omni.transcribes_audio(), omni.transcript_marker())
    info.voice_map = checked_voice_map(settings.voice_map, info)
    info.speaks_prompt = omni.speaks_prompt()
    info.clones_voices = omni.clones_voices()
    state = ServerState(omni, settings, info)
    app = FastAPI(title="omni", version=omni_version(), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.omni = state
    hub = app.state.realtime = RealtimeHub.of(state)
    app.add_middleware(ServerMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       metrics=state.metrics, drain=state.drain)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return _error(ApiError(exc.status_code, message, code=code))

    for path, handler in (("/v1/chat/completions", chat_completions), ("/v1/completions", completions),
                          ("/v1/audio/speech", create_speech), ("/v1/audio/transcriptions", create_transcription),
                          ("/v1/audio/translations", create_translation), ("/tokenize", tokenize),
                          ("/detokenize", detokenize)):
        app.add_api_route(path, _endpoint(state, handler), methods=["POST"])

    @app.websocket("/v1/realtime")
    async def _realtime(ws: WebSocket) -> None:
        await realtime_endpoint(hub, ws)

    @app.websocket("/{path:path}")  # an unknown WebSocket route: a missing route (404), not a bare 403
    async def _no_socket(ws: WebSocket, path: str) -> None:
        await deny(ws, ApiError(404, f"no WebSocket route /{path}: this server's WebSocket is /v1/realtime",
                                code="not_found"))

    # vLLM-Omni's: the voices a request may name (--voice-map's names too), and reference voices uploaded to clone
    app.add_api_route("/v1/audio/voices", lambda: list_voices(state), methods=["GET"])
    app.add_api_route("/v1/audio/voices", _endpoint(state, upload_voice), methods=["POST"])
    app.add_api_route("/v1/audio/voices/{name}", lambda name: delete_voice(state, name), methods=["DELETE"])

    @app.get("/v1/models")
    async def _models() -> JSONResponse:
        return JSONResponse(models(state.info.model, state.created))

    @app.get("/v1/models/{model:path}")
    async def _model(model: str) -> JSONResponse:  # client.models.retrieve (a served name may hold "/")
        check_model(model, state.info)
        return JSONResponse(model_card(model, state.created))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def _health() -> JSONResponse:
        if omni.closed:
            return _error(ApiError(503, "the pipeline is closed", type="server_error", code="shutting_down"))
        if state.drain.draining:
            return _error(shutting_down("it answers the requests in flight and takes no new ones"))
        return JSONResponse({"status": "ok", "model": state.info.model, "pending_requests": state.pending})

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) liveness probe: /health's answer
    async def _ping() -> JSONResponse:
        return await _health()

    @app.get("/version")
    async def _version() -> JSONResponse:
        return JSONResponse({"version": omni_version()})

    @app.get("/metrics")
    async def _metrics() -> Response:
        try:
            stats = await asyncio.wait_for(omni.stats(), STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a scrape still answers with what the server knows itself
            logger.warning("metrics: the pipeline's stats are unavailable", exc_info=True)
            stats = None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    return app
