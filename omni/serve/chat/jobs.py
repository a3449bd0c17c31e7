"""OpenAI requests -> what AsyncOmni runs (a Job): the prompt, per-stage sampling, what to send back.

    chat messages          -> chat messages for the entry stage; each image_url / input_audio / video_url part
                              becomes an {"type": "image" | "audio" | "video"} part + its decoded array in
                              mm_inputs (images RGB uint8, audio mono float32 resampled to the model's rate,
                              a video its file's bytes: the stage decodes the frames it samples)
    mm_processor_kwargs    -> StageInput.mm_processor_kwargs (use_audio_in_video)
    top-level sampling     -> the text stage (the stage whose final_output is text), over its defaults
    sampling_params_list   -> stage i (config order), over its defaults; the top-level fields win on the text stage
    cache_salt             -> StageInput.cache_salt;  audio.voice -> the request's speaker

No engine logic: the stages check what they check (vocabulary, max_model_len, media content).
"""
from __future__ import annotations

from typing import Any

from omni.messages import MultiModalInput, StageInput
from omni.serve.audio.codecs import decode_audio
from omni.serve.media import b64decode, decode_image, parse_data_url, video_bytes
from omni.serve.generation.job import TOP_LEVEL_SAMPLING, Job, voice_short_replies
from omni.serve.generation.tools import force_tool_call, template_tool_calls
from omni.serve.http.errors import bad_request, too_large
from omni.serve.protocol.chat import ChatCompletionRequest
from omni.serve.protocol.completions import CompletionRequest
from omni.serve.settings import ServeSettings
from omni.serve.state import PipelineInfo
from omni.serve.voices.choice import uploaded_for_cascade, voice_extra
from omni.serve.voices.store import UploadedVoices


def _sampling(req: ChatCompletionRequest | CompletionRequest, info: PipelineInfo, job: Job) -> None:
    if req.sampling_params_list is not None:
        if len(req.sampling_params_list) != len(info.stages):
            raise bad_request(f"sampling_params_list: one entry per stage ({len(info.stages)}: "
                              f"{', '.join(info.stages)}), got {len(req.sampling_params_list)}",
                              "sampling_params_list")
        for i, (stage, entry) in enumerate(zip(info.stages, req.sampling_params_list)):
            if entry:
                job.sampling[stage] = dict(entry)
                job.from_list[stage] = (i, set(entry))
    top = {name: getattr(req, name) for name in TOP_LEVEL_SAMPLING if getattr(req, name) is not None}
    if req.num_logprobs is not None:
        top["logprobs"] = req.num_logprobs
    if req.token_limit is not None:
        top["max_tokens"] = req.token_limit
    elif "max_tokens" not in job.sampling.get(info.text_stage or info.entry_stage, {}):
        # vLLM's: a request that sets no bound generates up to what the context leaves, not past it (the stage's
        # default max_tokens is then a bound only, never the reason a long prompt is refused)
        top["max_tokens_fit"] = True
        if job.audio_stage is not None:
            top["reserve_tokens"] = info.context_reserve
    fmt = req.response_format
    if fmt is not None and fmt.structured_outputs is not None:
        if req.structured_outputs is not None:
            raise bad_request("response_format: and structured_outputs say the same thing twice; send one",
                              "response_format")
        top["structured_outputs"] = fmt.structured_outputs
        job.fields["structured_outputs"] = ("response_format.json_schema.schema" if fmt.type == "json_schema"
                                            else "response_format")
    guided = [(name, spec) for name, spec in (("guided_json", {"json": req.guided_json}),
                                              ("guided_regex", {"regex": req.guided_regex}),
                                              ("guided_choice", {"choice": req.guided_choice}))
              if getattr(req, name) is not None]
    if guided:  # vLLM's older spelling of structured outputs
        if len(guided) > 1 or "structured_outputs" in top or req.structured_outputs is not None:
            raise bad_request(f"{guided[0][0]}: one constraint at a time (guided_json, guided_regex, guided_choice, "
                              "response_format or structured_outputs)", guided[0][0])
        top["structured_outputs"] = guided[0][1]
        job.fields["structured_outputs"] = guided[0][0]
    if req.stops:  # the text stage stops itself (SamplingParams.stop): stop_reason, and no audio past the string
        top["stop"] = list(req.stops)
        job.fields["stop"] = "stop"
    if req.truncate_prompt_tokens is not None:  # the caller's prompt is the entry stage's
        job.sampling[info.entry_stage] = {**job.sampling.get(info.entry_stage, {}),
                                          "truncate_prompt_tokens": req.truncate_prompt_tokens}
        job.fields["truncate_prompt_tokens"] = "truncate_prompt_tokens"
    if top:
        stage = info.text_stage or info.entry_stage
        job.sampling[stage] = {**job.sampling.get(stage, {}), **top}
        if stage in job.from_list:  # the top-level fields win: errors name them
            job.from_list[stage][1].difference_update(top)


