"""The OpenAI shapes more than one endpoint sends: a response's id, the model list, the prompt's tokens by kind
(realtime and transcription usage) and one token's log-probability entry (chat and transcription logprobs)."""
from __future__ import annotations

import uuid
from typing import Any

def new_id(prefix: str, given: str | None = None) -> str:
    """A response's id: `prefix-` and the request's own id (vLLM's request_id), or a fresh one."""
    return f"{prefix}-{given if given is not None else uuid.uuid4().hex}"


def input_token_details(run: Any) -> dict[str, Any]:
    """The prompt's tokens by kind, as OpenAI's realtime and transcription usage splits them: text (everything but
    the media placeholders), audio, image, and the cached ones the same way (the cache holds a prefix)."""
    mm, cached_mm = run.prompt_mm_tokens, run.cached_mm_tokens
    cached = run.cached_tokens or 0
    audio, image = mm.get("audio", 0), mm.get("image", 0)
    c_audio, c_image = cached_mm.get("audio", 0), cached_mm.get("image", 0)
    return {"text_tokens": run.prompt_tokens - sum(mm.values()), "audio_tokens": audio, "image_tokens": image,
            "cached_tokens": cached,
            "cached_tokens_details": {"text_tokens": cached - sum(cached_mm.values()), "audio_tokens": c_audio,
                                      "image_tokens": c_image}}


_MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM's floor too)


def floor_logprob(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def token_entry(token: str | None, logprob: float, raw: bytes | None) -> dict[str, Any]:
    """One token as OpenAI lists it: its text, log-probability and bytes, the token's own (TokenLogprob.token_bytes:
    a token holding part of a character has the text U+FFFD but not its bytes); its text's UTF-8 where the stage
    has no tokenizer to say."""
    text = token or ""
    return {"token": text, "logprob": floor_logprob(logprob),
            "bytes": list(raw if raw is not None else text.encode("utf-8"))}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "omni"}


def models(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created)]}
