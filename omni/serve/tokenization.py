"""vLLM's tokenizer endpoints, on the pipeline's entry stage: POST /tokenize, POST /detokenize.

    POST /tokenize     {"model"?, "prompt": str, "add_special_tokens": true, "return_token_strs": false}
                       {"model"?, "messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
                        "tools"?, "return_token_strs": false}
                       -> {"count", "max_model_len", "tokens": [int], "token_strs": [str] | null}
    POST /detokenize   {"model"?, "tokens": [int]} -> {"prompt": str}

The tokens are the entry stage's own: the same function (omni.prompts.tokenize_prompt) over the same tokenizer,
loaded here, in the server's process, the way the router loads it (omni/pipeline/routing/keys.py: the stage
config's tokenizer, or the model's, never downloaded here; the stages may run in other processes, so their
engines are not reached). A text prompt is what /v1/completions sends (plain text, never a chat template); chat
messages are what /v1/chat/completions sends (the chat template, the generation prompt, the request's tools):
/tokenize of them counts what `usage.prompt_tokens` reports. Left at their defaults, `add_special_tokens` and
`add_generation_prompt` ask for exactly that; other values are tokenized as vLLM does (the template rendered,
then tokenized with or without the special tokens).

What cannot be tokenized here is a 400 that says why: an entry stage whose model renders its own prompt (the
Qwen-Omni thinkers: their own prompt format, system prompt and media placeholders; the server knows it from the
stage's `shows_tools` stat, PipelineInfo.shows_tools), one with no tokenizer (a token-id-only model, or its files
not on this machine), media parts (the text-only tokenizer has no placeholders for them), an id outside the
tokenizer's vocabulary (/detokenize, naming `tokens`). `model` is optional, as in vLLM; another model's name is
a 404. The middleware guards both (and /version) with the server's API key as it guards /v1/* (vLLM's own
guards /v1 only), takes JSON bodies only and refuses them while the server drains.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import threading
from typing import Any

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse

from omni import registry
from omni.config import StageConfig
from omni.errors import RequestError
from omni.prompts import tokenize_prompt
from omni.serve.endpoints import ServerState, _earlier_audio_replies, parse
from omni.serve.errors import bad_request, from_omni_error
from omni.serve.protocol import ChatMessage, ToolDef, _Strict, field_error
from omni.serve.tools import template_tool_calls
from omni.serve.translate import check_model
from omni.stage_tokenizer import load_stage_tokenizer

logger = logging.getLogger(__name__)


def omni_version() -> str:
    """The installed package's version (the project's own constant when it is not installed)."""
    try:
        return importlib.metadata.version("omni")
    except importlib.metadata.PackageNotFoundError:
        from omni import __version__

        return __version__


# ------------------------------------------------------------------ requests
class TokenizeCompletionRequest(_Strict):
    model: str | None = Field(None, description="The served model name (optional, as in vLLM).")
    prompt: str = Field(description="Text, tokenized as /v1/completions tokenizes it.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS, ...).")
    return_token_strs: bool | None = Field(False, description="Also return each token's string.")


class TokenizeChatRequest(_Strict):
    model: str | None = Field(None, description="The served model name (optional, as in vLLM).")
    messages: list[ChatMessage] = Field(min_length=1, description="Chat messages, as /v1/chat/completions takes "
                                        "them (text parts only).")
    add_generation_prompt: bool = Field(True, description="End with the assistant turn's opening, as a chat "
                                        "completion's prompt does.")
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens to the rendered "
                                     "template (the template has its own).")
    return_token_strs: bool | None = Field(False, description="Also return each token's string.")
    tools: list[ToolDef] | None = Field(None, description="Tools the chat template shows the model.")
    # vLLM's fields this server does not implement: accepted when they ask for nothing.
    continue_final_message: bool = Field(False, description="vLLM's: not implemented (false).")
    chat_template: str | None = Field(None, description="vLLM's: not implemented (null): the stage's template.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: the chat template's variables, "
                                                        "as /v1/chat/completions takes them.")
    mm_processor_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: not implemented (null or {}).")

    @model_validator(mode="after")
    def _unsupported(self) -> "TokenizeChatRequest":
        if self.continue_final_message:
            raise field_error("continue_final_message", "this server does not implement it: send it absent or "
                              "as false", "unsupported_parameter")
        for name in ("chat_template", "mm_processor_kwargs"):
            if getattr(self, name):
                nothing = "null" if name == "chat_template" else "null or {}"
                raise field_error(name, f"this server does not implement it: send it absent or as {nothing}",
                                  "unsupported_parameter")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = Field(None, description="The served model name (optional, as in vLLM).")
    tokens: list[int] = Field(description="Token ids of the entry stage's tokenizer.")


# ------------------------------------------------------------------ the tokenizer
class EntryTokenizer:
    """The entry stage's tokenizer in the server's process, loaded on first use (off the event loop), and what the
    responses need of the stage (its max_model_len in force, from its stats)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.stage: StageConfig = state.omni.config.stage(state.info.entry_stage)
        self._tok: Any = None
        self._why_not: str | None = None  # set once loading failed: why there is no tokenizer
        self._loaded = False
        self._load_lock = asyncio.Lock()
        self._use = threading.Lock()  # a fast tokenizer is not to be used by two threads at once
        self._max_model_len: int | None = None

    @property
    def renders_own_prompt(self) -> bool:
        """The entry stage's model turns text and chat messages into tokens itself (its stats say whether it
        shows the model tools only then): tokenize_prompt is not what it computes."""
        return self.state.info.shows_tools is not None

    def _load(self) -> None:
        try:
            if not registry.stage_model_entry(self.stage.model).autoregressive:
                self._why_not = "its model takes no text prompt to tokenize (a one-shot stage)"
                return
            self._tok = load_stage_tokenizer(self.stage)
        except Exception as e:  # noqa: BLE001 - a stage without a tokenizer here (a token-id-only model)
            logger.info("stage %s: no tokenizer in the server (%s)", self.stage.name, e)
            self._why_not = str(e)

    async def get(self) -> Any:
        """The tokenizer, or a 400 naming `model` that says why there is none."""
        if not self._loaded:
            async with self._load_lock:
                if not self._loaded:
                    await asyncio.to_thread(self._load)
                    self._loaded = True
        if self._tok is None:
            raise bad_request(f"model: the entry stage {self.stage.name!r} of {self.state.info.model!r} cannot "
                              f"tokenize here: {self._why_not}", "model", "unsupported_value")
        return self._tok

    async def run(self, fn: Any, *args: Any) -> Any:
        """fn(tokenizer, *args) in a worker thread, one use of the tokenizer at a time."""
        tok = await self.get()

        def call() -> Any:
            with self._use:
                return fn(tok, *args)

        return await asyncio.to_thread(call)

    async def max_model_len(self) -> int | None:
        """The entry stage's max_model_len in force (its stats; the config's while the stats do not say)."""
        if self._max_model_len is None:
            try:
                stats = await self.state.omni.stats()
                self._max_model_len = int(stats["stages"][self.stage.name]["max_model_len"])
            except Exception:  # noqa: BLE001 - the config's, until the stats answer
                logger.debug("tokenize: the entry stage's stats are unavailable", exc_info=True)
                return self.stage.scheduler.max_model_len
        return self._max_model_len


