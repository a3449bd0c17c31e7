"""`/v1/audio/voices`: the voices a request may name, and reference voices uploaded to clone (vLLM-Omni's routes).

    GET    /v1/audio/voices          {"voices": [the pipeline's and the uploaded], "voice_map"} (+ "uploaded": [cards]
                                     on a pipeline that clones voices)
    POST   /v1/audio/voices          multipart/form-data: `audio_sample` (or `file`: the clip, WAV / FLAC / OGG / MP3),
                                     `name`, `ref_text` (or `text`: what the clip says), `consent` (optional, kept)
                                     -> {"success": true, "voice": card}
    DELETE /v1/audio/voices/{name}   -> {"success": true, "message"}; 404 naming `name` when none is kept

Only a pipeline whose entry stage speaks its prompt and takes audio (a text-to-speech model that clones voices from
reference clips, as Higgs Audio v2) takes uploads; others answer 400 naming the route's field. The server keeps the
clips in memory (omni/serve/voices/store.py: bounded in number and length).
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from omni.serve.audio.codecs import decode_audio
from omni.serve.http.errors import ApiError, bad_request
from omni.serve.state import ServerState
from omni.serve.voices.choice import speaks_uploaded
from omni.serve.voices.store import MAX_SECONDS, VoiceUploadError

MAX_FIELD_BYTES = 16 * 1024


def list_voices(state: ServerState) -> JSONResponse:
    """The pipeline's voices (and --voice-map's names); on a pipeline that clones voices, the uploaded ones too."""
    info = state.info
    if not takes_uploads(info):
        return JSONResponse({"voices": list(info.voices), "voice_map": info.voice_map})
    uploaded = state.uploaded_voices
    return JSONResponse({"voices": [*info.voices, *uploaded.names()], "uploaded": uploaded.cards(),
                         "voice_map": info.voice_map})


def takes_uploads(info) -> bool:
    """A text-to-speech model cloning from reference clips speaks: its entry stage, or a voice agent's speech stage
    (a chat or realtime request's voice may then name an uploaded one: voices/choice.py)."""
    return info.clones_voices and (info.speaks_prompt or speaks_uploaded(info))


async def upload_voice(state: ServerState, request: Request) -> JSONResponse:
    info = state.info
    if not takes_uploads(info):
        raise bad_request(f"audio_sample: pipeline {info.model!r} clones no voices (its entry stage takes no "
                          "reference clips)", "audio_sample", "unsupported_value")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(415, "send multipart/form-data (`audio_sample`, `name`, `ref_text`)", code="unsupported_media")
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=MAX_FIELD_BYTES)
    except Exception as e:  # noqa: BLE001 - a malformed body is the client's
        raise bad_request(f"the multipart body could not be read: {e}") from None
    try:
        upload = form.get("audio_sample") or form.get("file")
        if upload is None or isinstance(upload, str):
            raise bad_request("audio_sample: the reference clip is required (a multipart file part)", "audio_sample",
                              "missing_required_parameter")
        data = await upload.read()
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
    finally:
        await form.close()
    name = fields.get("name", "")
    text = fields.get("ref_text", fields.get("text", ""))
    wave, rate = decode_audio(data, "audio_sample", int(MAX_SECONDS * 48000 * 4 * 2))
    try:
        voice = state.uploaded_voices.add(name, wave, rate, text, len(data), tuple(info.voices),
                                          fields.get("consent"))
    except VoiceUploadError as e:
        raise ApiError(e.status, str(e), param=e.field, code=e.code) from None
    return JSONResponse({"success": True, "voice": voice.card()})


def delete_voice(state: ServerState, name: str) -> JSONResponse:
    if state.uploaded_voices.remove(name) is None:
        raise ApiError(404, f"name: no uploaded voice {name!r}; uploaded: {state.uploaded_voices.names()}",
                       param="name", code="not_found")
    return JSONResponse({"success": True, "message": f"voice {name!r} deleted"})
