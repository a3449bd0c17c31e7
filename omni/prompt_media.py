"""Media named by path in a `--prompts-file` line, read before anything loads.

    {"prompt": "What does she say?", "multi_modal_data": {"audio": "clip.wav"}}
    {"prompt": "Describe them.", "multi_modal_data": {"image": ["cat.png", "/data/dog.jpg"]}}

    {"prompt": "What happens?", "multi_modal_data": {"video": "clip.mp4"},
     "mm_processor_kwargs": {"use_audio_in_video": true}}

JSON has no arrays of samples worth writing by hand, so in a prompts file a string under
`multi_modal_data.image`, `.audio` or `.video` (alone or as an item of a list) is a file path,
relative to the prompts file's folder. It is read into what the Python API takes (omni/prompts.py), as a
user of vLLM's `LLM.generate` would pass it: an image as an HxWx3 uint8 RGB array (PNG, JPEG, WEBP, GIF,
BMP), an audio file as `(mono float32 waveform, the file's own sampling rate)` (WAV, FLAC, OGG, MP3; the
stage checks the rate against its encoder's, as it does for the API), a video as its file's bytes (mp4, webm,
mkv, mov, ...: the stage decodes the frames it samples, and the audio track; here the file is only checked to
hold a video stream). The decoders are the server's (omni/serve/media.py, omni/serve/audio/codecs.py): one
reading of user media for every entry point.

A missing or unreadable file is a RequestError (a ValueError) naming the line, the field and the file.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni.errors import RequestError
from omni.messages import StageInput
from omni.serve.http.errors import ApiError

# The decoders check the size a header announces before decoding. Here the files are the user's own, on
# their own machine, so the bound is only there so that a header that lies cannot allocate without end.
_MAX_DECODED_BYTES = 1 << 30


def _read(modality: str, file: Path, where: str) -> Any:
    """One file -> an image array, or (waveform, rate). ApiError (the decoders' own) when unreadable."""
    from omni.serve.audio.codecs import decode_audio
    from omni.serve.media import decode_image

    if modality == "video":
        from omni.prompt_videos import check_video_stream, read_video_file

        return check_video_stream(read_video_file(file, "", where), where)
    data = file.read_bytes()
    if modality == "image":
        return decode_image(data, where, _MAX_DECODED_BYTES)
    return decode_audio(data, where, _MAX_DECODED_BYTES)  # no rate_out: the file's own rate is kept


def read_media_paths(prompt: Any, folder: Path, where: str) -> Any:
    """`prompt` (one parsed JSONL line) with every media path under `multi_modal_data` replaced by what it
    holds; anything else is left for omni.prompts to check. `where`: `--prompts-file FILE:LINE`."""
    if not isinstance(prompt, Mapping) or not isinstance(prompt.get("multi_modal_data"), Mapping):
        return prompt
    data = dict(prompt["multi_modal_data"])
    for modality in ("image", "audio", "video"):
        items = data.get(modality)
        if isinstance(items, str):
            data[modality] = _read_path(modality, items, folder, where, f"multi_modal_data.{modality}[0]")
        elif isinstance(items, list) and any(isinstance(x, str) for x in items):
            data[modality] = [_read_path(modality, x, folder, where, f"multi_modal_data.{modality}[{k}]")
                              if isinstance(x, str) else x for k, x in enumerate(items)]
    return {**prompt, "multi_modal_data": data}


def _read_path(modality: str, name: str, folder: Path, where: str, field: str) -> Any:
    at = f"{where}: {field}"
    if not name.strip():
        raise RequestError(f"{at}: expected a file path, got an empty string", field=field)
    file = folder / Path(name).expanduser()  # an absolute path stays as it is
    if not file.exists():
        raise RequestError(f"{at}: no such file: {file}", field=field)
    if not file.is_file():
        raise RequestError(f"{at}: not a file: {file}", field=field)
    try:
        return _read(modality, file, f"{at}: {file}")
    except OSError as e:
        raise RequestError(f"{at}: cannot read {file}: {e.strerror or e}", field=field) from None
    except RequestError as e:  # a video's check: its words name the line, the field and the file
        raise RequestError(str(e), field=field) from None
    except ApiError as e:  # the decoder's words, already naming the line, the field and the file
        raise RequestError(e.message, field=field) from None


def check_inline_media(inp: StageInput, where: str) -> None:
    """The shape of each array a line gives inline (not as a file path): an image HxW or HxWxC with C in
    (1, 3, 4), an audio waveform 1-D. The stage makes the same check at admission, but from the CLI that is
    after the models have loaded; file contents are what the decoders made, already right."""
    seen: dict[str, int] = {}
    for m in inp.mm_inputs:
        k = seen.get(m.modality, 0)
        seen[m.modality] = k + 1
        field, shape = f"multi_modal_data.{m.modality}[{k}]", m.data.shape
        if m.modality == "image" and (len(shape) not in (2, 3) or (len(shape) == 3 and shape[-1] not in (1, 3, 4))):
            raise RequestError(f"{where}: {field}: expected a file path, or an HxW or HxWxC array with C in "
                               f"(1, 3, 4), got shape {shape}", field=field)
        if m.modality == "video" and not (len(shape) == 1 or (len(shape) == 4 and shape[-1] in (1, 3, 4))):
            raise RequestError(f"{where}: {field}: expected a file path, or frames TxHxWxC with C in (1, 3, 4), got "
                               f"shape {shape}", field=field)
        if m.modality == "audio" and len(shape) != 1:
            raise RequestError(f"{where}: {field}: expected a file path, or a mono 1-D waveform, got shape {shape}",
                               field=field)
