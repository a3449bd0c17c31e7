"""Media whose header asks for more than the server allows: refused from the header, before anything is
allocated, with a 413 naming the content part and the limit; a decoder's failure is a 400 naming it.

In-process (httpx's ASGI transport) on the tiny chain (local backend). The media are crafted headers of
a few bytes: a WAV that says 1 Hz (its 16 kHz resampling would take 64 GB) and a PNG that says
60000x60000 pixels.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import zlib

import httpx2
import pytest

from omni.async_api import AsyncOmni
from omni.serve.app import create_app
from omni.serve.settings import ServeSettings
from tests.serve.server_utils import CHAIN

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny_chain"


@pytest.fixture(scope="module")
def omni():
    o = AsyncOmni(CHAIN, backend="local")
    yield o
    o.shutdown()


def post(omni: AsyncOmni, body: dict, settings: ServeSettings | None = None) -> httpx2.Response:
    async def main() -> httpx2.Response:
        app = create_app(omni, settings or ServeSettings())
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://omni") as c:
            return await c.post("/v1/chat/completions", json=body, timeout=60)

    return asyncio.run(main())


def wav(rate: int, frames: int) -> bytes:
    """A 16-bit mono PCM WAV of `frames` silent frames at `rate` Hz."""
    data = bytes(2 * frames)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, 2 * rate, 2, 16)
            + b"data" + struct.pack("<I", len(data)) + data)


def png_header(w: int, h: int) -> bytes:
    """A PNG whose IHDR claims w x h RGB pixels, with a few bytes of image data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def chat(*parts: dict) -> dict:
    return {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}


def input_audio(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def b64url(kind: str, data: bytes) -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def test_audio_whose_resampling_would_be_huge_is_413_from_its_header(omni):
    one_hz = wav(1, 1_000_000)  # 2 MB: 8 MB decoded, under the limit; 64 GB once at 16 kHz
    for part, param in [
        (input_audio(one_hz), "messages[0].content[1].input_audio.data"),
        ({"type": "audio_url", "audio_url": {"url": b64url("audio/wav", one_hz)}},
         "messages[0].content[1].audio_url.url"),
    ]:
        t0 = time.monotonic()
        r = post(omni, chat(part))
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "request_too_large", err
        assert "16000000000 samples" in err["message"] and "--max-media-mb" in err["message"], err
        assert time.monotonic() - t0 < 5  # refused from the header: nothing was resampled
    # the same bound on a clip that is fine at its own rate but not once resampled (4 kHz -> 16 kHz)
    r = post(omni, chat(input_audio(wav(4000, 40_000))), ServeSettings(max_media_bytes=400_000))
    assert r.status_code == 413 and "160000 samples" in r.json()["error"]["message"], r.text
    r = post(omni, chat(input_audio(wav(4000, 8_000))), ServeSettings(max_media_bytes=400_000))
    # 2 s, 128 kB once at 16 kHz: past the server's checks, on to the stage (a text-only LM refuses audio)
    assert r.status_code == 400 and "takes no audio" in r.json()["error"]["message"], r.text


def test_image_header_past_every_limit_is_413_naming_the_part(omni):
    part = {"type": "image_url", "image_url": {"url": b64url("image/png", png_header(60000, 60000))}}
    r = post(omni, chat(part))
    assert r.status_code == 413, r.text  # Pillow's DecompressionBombError, not a 500
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].image_url.url" and err["code"] == "request_too_large", err
    assert "--max-media-mb" in err["message"]
    # under Pillow's ceiling, over ours: refused from the header as well
    part = {"type": "image_url", "image_url": {"url": b64url("image/png", png_header(5000, 5000))}}
    r = post(omni, chat(part))
    assert r.status_code == 413 and "5000x5000" in r.json()["error"]["message"], r.text


def test_a_decoder_failure_is_400_naming_the_part(omni):
    # a PNG whose header is fine and whose pixel data is garbage: the decoder fails, not the server
    bad = png_header(8, 8).replace(zlib.compress(b"\0" * 64), b"\xff" * 11)
    part = {"type": "image_url", "image_url": {"url": b64url("image/png", bad)}}
    r = post(omni, chat(part))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[1].image_url.url", r.text
    r = post(omni, {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
