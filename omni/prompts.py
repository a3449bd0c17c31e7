"""What a prompt may look like: checked at the edge, before anything is queued or loaded.

    "text"                                          a text prompt
    {"prompt": "text" | [message, ...],             chat messages: {"role": str, "content": str | [part]}
     "prompt_token_ids": [int, ...],                parts: {"type": "text", "text": str} | {"type": "image"}
     "prompt_embeds": [[float, ...], ...],                 | {"type": "audio"}
     "multi_modal_data": {"image": array | [array],
                          "audio": wave | (wave, rate) | [...],
                          "video": path | bytes | frames | (frames, fps) | [...]},
     "mm_processor_kwargs": {"use_audio_in_video": bool},
     "cache_salt": str, "request_id": str}
    StageInput(...)                                 taken as is (its chat messages are checked)

Every error is a RequestError (a ValueError) whose `field` is the path inside the prompt
(`prompt.messages[1].content`, `multi_modal_data.image[0]`) and whose message reads "WHERE: FIELD:
what is wrong", WHERE being `prompts[i]` in the Python API and `--prompts-file FILE:LINE` in the CLI. Checks that need a stage (vocabulary,
max_model_len, what a model accepts, media content) happen in the stage, at admission.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from omni.errors import RequestError
from omni.messages import MultiModalInput, StageInput
from omni.prompt_videos import video_input

PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "multi_modal_data", "cache_salt", "request_id",
               "tools", "chat_template_kwargs", "mm_processor_kwargs", "voice")
MODALITIES = ("image", "audio", "video")
PART_TYPES = ("text", *MODALITIES)


def _bad(where: str, field: str | None, text: str) -> RequestError:
    """"WHERE: FIELD: text", the field kept as data."""
    return RequestError(": ".join(x for x in (where, field, text) if x), field=field)


def to_stage_input(p: Any, where: str, new_id: Callable[[], str]) -> StageInput:
    """One user prompt -> StageInput (a new id from `new_id` when it has none). Raises RequestError."""
    if isinstance(p, StageInput):
        if isinstance(p.prompt, list):
            check_messages(p.prompt, where)
        return p if p.request_id else dataclasses.replace(p, request_id=new_id())
    if isinstance(p, str):
        return StageInput(new_id(), prompt=p)
    if not isinstance(p, Mapping):
        raise _bad(where, None, f"expected a str, a dict or a StageInput, got {type(p).__name__}")
    unknown = [k for k in p if k not in PROMPT_KEYS]
    if unknown:
        hint = (" (chat messages go under 'prompt': {'prompt': [{'role': ..., 'content': ...}, ...]})"
                if {"role", "content"} & set(p) else "")
        raise RequestError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(PROMPT_KEYS)}){hint}",
                           field=str(unknown[0]), code="unknown_parameter")
    if p.get("prompt") is None and p.get("prompt_token_ids") is None and p.get("prompt_embeds") is None:
        raise RequestError(f"{where}: needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'", field="prompt",
                           code="missing_required_parameter")
    prompt = p.get("prompt")
    if isinstance(prompt, list):
        check_messages(prompt, where)
    elif prompt is not None and not isinstance(prompt, str):
        raise _bad(where, "prompt", f"expected text or a list of chat messages, got {type(prompt).__name__}")
    ids = p.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, (list, tuple, np.ndarray)) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise _bad(where, "prompt_token_ids", "expected a list of ints")
        ids = [int(t) for t in ids]
        if not ids:  # no stage can make a prompt of no tokens: refused here, before a model loads
            raise _bad(where, "prompt_token_ids", "the prompt is empty (0 tokens)")
    embeds = p.get("prompt_embeds")
    if embeds is not None:
        try:
            embeds = np.asarray(embeds, dtype=np.float32)
        except (TypeError, ValueError):
            raise _bad(where, "prompt_embeds", "expected a [num_tokens, hidden] array of numbers") from None
        if embeds.ndim != 2:
            raise _bad(where, "prompt_embeds", f"expected shape [num_tokens, hidden], got {embeds.shape}")
        if ids is None and not embeds.shape[0]:
            raise _bad(where, "prompt_embeds", "the prompt is empty (0 rows)")
    for key in ("request_id", "cache_salt"):
        if p.get(key) is not None and not isinstance(p[key], str):
            raise _bad(where, key, f"expected a str, got {type(p[key]).__name__}")
    tools = p.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise _bad(where, "tools", "expected a list of tool definitions ({'type': 'function', 'function': {...}})")
    kwargs = p.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)):
        raise _bad(where, "chat_template_kwargs", "expected a dict of the chat template's variables")
    mm_kwargs = p.get("mm_processor_kwargs")
    if mm_kwargs is not None and not (isinstance(mm_kwargs, Mapping) and all(isinstance(k, str) for k in mm_kwargs)):
        raise _bad(where, "mm_processor_kwargs", "expected a dict like {'use_audio_in_video': True}")
    media, extra = mm_inputs(p.get("multi_modal_data"), where), voice_options(p.get("voice"), where)
    if "reference_text" in extra:
        media.append(extra.pop("reference_audio"))
    return StageInput(p.get("request_id") or new_id(), prompt=prompt, prompt_token_ids=ids, prompt_embeds=embeds,
                      mm_inputs=media, extra=extra,
                      cache_salt=p.get("cache_salt"), tools=[dict(t) for t in tools] if tools else None,
                      chat_template_kwargs=dict(kwargs) if kwargs else None,
                      mm_processor_kwargs=dict(mm_kwargs) if mm_kwargs else None)


def voice_options(voice: Any, where: str) -> dict[str, Any]:
    """A prompt's `voice`: a voice's name (the talkers' speakers, a text-to-speech model's named voices) ->
    {"speaker": name}; a reference clip {"audio": wave | (wave, rate), "text": its transcript} (a text-to-speech
    model clones it) -> {"reference_text", "reference_audio"}: the clip goes after the prompt's other media."""
    if voice is None:
        return {}
    if isinstance(voice, str) and voice:
        return {"speaker": voice}
    if not isinstance(voice, Mapping) or set(voice) != {"audio", "text"} or not isinstance(voice["text"], str):
        raise _bad(where, "voice", "expected a voice's name, or a reference clip {'audio': wave | (wave, rate), "
                   "'text': its transcript}")
    clip = mm_inputs({"audio": voice["audio"]}, where)
    if len(clip) != 1:
        raise _bad(where, "voice.audio", "expected one clip: a waveform or (waveform, sampling_rate)")
    return {"reference_text": voice["text"], "reference_audio": clip[0]}


