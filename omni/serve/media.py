"""Media as users send it: `data:` URLs and base64, images decoded with Pillow (chat completions' media
parts, realtime's `input_image` parts: one reading for every endpoint).

The server fetches nothing: an `image_url` must be a `data:` URL (an http(s) URL is refused, so a
request cannot make the server reach into its network). Sizes are checked before decoding: an
image's header gives its pixel count, which is refused past the limit before any pixel is decoded
(a decompression bomb never expands): 413 naming the content part. Whatever else the decoder
raises on a user's bytes is a 400 naming the content part, never a 500.
"""
from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from omni.serve.http.errors import bad_request, too_large

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def b64decode(data: str, where: str) -> bytes:
    try:
        out = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: not valid base64", where) from None
    if not out:
        raise bad_request(f"{where}: empty", where)
    return out


def parse_data_url(url: str, where: str, kind: str) -> tuple[str, bytes]:
    """'data:image/png;base64,....' -> ('image/png', bytes). `kind`: 'image', 'audio' or 'video'."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a plain string"
        raise bad_request(f"{where}: only data: URLs are accepted (data:{kind}/...;base64,...); this server "
                          f"fetches nothing, got {scheme!r}", where)
    header, sep, payload = url[5:].partition(",")
    params = header.split(";")
    if not sep or "base64" not in params[1:]:
        raise bad_request(f"{where}: expected data:{kind}/<type>;base64,<data>", where)
    mime = params[0].lower()
    if mime and not mime.startswith(f"{kind}/"):
        raise bad_request(f"{where}: expected a {kind}, got a data: URL of type {mime!r}", where)
    return mime, b64decode(payload, where)


def decode_image(data: bytes, where: str, max_decoded_bytes: int) -> np.ndarray:
    """PNG / JPEG / WEBP / GIF (first frame) / BMP bytes -> HxWx3 uint8 RGB."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:  # Pillow's own ceiling, met before ours when a header lies big
        raise too_large(f"{where}: the image is too large to decode ({e}); this server decodes at most "
                        f"{max_decoded_bytes} bytes of RGB per image (--max-media-mb)", where) from None
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - a parser fed hostile bytes raises OSError, SyntaxError, struct.error, ...
        raise bad_request(f"{where}: not a readable image ({', '.join(IMAGE_FORMATS)})", where) from None
    if img.format not in IMAGE_FORMATS:
        raise bad_request(f"{where}: image format {img.format} is not accepted (use {', '.join(IMAGE_FORMATS)})",
                          where)
    w, h = img.size
    if w < 1 or h < 1:
        raise bad_request(f"{where}: the image is empty ({w}x{h})", where)
    if w * h * 3 > max_decoded_bytes:
        raise too_large(f"{where}: a {w}x{h} image decodes to {w * h * 3} bytes, more than the server's "
                        f"limit of {max_decoded_bytes} (--max-media-mb)", where)
    try:
        rgb = img.convert("RGB")  # decodes; truncated or corrupt data fails here
        return np.asarray(rgb, dtype=np.uint8).copy()
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - as above: any decoder failure is the bytes' fault
        raise bad_request(f"{where}: the image could not be decoded: {type(e).__name__}: {e}", where) from None


def video_bytes(url: str, where: str, max_bytes: int) -> np.ndarray:
    """A video_url's data: URL -> the file's bytes (1-D uint8), 413 past `max_bytes`. The stage decodes it (the
    frames its model samples, the audio track) and checks its own limits (frames, seconds, pixels), naming the
    field."""
    _, data = parse_data_url(url, where, "video")
    if len(data) > max_bytes:
        raise too_large(f"{where}: {len(data)} bytes of video, more than the server's limit of {max_bytes} "
                        "(--max-media-mb)", where)
    return np.frombuffer(data, dtype=np.uint8)
