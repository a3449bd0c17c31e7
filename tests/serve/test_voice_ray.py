"""The live-voice endpoints on the Ray backend (`omni serve` in its own process, stage actors): speech's
forced thinker reply crosses to the actor as a sampling option, the talker's refusal of a voice comes back
naming `voice`, and a realtime session's second turn hits the thinker actor's prefix cache."""
from __future__ import annotations

import asyncio
import io
import os
import wave

import openai
import pytest

from tests.procs import free_ports
from tests.serve.server_utils import OMNI, omni_serve

pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "qwen2_5_omni_tiny"


@pytest.fixture(scope="module")
def server():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    with omni_serve(OMNI, "--backend", "ray", port=free_ports(1)[0], env=env, stop_grace_s=90) as s:
        yield s


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
                        assert ev.response.status == "completed", ev.response.status_details
                        usage.append(ev.response.usage)
                        break
            return usage

    u1, u2 = asyncio.run(go())
    assert u2.input_token_details.cached_tokens >= (u1.input_tokens // 16 - 1) * 16 > 0
