"""The same app as a Ray Serve ingress deployment, so that it scales on a Ray cluster.

    serve run omni.serve.ray_serve:build_app config=stage_configs/tiny_chain.yaml \\
        [stage_overrides='{"talker": {...}}'] [api_key=KEY] [served_model_name=NAME] [num_replicas=2]
    omni serve CONFIG --ray-serve [--host 127.0.0.1] [--port 8000]

Each replica runs one pipeline (its stage actors are placed by Ray like any other actor: the replica
itself reserves no CPU); Ray Serve's proxy spreads requests over the replicas. Back-pressure stays per
replica (runtime.max_pending_requests -> 503); Ray Serve's own queue limit is set above it.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile
import threading
from typing import Any

import ray
from ray import serve

from omni.async_api import AsyncOmni
from omni.config.schema import PipelineConfig
from omni.serve.app import create_app
from omni.serve.settings import ServeSettings

_EXTRA_ONGOING = 64  # Ray Serve's per-replica limit sits above runtime.max_pending_requests: the app answers 503


@serve.deployment(name="omni", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OmniIngress:
    """One replica: one AsyncOmni pipeline behind the app."""

    async def __init__(self, config: PipelineConfig, settings: ServeSettings, backend: str | None = None):
        self._omni = await AsyncOmni.create(config, backend=backend)
        self._app = create_app(self._omni, settings)

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    def __del__(self) -> None:
        omni = getattr(self, "_omni", None)
        if omni is not None:
            omni.shutdown()


def deployment(config: PipelineConfig, settings: ServeSettings, backend: str | None = None,
               num_replicas: int = 1) -> Any:
    """The bound application (for serve.run)."""
    return OmniIngress.options(
        num_replicas=num_replicas, max_ongoing_requests=config.runtime.max_pending_requests + _EXTRA_ONGOING,
    ).bind(config, settings, backend)


def build_app(args: dict[str, str]) -> Any:
    """`serve run omni.serve.ray_serve:build_app config=PATH ...` (the config is read here, on the driver)."""
    unknown = set(args) - {"config", "stage_overrides", "api_key", "served_model_name", "backend", "num_replicas"}
    if unknown or "config" not in args:
        raise ValueError("build_app takes config=PATH [stage_overrides=JSON] [api_key=KEY] [served_model_name=NAME] "
                         f"[backend=ray|local] [num_replicas=N]; got {sorted(args)}")
    config = AsyncOmni.load_config(args["config"], args.get("stage_overrides"))
    settings = ServeSettings.from_env(api_key=args.get("api_key"), served_model_name=args.get("served_model_name"))
    return deployment(config, settings, args.get("backend"), int(args.get("num_replicas", "1")))


def run(config: PipelineConfig, settings: ServeSettings, backend: str | None = None,
        stop: threading.Event | None = None) -> None:
    """`omni serve --ray-serve`: Ray Serve on the config's cluster (runtime.ray_address / RAY_ADDRESS), else on
    an embedded local Ray; blocks until `stop` is set or Ctrl-C / SIGTERM, then shuts Serve (and that Ray) down."""
    address = config.runtime.ray_address or os.environ.get("RAY_ADDRESS")
    temp_dir = None
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None  # ray.init replaces it: keep ours
    if address:
        ray.init(address=address, namespace=config.runtime.namespace)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private throwaway cluster
        temp_dir = tempfile.mkdtemp(prefix="omni-serve-")
        cpus = max(os.cpu_count() or 1, math.ceil(sum(s.resources.num_cpus for s in config.stages)))
        ray.init(address="local", include_dashboard=False, num_cpus=cpus, _temp_dir=temp_dir,
                 namespace=config.runtime.namespace, log_to_driver=config.runtime.log_to_driver)
    if sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(deployment(config, settings, backend), name=config.name, route_prefix="/")
        print(f"omni serve: {settings.served_model_name or config.name} on http://{settings.host}:{settings.port} "
              "(Ray Serve)", flush=True)
        (stop or threading.Event()).wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if temp_dir:
                shutil.rmtree(temp_dir, ignore_errors=True)
