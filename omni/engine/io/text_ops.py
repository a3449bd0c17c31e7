"""vLLM's /tokenize and /detokenize on one autoregressive stage: its tokenizer and its prompt renderer.

A prompt's ids here are exactly the ids admission computes for it (a stage model that renders its own prompt,
the omni thinkers, renders it here too), and nothing of the stage's state changes.
"""
from __future__ import annotations

from typing import Any

from omni.errors import RequestError
from omni.messages import StageInput
from omni.prompts import tokenize_prompt

from omni.engine.io.request_checks import RequestChecker
from omni.engine.stage_model import AutoregressiveStageModel


def renders_own_prompt(model: AutoregressiveStageModel) -> bool:
    """The stage model turns a request's text or chat messages into its prompt itself (its own preprocess)."""
    return type(model).preprocess is not AutoregressiveStageModel.preprocess


class TextOps:
    def __init__(self, name: str, model: AutoregressiveStageModel, checks: RequestChecker):
        self.name = name
        self.model = model
        self.tokenizer = model.tokenizer
        self.checks = checks

    def tokenize(self, inp: StageInput, add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
                 return_token_strs: bool = False) -> dict[str, Any]:
        """{"tokens", "token_strs", "max_model_len"}. At the defaults exactly a request's prompt;
        add_generation_prompt false / add_special_tokens (vLLM's other cases) only where the stage's chat
        template renders it."""
        if self.tokenizer is None:
            raise RequestError(f"prompt: stage {self.name!r} has no tokenizer to tokenize with", stage=self.name,
                               field="prompt")
        if inp.mm_inputs:
            raise RequestError("multi_modal_data: tokenize takes text (the media's placeholders are the model's)",
                               stage=self.name, field="multi_modal_data")
        self.checks.given_not_empty(inp)
        own = renders_own_prompt(self.model)
        if own and (not add_generation_prompt or add_special_tokens is not None):
            field = "add_generation_prompt" if not add_generation_prompt else "add_special_tokens"
            raise RequestError(f"{field}: stage {self.name!r} renders its own prompt, always with the generation "
                               "prompt and its own special tokens", stage=self.name, field=field)
        if own:
            prepared = self.model.preprocess(inp)
            ids = list(prepared.token_ids) if prepared is not None else self.checks.prompt_ids(inp)
        elif inp.prompt is not None and (not add_generation_prompt or add_special_tokens is not None):
            ids = tokenize_prompt(self.tokenizer, inp.prompt, self.checks.use_chat_template
                                  and inp.chat_template is not False, self.name, inp.tools, inp.chat_template_kwargs,
                                  add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens)
        else:
            ids = self.checks.prompt_ids(inp)
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if return_token_strs else None
        return {"tokens": [int(t) for t in ids], "token_strs": strs, "max_model_len": self.checks.max_model_len}

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of the ids, special tokens shown (ids checked against the vocabulary)."""
        if self.tokenizer is None:
            raise RequestError(f"tokens: stage {self.name!r} has no tokenizer to decode with", stage=self.name,
                               field="tokens")
        ids = self.checks.token_ids(list(token_ids), "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=False)