def stage_message(msg: Any, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A request's chat message as the entry stage takes it, its content parts already converted (text, or a media
    placeholder {"type": "image" | "audio"}): chat_job's, and /tokenize's (chat/serving_tokenize.py)."""
    content: Any = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if msg.content is None:
        content = None  # an assistant turn of tool calls only
    message: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
    if msg.tool_calls:
        message["tool_calls"] = template_tool_calls(msg.tool_calls)
    if msg.tool_call_id is not None:
        message["tool_call_id"] = msg.tool_call_id
    return message


def _media_count(req: ChatCompletionRequest) -> int:
    return sum(p.type != "text" for m in req.messages for p in m.content or [])


def chat_job(req: ChatCompletionRequest, info: PipelineInfo, settings: ServeSettings, request_id: str,
             uploaded: UploadedVoices | None = None) -> Job:
    """Decode the media and build the Job (ApiError 400 / 413 naming the field). CPU work: run it off the
    event loop. `uploaded`: the server's uploaded voices (a voice agent speaks in one its request names)."""
    want = req.output_modalities
    if "audio" in want and info.audio_stage is None:
        raise bad_request(f"modalities: pipeline {info.model!r} has no audio output stage", "modalities")
    if "text" in want and info.text_stage is None:
        raise bad_request(f"modalities: pipeline {info.model!r} has no text output stage", "modalities")
    n_media = _media_count(req)
    if n_media > settings.max_media_items:
        raise too_large(f"messages: {n_media} images/audio clips/videos, at most {settings.max_media_items} per "
                        "request (--max-media-items)", "messages")
    fields = {"prompt": "messages", "speaker": "audio.voice", "tools": "tools", "request_id": "request_id",
              "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
              "mm_processor_kwargs": "mm_processor_kwargs",
              "mm_processor_kwargs.use_audio_in_video": "mm_processor_kwargs.use_audio_in_video"}
    messages: list[dict[str, Any]] = []
    media: list[MultiModalInput] = []
    counts = {"image": 0, "audio": 0, "video": 0}
    for i, msg in enumerate(req.messages):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content or []):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            if part.type == "image_url":
                _, data = parse_data_url(part.image_url.url, f"{where}.image_url.url", "image")
                item = MultiModalInput("image", decode_image(data, f"{where}.image_url.url", settings.max_media_bytes))
                at = f"{where}.image_url"
            elif part.type == "video_url":
                at = f"{where}.video_url"
                item = MultiModalInput("video", video_bytes(part.video_url.url, f"{at}.url", settings.max_media_bytes))
            else:
                rate_out = settings.audio_input_rate  # resampled to it; its size bounded before allocating
                if part.type == "input_audio":
                    at = f"{where}.input_audio"
                    data = b64decode(part.input_audio.data, f"{at}.data")
                    wave, _ = decode_audio(data, f"{at}.data", settings.max_media_bytes, rate_out)
                else:
                    at = f"{where}.audio_url"
                    _, data = parse_data_url(part.audio_url.url, f"{at}.url", "audio")
                    wave, _ = decode_audio(data, f"{at}.url", settings.max_media_bytes, rate_out)
                item = MultiModalInput("audio", wave, sampling_rate=rate_out)
            fields[f"multi_modal_data.{item.modality}[{counts[item.modality]}]"] = at
            counts[item.modality] += 1
            media.append(item)
            parts.append({"type": item.modality})
        messages.append(stage_message(msg, parts))
    voice, voice_field = req.voice
    fields["speaker"] = voice_field
    own = uploaded_for_cascade(info, uploaded, voice) if uploaded is not None else None
    extra = voice_extra(info, voice, own)
    if "audio" in want and own is None and (unknown := info.unknown_voice(voice, voice_field)):
        raise bad_request(unknown, voice_field)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    prompt = StageInput("", prompt=messages, mm_inputs=media, cache_salt=req.cache_salt, extra=extra, tools=tools,
                        chat_template_kwargs=dict(req.chat_template_kwargs) if req.chat_template_kwargs else None,
                        mm_processor_kwargs=dict(req.mm_processor_kwargs) if req.mm_processor_kwargs else None)
    job = Job(request_id, prompt, {}, info.text_stage if "text" in want else None,
              info.audio_stage if "audio" in want else None, info.text_stage or info.entry_stage,
              [], fields)
    _sampling(req, info, job)
    if req.forced_tool is not None:
        force_tool_call(req, job)
    elif req.auto_tools:
        if not settings.enable_auto_tool_choice:
            raise bad_request('tool_choice: "auto" (the default with tools) reads tool calls from the reply, which '
                              "this server does not (start it with --enable-auto-tool-choice --tool-call-parser "
                              'hermes, as vLLM): send "required", {"type": "function", "function": {"name": ...}} or '
                              '"none"', "tool_choice", "unsupported_value")
        job.tool_parser = settings.tool_call_parser
        if job.audio_stage is not None:
            job.voice_after, job.audio_stage = job.audio_stage, None
    voice_short_replies(job, info)
    return job


