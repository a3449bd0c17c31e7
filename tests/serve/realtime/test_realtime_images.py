"""`input_image` parts of `/v1/realtime` items (GA: a data: URL) on the tiny Qwen2.5-Omni, with the real `openai`
client: the image reaches the thinker as chat completions' images do (the very same prompt, its tokens in the
usage, inside the cached prefix from turn 2 on), in a conversation item and in a response's own input; a bad
data URL, bytes that are no image, an image past the limits are error events naming the part, and the session
goes on; a pipeline whose model takes no images (tiny_chain's causal LMs) refuses them, naming `input_image`."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.serve.realtime_utils import ran_to_its_end, until
from tests.fakes import fake_factory
from tests.serve.server_utils import CHAIN, OMNI, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
TEXT = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 2,
        "audio": {"input": {"turn_detection": None}}}
MAX_IMAGES = 2


@pytest.fixture(scope="module")
def server():
    with serve_in_process(OMNI, "--backend", "local", "--max-media-items", str(MAX_IMAGES)) as s:
        yield s


def png_url(seed: int = 0) -> str:
    """A 56x84 PNG: 6 placeholder tokens in the thinker's prompt (2x3 merged patches)."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image(url: str | None = None, **kw) -> dict:
    return {"type": "input_image", "image_url": url or png_url(), **kw}


def user(*parts: dict) -> dict:
    return {"type": "message", "role": "user", "content": list(parts)}


DESCRIBE = {"type": "input_text", "text": "Describe."}
LONG = {"type": "input_text", "text": "Describe this picture in a few words, and say which colours it has most of."}


async def _connect(server):
    conn = await server.async_client().realtime.connect(model=MODEL).enter()
    await until(conn, "session.created")
    await conn.session.update(session=TEXT)
    await until(conn, "session.updated")
    return conn


def run(coro):
    return asyncio.run(coro)


