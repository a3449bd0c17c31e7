"""`omni serve CONFIG`: the OpenAI-compatible server; its options and its start are omni/serve/launch.py's."""
from __future__ import annotations

from typing import Any

from omni.cli.options import config_arguments
from omni.serve.launch import add_arguments as serve_options
from omni.serve.launch import main as serve_main


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a pipeline over HTTP with the OpenAI API")
    config_arguments(serve)
    serve_options(serve)
    serve.set_defaults(command_fn=serve_main)