def check_messages(messages: Any, where: str = "") -> None:
    """Chat messages: a non-empty list of {"role": str, "content": str | [part, ...]} (RequestError naming
    `prompt.messages[j]...`; `where` prefixes the message, e.g. `prompts[0]`)."""
    if not isinstance(messages, list) or not messages:
        raise _bad(where, "prompt", "expected a non-empty list of chat messages")
    for j, msg in enumerate(messages):
        at = f"prompt.messages[{j}]"
        if not isinstance(msg, Mapping):
            raise _bad(where, at, f"expected a dict with 'role' and 'content', got {type(msg).__name__}")
        if not isinstance(msg.get("role"), str) or not msg["role"]:
            raise _bad(where, f"{at}.role",
                       f"expected a non-empty str (system, user, assistant, ...), got {msg.get('role')!r}")
        content = msg.get("content")
        if isinstance(content, str) or (content is None and msg.get("tool_calls")):  # a turn of tool calls only
            continue
        if not isinstance(content, list):
            raise _bad(where, f"{at}.content",
                       f"expected text or a list of content parts, got {type(content).__name__}")
        for k, part in enumerate(content):
            kind = part.get("type", "text") if isinstance(part, Mapping) else None
            if kind not in PART_TYPES:
                raise _bad(where, f"{at}.content[{k}]", f"expected a dict with 'type' in {PART_TYPES}, got {part!r:.80}")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise _bad(where, f"{at}.content[{k}].text", f"expected a str, got {type(part.get('text')).__name__}")


