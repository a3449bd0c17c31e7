"""Typed errors on the Ray backend: a request refused by a stage actor reaches the HTTP client with its
`param` and `code`, exactly as on the local backend (the error crosses from the actor to the driver as
itself, its fields pickled; the server maps it by type and code, never by its wording). The server runs
in this process on the session's shared cluster: the stage actors are as remote as in `omni serve`'s own
embedded Ray (`test_serve_cli.py` runs that one)."""
from __future__ import annotations

import pytest

from tests.serve.server_utils import CHAIN, serve_in_process

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
MODEL = "tiny_chain"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(ray_cluster):
    with serve_in_process(CHAIN, "--backend", "ray") as s:
        yield s


# (what, path, body, param, code): each refused inside a stage actor, at admission
ROWS = [
    ("prompt past max_model_len", "/v1/chat/completions",
     {**GOOD, "messages": [{"role": "user", "content": "word " * 300}]}, "messages", "context_length_exceeded"),
    ("max_tokens past max_model_len", "/v1/chat/completions", {**GOOD, "max_completion_tokens": 1000},
     "max_completion_tokens", "context_length_exceeded"),
    ("prompt id out of vocabulary", "/v1/completions", {"model": MODEL, "prompt": [10**9], "max_tokens": 2},
     "prompt", "invalid_value"),
    ("stop id out of vocabulary", "/v1/chat/completions", {**GOOD, "stop_token_ids": [10**6]}, "stop_token_ids",
     "invalid_value"),
    ("thinker's sampling field", "/v1/chat/completions",
     {**GOOD, "sampling_params_list": [{"stop_token_ids": [10**6]}, None]}, "sampling_params_list[0].stop_token_ids",
     "invalid_value"),
]


def test_stage_errors_reach_the_client_typed_on_ray(server):
    for what, path, body, param, code in ROWS:
        status, _, err = server.post(path, body)
        assert status == 400, (what, err)
        assert (err["error"]["param"], err["error"]["code"], err["error"]["type"]) == (
            param, code, "invalid_request_error"), (what, err)
    status, _, ok = server.post("/v1/chat/completions", GOOD)  # the actors keep serving
    assert status == 200 and ok["choices"][0]["message"]["content"], ok
