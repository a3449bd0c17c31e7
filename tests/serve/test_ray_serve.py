"""The app as a Ray Serve ingress deployment (`omni serve --ray-serve`) on a local Ray cluster that the
server starts (embedded, private temp dir), with the stages as Ray actors (the tiny Qwen2.5-Omni); the real
`openai` client over every surface: chat completions (streamed, and a client leaving mid-stream), the speech
endpoint (its forced thinker reply crosses to the actor as a sampling option; the talker's refusal of a voice
comes back naming `voice`) and a realtime session over WebSocket through Serve's proxy, whose second turn
hits the thinker actor's prefix cache."""
from __future__ import annotations

import asyncio
import io
import os
import wave

import openai
import pytest

from tests.procs import free_ports
from tests.serve.realtime_utils import ran_to_its_end
from tests.serve.server_utils import OMNI, omni_serve, wait_idle

pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "qwen2_5_omni_tiny"
HELLO = [{"role": "user", "content": "Hello from Ray Serve"}]


@pytest.fixture(scope="module")
def server():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    with omni_serve(OMNI, "--ray-serve", port=free_ports(1)[0], env=env, stop_grace_s=90) as s:
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

    # a client leaving mid-stream aborts the request on every stage actor. The reply is as long as the
    # thinker's context allows (2,048), seconds of decoding on any machine, so it is still running when
    # the disconnect reaches it through Serve's proxy (200 tokens could all be sent first on a fast one).
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1900, stream=True,
                                            extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    stream.close()
    kv = wait_idle(server, timeout_s=60)
    assert set(kv) == {"thinker", "talker", "token2wav"}
    m = server.metrics()
    assert m[("omni_requests_total", (("finish_reason", "abort"),))] == 1
    assert m[("omni_http_requests_total", (("path", "/v1/chat/completions"), ("status", "200")))] == 3


def test_speech_on_ray(server):
    client = server.client()
    data = client.audio.speech.create(model=MODEL, input="Hello from the actors.", voice="Chelsie",
                                      response_format="wav").content
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL, input="Hello.", voice="nobody", response_format="wav")
    assert e.value.body["param"] == "voice"


def test_realtime_turns_hit_the_thinker_actor_cache(server):
    async def go():
        async with server.async_client().realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            usage = []
            for text in ("Hello there.", "Tell me more."):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
                await conn.response.create()
                async for ev in conn:
                    if ev.type == "response.done":
                        assert ran_to_its_end(ev.response), ev.response.status_details
                        usage.append(ev.response.usage)
                        break
            return usage

    u1, u2 = asyncio.run(go())
    # Turn 2 re-sends turn 1 (its text and the reply): every whole block of it is a hit on the thinker actor.
    assert u2.input_token_details.cached_tokens >= (u1.input_tokens // 16 - 1) * 16 > 0
