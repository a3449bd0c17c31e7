"""`omni serve`'s limits on a live server (in this process: `serve_in_process`): API key, body and media
size, back-pressure, request timeout.

The tiny chain with runtime.max_pending_requests 1. A request that must not finish while the test looks
(the one holding the only slot, the one that must time out) runs on a thinker `held` by the test: it makes
no progress until released, so the outcome does not depend on how fast the machine generates.
"""
from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest
import yaml

from tests.serve.server_utils import CHAIN, held, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
KEY = "sk-test-" + "x" * 24
MODEL = "tiny_chain"
HELLO = [{"role": "user", "content": "Hello"}]
LONG = {"max_tokens": 200, "extra_body": {"ignore_eos": True}}  # no end before the stage is held


TIMEOUT_S = 2.0  # the timeout server's runtime.request_timeout_s


def chain_with(tmp_path_factory, **runtime) -> str:
    cfg = yaml.safe_load(CHAIN.read_text())
    cfg["runtime"].update(runtime)
    path = tmp_path_factory.mktemp("limits") / "tiny_chain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_in_process(chain_with(tmp_path_factory, max_pending_requests=1), "--backend", "local",
                          "--max-body-mb", "0.05", "--max-media-items", "1", env={"OMNI_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory):
    with serve_in_process(chain_with(tmp_path_factory, request_timeout_s=TIMEOUT_S), "--backend", "local") as s:
        yield s


def wav_b64(seconds: float, rate: int = 16000) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(int(seconds * rate), "<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def test_api_key_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, _, body = server.get("/v1/models")  # no Authorization header at all
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    assert server.get("/v1/models", {"Authorization": "Bearer " + KEY[:-1] + "y"})[0] == 401  # same length
    assert server.get("/health")[0] == 200 and server.get("/metrics")[0] == 200  # probes stay open
    r = server.client(api_key=KEY).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert r.choices[0].message.content


def test_body_and_media_limits_are_413(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 60_000}]}
    status, _, body = server.post("/v1/chat/completions", big, auth)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    two_clips = [{"type": "input_audio", "input_audio": {"data": wav_b64(0.05), "format": "wav"}}] * 2
    status, _, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": two_clips}]}, auth)
    assert status == 413 and body["error"]["param"] == "messages", body
    assert server.client(api_key=KEY).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)


def test_back_pressure_503_with_retry_after(server):
    c = server.client(api_key=KEY)
    with held(server, "thinker", after_steps=1):  # its first token streams out, then it cannot finish
        stream = c.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **LONG)
        next(iter(stream))  # admitted and running: the only slot is taken
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "overloaded"
        stream.close()
        wait_idle(server)
    assert c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices[0].message.content


def test_choices_take_one_slot_each(server):
    """n choices are n pipeline requests: past runtime.max_pending_requests (1 here) n is refused by name (400,
    not a 503 that a retry could never get past); n=1 still runs."""
    c = server.client(api_key=KEY)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=2)
    assert e.value.body["param"] == "n" and "max_pending_requests" in e.value.body["message"]
    assert e.value.body["code"] == "invalid_value", e.value.body
    assert c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=1).choices[0].message.content


@pytest.mark.slow
def test_request_timeout_is_504(timeout_server):
    c = timeout_server.client()
    with held(timeout_server, "thinker"):  # not a single step: it cannot finish within any timeout
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert e.value.status_code == 504 and e.value.body["code"] == "request_timeout"
    assert f"timed out after {TIMEOUT_S:g}s (runtime.request_timeout_s)" in e.value.body["message"]
    # streamed: the status line is long gone, so the error comes as an event, then [DONE]
    chunks = []
    with held(timeout_server, "thinker", after_steps=1):  # its first token streams out, then nothing
        with pytest.raises(openai.APIError) as e:
            for chunk in c.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **LONG):
                chunks.append(chunk)
    assert chunks and "timed out" in str(e.value)
    wait_idle(timeout_server)
    assert c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices[0].message.content
