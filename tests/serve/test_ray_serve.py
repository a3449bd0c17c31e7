"""The app as a Ray Serve ingress deployment (`omni serve --ray-serve`) on a local Ray cluster that the
server starts (embedded, private temp dir), with the stages as Ray actors; the real `openai` client."""
from __future__ import annotations

import os

import pytest

from tests.procs import free_ports
from tests.serve.server_utils import CHAIN, omni_serve, wait_idle

pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "tiny_chain"
HELLO = [{"role": "user", "content": "Hello from Ray Serve"}]


@pytest.fixture(scope="module")
def server():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    with omni_serve(CHAIN, "--ray-serve", port=free_ports(1)[0], env=env, stop_grace_s=90) as s:
        yield s


def test_ray_serve_ingress(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    assert full.choices[0].message.content and full.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again

    # a client leaving mid-stream aborts the request on every stage actor
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200, stream=True,
                                            extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    stream.close()
    kv = wait_idle(server, timeout_s=60)
    assert set(kv) == {"thinker", "talker"}
    m = server.metrics()
    assert m[("omni_requests_total", (("finish_reason", "abort"),))] == 1
    assert m[("omni_http_requests_total", (("path", "/v1/chat/completions"), ("status", "200")))] == 3