def completion_jobs(req: CompletionRequest, info: PipelineInfo, request_id: str) -> list[Job]:
    """One Job per prompt of the request: its one prompt's, or a batch's in order (request ids `<id>-<k>`)."""
    if len(req.prompts) == 1:
        return [completion_job(req, info, request_id)]
    return [completion_job(req, info, f"{request_id}-{k}", k) for k in range(len(req.prompts))]


def completion_job(req: CompletionRequest, info: PipelineInfo, request_id: str, index: int | None = None) -> Job:
    """The Job of the request's one prompt (index None: errors name `prompt`), or of its batch's prompt `index`
    (errors name `prompt[index]`, the prompt the user can fix)."""
    if info.text_stage is None:
        raise bad_request(f"model: pipeline {info.model!r} has no text output stage; use /v1/chat/completions",
                          "model")
    p = req.prompts[0 if index is None else index]
    where = "prompt" if index is None else f"prompt[{index}]"
    # A text prompt is the model's input as it is (vLLM's completions never apply a chat template).
    prompt = (StageInput("", prompt=p, cache_salt=req.cache_salt, chat_template=False) if isinstance(p, str)
              else StageInput("", prompt_token_ids=list(p), cache_salt=req.cache_salt))
    fields = {"prompt": where, "prompt_token_ids": where, "max_tokens": "max_tokens", "request_id": "request_id"}
    job = Job(request_id, prompt, {}, info.text_stage, None, info.text_stage, [], fields)
    _sampling(req, info, job)
    if req.echo:
        _echo(req, job)
    return job


def _echo(req: CompletionRequest, job: Job) -> None:
    """completions' `echo` (vLLM's semantics): the text stage returns its prompt decoded (what the model saw:
    token ids decoded, and a stage that wraps a raw prompt in its chat template, as the omni thinkers do, echoes
    that, consistent with the tokens `logprobs` lists); with logprobs it also returns the prompt's logprobs (as
    many most likely tokens as `logprobs` asks); max_tokens 0 generates one token that the reply leaves out (an
    engine request samples at least one)."""
    assert job.text_stage is not None
    text = job.sampling.setdefault(job.text_stage, {})
    text["echo_prompt"] = True
    job.echo = True
    if req.logprobs is not None:
        job.echo_logprobs = True
        text["prompt_logprobs"] = max(req.logprobs, text.get("prompt_logprobs") or 0)
        job.show_prompt_logprobs = req.prompt_logprobs is not None
        job.fields.setdefault("prompt_logprobs", "logprobs")
    if req.max_tokens == 0:
        job.echo_only = True
        text["max_tokens"] = 1
