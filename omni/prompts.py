"""What a prompt may look like: checked at the edge, before anything is queued or loaded.

    "text"                                          a text prompt
    {"prompt": "text" | [message, ...],             chat messages: {"role": str, "content": str | [part]}
     "prompt_token_ids": [int, ...],                parts: {"type": "text", "text": str} | {"type": "image"}
     "prompt_embeds": [[float, ...], ...],                 | {"type": "audio"}
     "multi_modal_data": {"image": array | [array],
                          "audio": wave | (wave, rate) | [...]},
     "cache_salt": str, "request_id": str}
    StageInput(...)                                 taken as is (its chat messages are checked)

Every error is a ValueError "WHERE: FIELD: what is wrong", WHERE being `prompts[i]` in the
Python API and `--prompts-file FILE:LINE` in the CLI. Checks that need a stage (vocabulary,
max_model_len, what a model accepts, media content) happen in the stage, at admission.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from omni.outputs import MultiModalInput, StageInput

PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "multi_modal_data", "cache_salt", "request_id")
MODALITIES = ("image", "audio")
PART_TYPES = ("text", *MODALITIES)


def to_stage_input(p: Any, where: str, new_id: Callable[[], str]) -> StageInput:
    """One user prompt -> StageInput (a new id from `new_id` when it has none). Raises ValueError."""
    if isinstance(p, StageInput):
        if isinstance(p.prompt, list):
            check_messages(p.prompt, f"{where}: prompt")
        return p if p.request_id else dataclasses.replace(p, request_id=new_id())
    if isinstance(p, str):
        return StageInput(new_id(), prompt=p)
    if not isinstance(p, Mapping):
        raise ValueError(f"{where}: expected a str, a dict or a StageInput, got {type(p).__name__}")
    unknown = [k for k in p if k not in PROMPT_KEYS]
    if unknown:
        hint = (" (chat messages go under 'prompt': {'prompt': [{'role': ..., 'content': ...}, ...]})"
                if {"role", "content"} & set(p) else "")
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(PROMPT_KEYS)}){hint}")
    if p.get("prompt") is None and p.get("prompt_token_ids") is None and p.get("prompt_embeds") is None:
        raise ValueError(f"{where}: needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'")
    prompt = p.get("prompt")
    if isinstance(prompt, list):
        check_messages(prompt, f"{where}: prompt")
    elif prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}: prompt: expected text or a list of chat messages, got {type(prompt).__name__}")
    ids = p.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, (list, tuple, np.ndarray)) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{where}: prompt_token_ids: expected a list of ints")
        ids = [int(t) for t in ids]
    embeds = p.get("prompt_embeds")
    if embeds is not None:
        try:
            embeds = np.asarray(embeds, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: prompt_embeds: expected a [num_tokens, hidden] array of numbers") from None
        if embeds.ndim != 2:
            raise ValueError(f"{where}: prompt_embeds: expected shape [num_tokens, hidden], got {embeds.shape}")
    for key in ("request_id", "cache_salt"):
        if p.get(key) is not None and not isinstance(p[key], str):
            raise ValueError(f"{where}: {key}: expected a str, got {type(p[key]).__name__}")
    return StageInput(p.get("request_id") or new_id(), prompt=prompt, prompt_token_ids=ids, prompt_embeds=embeds,
                      mm_inputs=mm_inputs(p.get("multi_modal_data"), f"{where}: multi_modal_data"),
                      cache_salt=p.get("cache_salt"))


def check_messages(messages: Any, where: str) -> None:
    """Chat messages: a non-empty list of {"role": str, "content": str | [part, ...]}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of chat messages")
    for j, msg in enumerate(messages):
        at = f"{where}: messages[{j}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{at}: expected a dict with 'role' and 'content', got {type(msg).__name__}")
        if not isinstance(msg.get("role"), str) or not msg["role"]:
            raise ValueError(f"{at}.role: expected a non-empty str (system, user, assistant, ...), "
                             f"got {msg.get('role')!r}")
        content = msg.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(f"{at}.content: expected text or a list of content parts, got {type(content).__name__}")
        for k, part in enumerate(content):
            kind = part.get("type", "text") if isinstance(part, Mapping) else None
            if kind not in PART_TYPES:
                raise ValueError(f"{at}.content[{k}]: expected a dict with 'type' in {PART_TYPES}, got {part!r:.80}")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"{at}.content[{k}].text: expected a str, got {type(part.get('text')).__name__}")


def text_only_messages(messages: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    """Messages for a text-only chat template: text parts joined, media parts refused."""
    check_messages(messages, "prompt")
    out = []
    for j, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            media = [p.get("type") for p in content if p.get("type", "text") != "text"]
            if media:
                raise ValueError(f"prompt: messages[{j}].content: stage {stage!r} takes text only, got {media[0]!r}")
            msg = {**msg, "content": "".join(p["text"] for p in content)}
        out.append(msg)
    return out


def tokenize_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], use_chat_template: bool,
                    stage: str) -> list[int]:
    """A text prompt's token ids as a stage computes them: plain text with the tokenizer's special tokens,
    chat messages (or text under `use_chat_template`) through the chat template with the generation prompt.
    The stage's engine and the driver's router (omni/pipeline/routing/keys.py) both call this, so that the
    block hashes the router computes are the ones the stage caches."""
    if isinstance(prompt, list):
        messages = text_only_messages(prompt, stage)
    elif use_chat_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - Jinja errors: say which field, not where in the template
        raise ValueError(f"prompt: the chat template of stage {stage!r} cannot render these messages: "
                         f"{type(e).__name__}: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def mm_inputs(data: Any, where: str) -> list[MultiModalInput]:
    """{"image": array | [arrays], "audio": wave | (wave, rate) | [...]} -> MultiModalInputs.

    Structure only (modality, array of numbers, rate); the stage checks the content."""
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a dict like {{'image': array}}, got {type(data).__name__}")
    out = []
    for modality, items in data.items():
        if modality not in MODALITIES:
            raise ValueError(f"{where}: unknown modality {modality!r} (allowed: {', '.join(MODALITIES)})")
        for k, item in enumerate(items if isinstance(items, list) else [items]):
            at, rate = f"{where}.{modality}[{k}]", None
            if isinstance(item, tuple):
                if modality != "audio" or len(item) != 2:
                    what = "(waveform, sampling_rate)" if modality == "audio" else "an array"
                    raise ValueError(f"{at}: expected {what}, got a tuple of {len(item)}")
                item, rate = item
                if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
                    raise ValueError(f"{at}: sampling_rate: expected an int > 0 (Hz), got {rate!r}")
                rate = int(rate)
            try:
                arr = np.asarray(item)
            except ValueError:  # ragged nested lists
                arr = np.asarray(None)
            if not np.issubdtype(arr.dtype, np.number):
                raise ValueError(f"{at}: expected an array of numbers, got {type(item).__name__} ({arr.dtype})")
            out.append(MultiModalInput(modality, arr, sampling_rate=rate))
    return out