def text_only_messages(messages: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    """Messages for a text-only chat template: text parts joined, media parts refused."""
    check_messages(messages)
    out = []
    for j, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            media = [p.get("type") for p in content if p.get("type", "text") != "text"]
            if media:
                raise RequestError(f"prompt.messages[{j}].content: stage {stage!r} takes text only, got {media[0]!r}",
                                   field=f"prompt.messages[{j}].content", stage=stage)
            msg = {**msg, "content": "".join(p["text"] for p in content)}
        out.append(msg)
    return out


# apply_chat_template's own arguments, which a request's template variables must not set
_OWN = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                  "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                  "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def tokenize_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], use_chat_template: bool,
                    stage: str, tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
                    add_special_tokens: bool | None = None) -> list[int]:
    """A text prompt's token ids as a stage computes them: plain text with the tokenizer's special tokens,
    chat messages (or text under `use_chat_template`) through the chat template with the generation prompt.
    The stage's engine and the driver's router (omni/pipeline/routing/keys.py) both call this, so that the
    block hashes the router computes are the ones the stage caches. (vLLM's /tokenize may ask for chat without
    the generation prompt, or for the rendered template tokenized with `add_special_tokens`.)"""
    if isinstance(prompt, list):
        messages = text_only_messages(prompt, stage)
    elif use_chat_template:
        messages = [{"role": "user", "content": prompt}]
    elif tools:
        raise RequestError(f"tools: stage {stage!r} takes a raw text prompt here; tools need chat messages",
                           field="tools", stage=stage)
    else:
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens is not False)["input_ids"])
    own = sorted(_OWN.intersection(template_kwargs or {}))
    if own:
        raise RequestError(f"chat_template_kwargs: {own[0]!r} is an argument of the template call, not a variable "
                           "of the template", field=f"chat_template_kwargs.{own[0]}", stage=stage)
    try:
        # `tools` as transformers' templates take them (OpenAI's function definitions); None adds nothing.
        # template_kwargs: variables the template may read (vLLM's chat_template_kwargs)
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                            tokenize=add_special_tokens is None, **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - Jinja errors: say which field, not where in the template
        raise RequestError(f"prompt: the chat template of stage {stage!r} cannot render these messages: "
                           f"{type(e).__name__}: {e}", field="prompt", stage=stage) from None
    if isinstance(ids, str):  # rendered only: tokenized as asked
        ids = tokenizer(ids, add_special_tokens=add_special_tokens)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def mm_inputs(data: Any, where: str) -> list[MultiModalInput]:
    """{"image": array | [arrays], "audio": wave | (wave, rate) | [...], "video": ...} -> MultiModalInputs.

    Structure only (modality, array of numbers, rate); the stage checks the content. A video is a file (its path, or
    its bytes) or its frames (an array TxHxWxC, with their frame rate as `(frames, fps)`): omni/prompt_videos.py."""
    if data is None:
        return []
    field = "multi_modal_data"
    if not isinstance(data, Mapping):
        raise _bad(where, field, f"expected a dict like {{'image': array}}, got {type(data).__name__}")
    out = []
    for modality, items in data.items():
        if modality not in MODALITIES:
            raise _bad(where, field, f"unknown modality {modality!r} (allowed: {', '.join(MODALITIES)})")
        for k, item in enumerate(items if isinstance(items, list) else [items]):
            at, rate = f"{field}.{modality}[{k}]", None
            if modality == "video":
                out.append(video_input(item, where, at))
                continue
            if isinstance(item, tuple):
                if modality != "audio" or len(item) != 2:
                    what = "(waveform, sampling_rate)" if modality == "audio" else "an array"
                    raise _bad(where, at, f"expected {what}, got a tuple of {len(item)}")
                item, rate = item
                if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
                    raise _bad(where, f"{at}.sampling_rate", f"expected an int > 0 (Hz), got {rate!r}")
                rate = int(rate)
            try:
                arr = np.asarray(item)
            except ValueError:  # ragged nested lists
                arr = np.asarray(None)
            if not np.issubdtype(arr.dtype, np.number):
                raise _bad(where, at, f"expected an array of numbers, got {type(item).__name__} ({arr.dtype})")
            out.append(MultiModalInput(modality, arr, sampling_rate=rate))
    return out