def test_an_image_reaches_the_thinker_as_chat_images_do_and_is_cached_from_turn_2(server):
    assert server.omni.input_media() == ("image", "audio")  # the thinker's declared media (StageInfo.media)

    async def go():
        conn = await _connect(server)
        try:
            # (text after the image: its tokens lie inside turn 1's full blocks, which turn 2 finds cached)
            await conn.conversation.item.create(item=user(image(detail="low"), LONG))
            added = await until(conn, "conversation.item.added")
            part = added.item.content[0]
            # echoed without its bytes (the client has them), as input audio is
            assert (part.type, part.detail, part.image_url) == ("input_image", "low", None)
            await conn.response.create()
            r1 = (await until(conn, "response.done")).response
            assert ran_to_its_end(r1), r1.status_details
            await conn.conversation.item.create(item=user({"type": "input_text", "text": "And then?"}))
            await conn.response.create()
            r2 = (await until(conn, "response.done")).response
            assert ran_to_its_end(r2), r2.status_details
            return r1, r2
        finally:
            await conn.close()

    r1, r2 = run(go())
    d1 = r1.usage.input_token_details
    assert (d1.image_tokens, d1.audio_tokens, d1.text_tokens) == (6, 0, r1.usage.input_tokens - 6)
    # the thinker's prompt is the chat endpoint's for the same message: the same tokens, the image decoded the same
    chat = server.client().chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url()}}, {"type": "text", "text": LONG["text"]}]}])
    assert chat.usage.prompt_tokens == r1.usage.input_tokens
    # turn 2 re-sends the image item as the same array: the prefix cache holds turn 1's prompt (all but its last
    # partial block of 16), the image inside it
    d2 = r2.usage.input_token_details
    assert d2.image_tokens == 6 and d2.cached_tokens >= (r1.usage.input_tokens // 16 - 1) * 16 > 0
    assert d2.cached_tokens_details.image_tokens == 6
    wait_idle(server)


def test_an_image_in_a_responses_own_input(server):
    async def go():
        conn = await _connect(server)
        try:
            await conn.response.create(response={"conversation": "none", "input": [user(image(), DESCRIBE)]})
            return (await until(conn, "response.done")).response
        finally:
            await conn.close()

    r = run(go())
    assert ran_to_its_end(r), r.status_details
    assert r.usage.input_token_details.image_tokens == 6
    wait_idle(server)


def _png_claiming(w: int, h: int) -> str:
    """A PNG whose header claims w x h pixels (refused from its header, before any pixel is decoded)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


BAD_IMAGES = [  # (content, the error's param, its code)
    ([DESCRIBE, image("http://127.0.0.1:1/cat.png")], "item.content[1].image_url", "invalid_value"),  # no fetching
    ([image("data:image/png;base64,aGVsbG8=")], "item.content[0].image_url", "invalid_value"),  # not an image
    ([image("data:image/png;base64,!!!")], "item.content[0].image_url", "invalid_value"),  # not base64
    ([image("data:audio/wav;base64,aGVsbG8=")], "item.content[0].image_url", "invalid_value"),
    ([image(_png_claiming(5000, 5000))], "item.content[0].image_url", "image_too_large"),  # 75 MB decoded > 64
    ([{"type": "input_image"}], "item.content[0].image_url", "missing_required_parameter"),
    ([image()] * (MAX_IMAGES + 1), f"item.content[{MAX_IMAGES}].image_url", "too_many_images"),
]


def test_bad_images_are_error_events_naming_the_part_and_the_session_goes_on(server):
    async def go():
        conn = await _connect(server)
        try:
            for i, (content, param, code) in enumerate(BAD_IMAGES):
                await conn.conversation.item.create(event_id=f"bad{i}", item=user(*content))
                err = (await until(conn, "error")).error
                assert (err.param, err.code, err.event_id) == (param, code, f"bad{i}"), (i, err)
            await conn.conversation.item.create(event_id="sys", item={
                "type": "message", "role": "system", "content": [image()]})
            err = (await until(conn, "error")).error
            assert (err.param, err.code) == ("item.content[0].type", "invalid_value"), err
            await conn.response.create(event_id="oob", response={"conversation": "none", "input": [
                user(DESCRIBE, image("data:image/png;base64,aGVsbG8="))]})
            err = (await until(conn, "error")).error
            assert (err.param, err.event_id) == ("response.input[0].content[1].image_url", "oob"), err
            # the conversation holds at most --max-media-items images: the third is refused, naming it
            for k in range(MAX_IMAGES):
                await conn.conversation.item.create(item=user(image(png_url(k))))
                await until(conn, "conversation.item.done")
            await conn.conversation.item.create(event_id="third", item=user(DESCRIBE, image()))
            err = (await until(conn, "error")).error
            assert (err.param, err.code, err.event_id) == ("item.content[1].image_url", "too_many_images", "third")
            assert "--max-media-items" in err.message
            await conn.conversation.item.create(item=user(DESCRIBE))
            await conn.response.create()
            r = (await until(conn, "response.done")).response
            assert ran_to_its_end(r), r.status_details
            assert r.usage.input_token_details.image_tokens == 6 * MAX_IMAGES  # the refused ones are not in it
        finally:
            await conn.close()

    run(go())
    wait_idle(server)


def test_a_pipeline_that_takes_no_images_refuses_them_naming_input_image():
    """tiny_chain's entry stage is a causal LM (no prompt renderer of its own: it takes no media): an input_image
    part is refused at once, before anything is decoded, in an item and in a response's input; the session goes
    on."""
    with serve_in_process(CHAIN, "--backend", "local", engine_factory=fake_factory) as chain:
        assert chain.omni.input_media() == ()

        async def go():
            async with chain.async_client().realtime.connect(model="tiny_chain") as conn:
                await until(conn, "session.created")
                await conn.conversation.item.create(event_id="img", item=user(DESCRIBE, image("not even a URL")))
                err = (await until(conn, "error")).error
                assert (err.param, err.code, err.event_id) == ("item.content[1].type", "unsupported_value", "img")
                assert "input_image" in err.message and "tiny_chain" in err.message, err.message
                await conn.response.create(response={"conversation": "none", "input": [user(image())]})
                err = (await until(conn, "error")).error
                assert (err.param, err.code) == ("response.input[0].content[0].type", "unsupported_value"), err
                await conn.conversation.item.create(item=user(DESCRIBE))
                await conn.response.create()
                r = (await until(conn, "response.done")).response
                assert ran_to_its_end(r) and r.usage.input_tokens > 0

        run(go())
