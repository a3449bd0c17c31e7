"""vLLM's tokenizer endpoints, on the pipeline's entry stage: POST /tokenize, POST /detokenize.

    POST /tokenize     {"model"?, "prompt": str, "add_special_tokens": true, "return_token_strs": false}
                       {"model"?, "messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
                        "tools"?, "chat_template_kwargs"?, "return_token_strs": false}
                       -> {"count", "max_model_len", "tokens": [int], "token_strs": [str] | null}
    POST /detokenize   {"model"?, "tokens": [int]} -> {"prompt": str}

The tokens are the entry stage's own, computed where it runs (AsyncOmni.tokenize: its engine's tokenizer and
prompt renderer, the omni thinkers' own prompt format and system prompt included). A text prompt is what
/v1/completions sends (plain text, never a chat template); chat messages are what /v1/chat/completions sends (the
chat template, the generation prompt, the request's tools): /tokenize of them counts what `usage.prompt_tokens`
reports. `add_generation_prompt` false and `add_special_tokens` (vLLM's other cases) apply where the stage's chat
template renders the prompt; a stage that renders its own refuses them by name. Media parts are refused (the
placeholders are the model's). `model` is optional, as in vLLM; another model's name is a 404. The middleware
guards both (and /version) with the server's API key as it guards /v1/* (vLLM's own guards /v1 only), takes JSON
bodies only and refuses them while the server drains.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from omni.errors import OmniError
from omni.messages import StageInput
from omni.serve.chat.jobs import stage_message
from omni.serve.chat.serving_chat import earlier_audio_replies
from omni.serve.http.errors import bad_request, from_omni_error
from omni.serve.protocol.parse import parse_request
from omni.serve.protocol.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from omni.serve.state import ServerState, check_model


# ------------------------------------------------------------------ the edge
def _template_messages(req: TokenizeChatRequest, stage: str) -> list[dict[str, Any]]:
    """The messages as chat_job hands them to the entry stage (translate.stage_message), text parts only."""
    out = []
    for i, msg in enumerate(req.messages):
        for j, part in enumerate(msg.content or []):
            if part.type != "text":
                raise bad_request(f"messages[{i}].content[{j}]: /tokenize takes text parts only (the entry stage "
                                  f"{stage!r} tokenizes text; got a {part.type} part)", f"messages[{i}].content[{j}]",
                                  "unsupported_value")
        out.append(stage_message(msg, [{"type": "text", "text": part.text} for part in msg.content or []]))
    return out


async def tokenize(state: ServerState, request: Request) -> JSONResponse:
    body = await request.body()
    try:
        chat = isinstance(data := json.loads(body), dict) and "messages" in data
    except ValueError:
        chat = False  # the parser words the error
    req: TokenizeChatRequest | TokenizeCompletionRequest = parse_request(
        TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    if req.model is not None:
        check_model(req.model, state.info)
    fields = {"prompt": "messages", "tools": "tools"} if chat else {"prompt": "prompt"}  # omni's -> the request's
    if isinstance(req, TokenizeChatRequest):
        earlier_audio_replies(req, state.audio_transcripts)  # as the chat endpoint reads them
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        inp = StageInput("tokenize", prompt=_template_messages(req, state.info.entry_stage), tools=tools,
                         chat_template_kwargs=dict(req.chat_template_kwargs) if req.chat_template_kwargs else None)
        # at the defaults, what a chat completion's prompt is; vLLM's other cases: the template rendered, then
        # tokenized with or without the special tokens
        special = None if req.add_generation_prompt and not req.add_special_tokens else req.add_special_tokens
        kw = {"add_generation_prompt": req.add_generation_prompt, "add_special_tokens": special}
        fields.update(add_generation_prompt="add_generation_prompt", add_special_tokens="add_special_tokens")
    else:
        # a completion's text prompt: plain text, never a chat template (chat/jobs.py); without its special tokens
        inp = StageInput("tokenize", prompt=req.prompt, chat_template=False)
        kw = {"add_special_tokens": None if req.add_special_tokens else False}
    try:
        out = await state.omni.tokenize(inp, return_token_strs=bool(req.return_token_strs), **kw)
    except OmniError as e:
        raise from_omni_error(e, fields) from None
    return JSONResponse({"count": len(out["tokens"]), "max_model_len": out["max_model_len"], "tokens": out["tokens"],
                         "token_strs": out["token_strs"]})


async def detokenize(state: ServerState, request: Request) -> JSONResponse:
    req = parse_request(DetokenizeRequest, await request.body())
    if req.model is not None:
        check_model(req.model, state.info)
    try:
        return JSONResponse({"prompt": await state.omni.detokenize(req.tokens)})
    except OmniError as e:
        raise from_omni_error(e, {"tokens": "tokens"}) from None
