"""The OpenAI response shapes `omni serve` sends (plain dicts, serialized once).

Non-streaming: a `chat.completion` whose message has `content` (the text) and `audio` (`id`, base64
`data` as WAV or pcm16, `transcript`, `expires_at`), or a `text_completion`. Streaming: one
`chat.completion.chunk` / `text_completion` per piece; audio as base64 pcm16 in `delta.audio.data`,
then a chunk with the finish reason, then (stream_options.include_usage) one with the usage. A text
piece of a reply that also speaks is in `delta.content` and, as OpenAI streams an audio reply's text,
in `delta.audio.transcript` (the non-streamed message has both too), with an empty `data`.

vLLM-Omni's streamed chat (`omni_stream_format: "vllm-omni"`): every chunk has a top-level `modality`
("text" or "audio"); an audio chunk's `delta` is `{"role": "assistant", "content": <base64>}`, the
piece as a file of its own in the request's `audio.format` (wav by default; flac, mp3, opus), which
its client decodes chunk by chunk as an audio file; pcm16 is raw samples, as vLLM-Omni sends it.
"""
from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from omni.messages import TokenLogprob
from omni.serve.audio.formats import encode
from omni.serve.generation.openai_shapes import floor_logprob, new_id, token_entry
from omni.serve.generation.tool_parser import parse_tool_calls
from omni.serve.generation.tools import reply_tool_calls
from omni.serve.state import AUDIO_TTL_S


def speaks(run: Any) -> bool:
    """Whether the reply was asked for audio (at once, or voiced once its text is whole)."""
    return run.job.audio_stage is not None or run.job.voice_after is not None


def usage(run: Any) -> dict[str, Any]:
    """OpenAI's chat usage: the completion is the reply's text tokens and, for a spoken reply, its audio tokens
    (the talker's codec tokens), each also in completion_tokens_details."""
    completion = run.completion_tokens + run.audio_tokens
    u: dict[str, Any] = {"prompt_tokens": run.prompt_tokens, "completion_tokens": completion,
                         "total_tokens": run.prompt_tokens + completion}
    if speaks(run):
        u["completion_tokens_details"] = {"text_tokens": run.completion_tokens, "audio_tokens": run.audio_tokens}
    if run.cached_tokens is not None:  # known from the first delta on (unknown only if none came)
        u["prompt_tokens_details"] = {"cached_tokens": run.cached_tokens,
                                      "audio_tokens": run.prompt_mm_tokens.get("audio", 0)}
    return u