# ------------------------------------------------------------------ the edge
def _template_messages(req: TokenizeChatRequest, stage: str) -> list[dict[str, Any]]:
    """The messages as chat_job hands them to the entry stage (translate.py), text parts only."""
    out = []
    for i, msg in enumerate(req.messages):
        texts = []
        for j, part in enumerate(msg.content or []):
            if part.type != "text":
                raise bad_request(f"messages[{i}].content[{j}]: /tokenize takes text parts only (the entry stage "
                                  f"{stage!r} tokenizes text; got a {part.type} part)", f"messages[{i}].content[{j}]",
                                  "unsupported_value")
            texts.append(part.text)
        message: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role,
                                   "content": None if msg.content is None else "".join(texts)}
        if msg.tool_calls:
            message["tool_calls"] = template_tool_calls(msg.tool_calls)
        if msg.tool_call_id is not None:
            message["tool_call_id"] = msg.tool_call_id
        out.append(message)
    return out


def _chat_ids(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, stage: StageConfig,
              req: TokenizeChatRequest) -> list[int]:
    # at the defaults, what a chat completion's prompt is; vLLM's other cases: the template rendered, then tokenized
    special = None if req.add_generation_prompt and not req.add_special_tokens else req.add_special_tokens
    return tokenize_prompt(tok, messages, stage.use_chat_template, stage.name, tools, req.chat_template_kwargs,
                           add_generation_prompt=req.add_generation_prompt, add_special_tokens=special)


def _text_ids(tok: Any, prompt: str, stage: StageConfig, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:  # a completion's text prompt: plain text, never a chat template (translate.py)
        return tokenize_prompt(tok, prompt, False, stage.name)
    return list(tok(prompt, add_special_tokens=False)["input_ids"])


async def tokenize(state: ServerState, entry: EntryTokenizer, request: Request) -> JSONResponse:
    body = await request.body()
    try:
        chat = isinstance(data := json.loads(body), dict) and "messages" in data
    except ValueError:
        chat = False  # the parser words the error
    req: TokenizeChatRequest | TokenizeCompletionRequest = parse(
        TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    if req.model is not None:
        check_model(req.model, state.info)
    stage = entry.stage
    if entry.renders_own_prompt:
        what = ("chat messages" if chat else "a text prompt (as a user turn)")
        field = "messages" if chat else "prompt"
        raise bad_request(f"{field}: the entry stage {stage.name!r} renders {what} into tokens itself (its model's "
                          "own prompt format, system prompt and media placeholders), which /tokenize cannot reproduce "
                          "here; a chat completion's usage.prompt_tokens counts them", field, "unsupported_value")
    fields = {"prompt": "messages", "tools": "tools"} if chat else {"prompt": "prompt"}  # omni's -> the request's
    try:
        if isinstance(req, TokenizeChatRequest):
            _earlier_audio_replies(req, state.audio_transcripts)  # as the chat endpoint reads them
            messages = _template_messages(req, stage.name)
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await entry.run(_chat_ids, messages, tools, stage, req)
        else:
            ids = await entry.run(_text_ids, req.prompt, stage, req.add_special_tokens)
    except RequestError as e:
        raise from_omni_error(e, fields) from None
    strs = await entry.run(lambda tok: list(tok.convert_ids_to_tokens(ids))) if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": await entry.max_model_len(), "tokens": ids,
                         "token_strs": strs})


def _decode(tok: Any, ids: list[int], stage: str) -> str:
    size = len(tok)
    for k, t in enumerate(ids):
        if not 0 <= t < size:
            raise bad_request(f"tokens[{k}]: token id {t} is out of vocabulary (allowed 0..{size - 1}: the "
                              f"tokenizer of stage {stage!r} has {size} tokens)", "tokens", "invalid_value")
    return tok.decode(ids, skip_special_tokens=False)


async def detokenize(state: ServerState, entry: EntryTokenizer, request: Request) -> JSONResponse:
    req = parse(DetokenizeRequest, await request.body())
    if req.model is not None:
        check_model(req.model, state.info)
    return JSONResponse({"prompt": await entry.run(_decode, req.tokens, entry.stage.name)})
