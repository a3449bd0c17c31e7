"""vLLM's /tokenize and /detokenize requests: a text prompt (as /v1/completions takes it) or chat messages (as
/v1/chat/completions takes them), and token ids."""
from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from omni.serve.protocol.base import RequestModel, check_unsupported
from omni.serve.protocol.chat import ChatMessage, ToolDef


class TokenizeCompletionRequest(RequestModel):
    model: str | None = Field(None, description="The served model name (optional, as in vLLM).")
    prompt: str = Field(description="Text, tokenized as /v1/completions tokenizes it.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS, ...).")
    return_token_strs: bool | None = Field(False, description="Also return each token's string.")


class TokenizeChatRequest(RequestModel):
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
        check_unsupported(self, {"continue_final_message": (False,), "chat_template": (None, ""),
                                 "mm_processor_kwargs": (None, {})})
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = Field(None, description="The served model name (optional, as in vLLM).")
    tokens: list[int] = Field(description="Token ids of the entry stage's tokenizer.")