def audio_message(samples: list[np.ndarray], rate: int, fmt: str, transcript: str) -> dict[str, Any]:
    wave = np.concatenate(samples) if samples else np.zeros(0, np.float32)
    data = encode(wave, rate, "pcm" if fmt == "pcm16" else fmt)  # chat's pcm16 is the speech endpoint's pcm
    return {"id": new_id("audio"), "data": base64.b64encode(data).decode("ascii"),
            "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": transcript}


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs`: per token its text, log-probability, bytes and `top_logprobs`."""
    if entries is None:
        return None
    return {"content": [{**token_entry(e.token, e.logprob, e.token_bytes),
                         "top_logprobs": [token_entry(t, lp, raw) for _, lp, t, raw in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's (legacy) completions `logprobs`: tokens, token_logprobs, top_logprobs (text -> log-probability)
    and text_offset (each token's first character in the text, from `offset`).

    Each top_logprobs entry holds the sampled token first, then the `logprobs` most likely ones (up to
    logprobs + 1 entries, as OpenAI and vLLM: with logprobs 0 the sampled token alone, not {})."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token or "")
    return {"tokens": [e.token or "" for e in entries], "token_logprobs": [floor_logprob(e.logprob) for e in entries],
            "top_logprobs": [{(e.token or ""): floor_logprob(e.logprob),
                              **{(t or ""): floor_logprob(lp) for _, lp, t, _raw in e.top}} for e in entries],
            "text_offset": offsets}


def prompt_logprobs(entries: list[TokenLogprob | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob, rank,
    decoded_token}} of the token itself and the most likely ones (their ranks 1, 2, ... in order)."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        pos = {str(t): {"logprob": floor_logprob(lp), "rank": r, "decoded_token": text} for r, (t, lp, text, _raw) in
               enumerate(e.top, start=1)}
        pos[str(e.token_id)] = {"logprob": floor_logprob(e.logprob), "rank": e.rank, "decoded_token": e.token}
        out.append(pos)
    return out


def _with_prompt_logprobs(choice: dict[str, Any], run: Any) -> dict[str, Any]:
    if run.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(run.prompt_logprobs)
    return choice


def chat_completion(rid: str, model: str, created: int, choices: Any,
                    audios: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The reply of every choice (a Choices: its runs, in order), each with its audio (or None)."""
    out = []
    for index, (run, audio) in enumerate(zip(choices.runs, audios)):
        message: dict[str, Any] = {"role": "assistant",
                                   "content": run.text if run.job.text_stage is not None else None}
        calls, finish_reason = reply_tool_calls(run.job.forced_tool, run.text, run.finish_reason)
        if calls is not None:
            message["content"], message["tool_calls"] = None, calls
        elif run.job.tool_parser is not None:
            content, calls = parse_tool_calls(run.text)
            if calls is not None:
                message["content"], message["tool_calls"], finish_reason = content, calls, "tool_calls"
        if audio is not None:
            message["audio"] = audio
        out.append(_with_prompt_logprobs({"index": index, "message": message, "finish_reason": finish_reason,
                                          "stop_reason": run.stop_reason if finish_reason == "stop" else None,
                                          "logprobs": chat_logprobs(run.logprobs)}, run))
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage(choices)}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any] | None, *,
               finish_reason: str | None = None, usage_: dict[str, Any] | None = None,
               modality: str | None = None, logprobs: dict[str, Any] | None = None, index: int = 0,
               stop_reason: str | int | None = None) -> dict[str, Any]:
    """One chunk of choice `index`; `delta` None: the usage chunk (no choices). `modality`: vLLM-Omni's
    top-level field."""
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [] if delta is None else [
                                 {"index": index, "delta": delta, "finish_reason": finish_reason,
                                  "logprobs": logprobs}]}
    if finish_reason is not None and delta is not None:
        chunk["choices"][0]["stop_reason"] = stop_reason if finish_reason == "stop" else None  # vLLM's field
    if usage_ is not None:
        chunk["usage"] = usage_
    if modality is not None:
        chunk["modality"] = modality
    return chunk


def text_delta(text: str, audio_id: str | None) -> dict[str, Any]:
    """A text piece; `audio_id`: the reply speaks, so the piece is its audio's transcript too (with no
    samples: `data` is empty, so a client that decodes every `delta.audio.data` gets zero bytes)."""
    if audio_id is None:
        return {"content": text}
    return {"content": text, "audio": {"id": audio_id, "transcript": text, "data": ""}}


def audio_delta(audio_id: str, pcm: bytes) -> dict[str, Any]:
    """OpenAI's delta of one pcm16 chunk of a spoken reply."""
    return {"audio": {"id": audio_id, "data": base64.b64encode(pcm).decode("ascii"),
                      "expires_at": int(time.time()) + AUDIO_TTL_S}}


def vllm_audio_delta(samples: np.ndarray, rate: int, fmt: str) -> dict[str, Any]:
    """vLLM-Omni's delta of one audio chunk (its chunk's `modality` is "audio"): the samples as a
    self-contained file of the request's `audio.format` (`fmt`; pcm16: raw samples, no header), base64,
    in `content`."""
    data = encode(samples, rate, "pcm" if fmt == "pcm16" else fmt)
    return {"role": "assistant", "content": base64.b64encode(data).decode("ascii")}


def echo_logprobs(run: Any) -> dict[str, Any]:
    """The prompt's tokens as completions' `logprobs` list them (vLLM's echo): each token's text decoded alone,
    its log-probability (null for the first: nothing precedes it), the most likely tokens at its position and
    itself in `top_logprobs` (null for the first)."""
    texts = run.prompt_token_texts or []
    entries = run.prompt_logprobs or []
    out: dict[str, Any] = {"tokens": list(texts), "token_logprobs": [], "top_logprobs": []}
    for i, _ in enumerate(texts):
        e = entries[i] if i < len(entries) else None
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {(t or ""): floor_logprob(lp) for _, lp, t, _raw in e.top}
        top[texts[i]] = floor_logprob(e.logprob)
        out["token_logprobs"].append(floor_logprob(e.logprob))
        out["top_logprobs"].append(top)
    out["text_offset"] = _offsets(out["tokens"])
    return out


def _offsets(tokens: list[str]) -> list[int]:
    """Each token's first character in the text the tokens make, from 0."""
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets


def _completion_choice(index: int, run: Any) -> dict[str, Any]:
    """One choice of a text_completion; with echo the prompt (as the text stage saw it, decoded) leads its
    text and, when asked, its logprobs (text_offset then counts from the prompt's first character)."""
    job = run.job
    generated = completion_logprobs(run.logprobs)
    if not job.echo:
        return _with_prompt_logprobs({"index": index, "text": run.text, "finish_reason": run.finish_reason,
                                      "stop_reason": run.stop_reason, "logprobs": generated}, run)
    prompt = run.prompt_text or ""
    text = prompt if job.echo_only else prompt + run.text
    logprobs = None
    if job.echo_logprobs:  # (with echo, logprobs asked for the reply are asked for the prompt too: translate._echo)
        logprobs = echo_logprobs(run)
        if generated is not None and not job.echo_only:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                logprobs[key] += generated[key]
        logprobs["text_offset"] = _offsets(logprobs["tokens"])
    choice = {"index": index, "text": text, "finish_reason": run.finish_reason, "stop_reason": run.stop_reason,
              "logprobs": logprobs}
    # Asked for by `prompt_logprobs` itself (not only computed for echo): vLLM's field too.
    return _with_prompt_logprobs(choice, run) if job.show_prompt_logprobs else choice


def completion(rid: str, model: str, created: int, choices: Any) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(index, run) for index, run in enumerate(choices.runs)],
            "usage": completion_usage(choices)}


def completion_usage(choices: Any) -> dict[str, Any]:
    out = usage(choices)
    if choices.runs and choices.runs[0].job.echo_only:
        out["total_tokens"] -= out["completion_tokens"]
        out["completion_tokens"] = 0  # the token sampled only because an engine request samples one
    return out


def completion_chunk(rid: str, model: str, created: int, text: str | None, *, finish_reason: str | None = None,
                     usage_: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None,
                     index: int = 0, stop_reason: str | int | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [] if text is None else [
                                 {"index": index, "text": text, "finish_reason": finish_reason,
                                  "logprobs": logprobs}]}
    if finish_reason is not None and text is not None:
        chunk["choices"][0]["stop_reason"] = stop_reason  # vLLM's field
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk
