"""A fake StageEngine (the engine contract, no model) for the tests of everything above the engine
(pipeline, API, CLI, server); its own test is tests/pipeline/test_fake_engine.py.

Tokens are a deterministic function of (stage name, prompt ids, position), so
every backend must produce the same outputs. Magic prompt texts (a text prompt,
or any chat message's text) drive failures: "__bad__" (add_request refuses it: a RequestError, the caller's
fault), "__value_error__" (add_request raises a bare ValueError: the stage's fault), "__error__" (the output carries an
error), "__hang__" (never finishes), "__step_raise__" (step() raises),
"__crash__" (the process exits: Ray tests only). With `model_kwargs: {audio_deltas: true}`
a stage streams audio: each step of a request whose caller streams yields a StageDelta
with its token and a piece of waveform (AUDIO_SAMPLES samples equal to token / 1000).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from omni import registry
from omni.engine.interface import EngineStepOutput, StageStats
from omni.errors import RequestError
from omni.sampling_params import resolve_sampling_params
from omni.messages import StageDelta, StageInput, StageOutput
from omni.registry import register_input_processor, register_stage_model
from omni.stage_info import StageInfo

HIDDEN = 4
AUDIO_SAMPLES = 3


class FakeStageModel:
    """Stands in for a stage model class in configs (model: fake)."""

    info = StageInfo()


class FakeNonARModel:
    info = StageInfo(autoregressive=False, emits_hidden_states=False, streams_input=False)


register_stage_model("fake", "tests.fakes:FakeStageModel", checkpoint=False)
register_stage_model("fake_nar", "tests.fakes:FakeNonARModel", info="tests.fakes:FakeNonARModel.info",
                     checkpoint=False)


def tagged_concat(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """A custom fan-in processor: [1000 + i] before the tokens of the i-th upstream stage."""
    ids: list[int] = []
    for i, out in enumerate(upstream.values()):
        ids += [1000 + i] + list(out.token_ids)
    return StageInput(request.request_id, prompt_token_ids=ids)


def fake_hidden_to_embeds(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Like stages.common.processors:hidden_to_embeds: the upstream hidden states become the prompt embeddings."""
    (out,) = upstream.values()
    if out.hidden_states is None:
        raise ValueError(f"stage {out.stage!r} sent no hidden states")
    return StageInput(request.request_id, prompt_embeds=out.hidden_states)


register_input_processor("tagged_concat", "tests.fakes:tagged_concat")
register_input_processor("fake_hidden_to_embeds", "tests.fakes:fake_hidden_to_embeds")


@dataclass
class _Req:
    rid: str
    text: str
    prompt_ids: list[int]
    max_tokens: int
    arrival: float
    stream: bool = False
    out: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, stage: Any):
        self.stage = stage
        self.name = stage.name
        kw = stage.model_kwargs or {}
        self.step_delay_s = float(kw.get("step_delay_s", 0.0))
        self.audio_deltas = bool(kw.get("audio_deltas", False))
        self.salt = sum(map(ord, stage.name))
        self.running: dict[str, _Req] = {}
        self.finished = 0
        self.steps = 0
        self.max_batch = 0

    def add_request(self, inp: StageInput) -> None:
        rid = inp.request_id
        if rid in self.running:
            raise RequestError(f"request_id {rid!r} is already in use", stage=self.name, field="request_id")
        text = _prompt_text(inp.prompt)
        if "__bad__" in text:
            raise RequestError("prompt: contains __bad__", stage=self.name, field="prompt")
        if "__value_error__" in text:  # a stage's own check that is no request check (a shape bug, say)
            raise ValueError("rows: expected 2 dimensions, got 3")
        if inp.prompt_token_ids is not None:
            ids = [int(t) for t in inp.prompt_token_ids]
        elif inp.prompt is not None:
            ids = [ord(c) % 1000 for c in str(inp.prompt)]
        elif inp.prompt_embeds is not None:
            ids = embeds_ids(inp.prompt_embeds)
        else:
            raise RequestError("prompt: a request needs a prompt", stage=self.name, field="prompt")
        if not ids:
            raise RequestError("prompt: the prompt is empty (0 tokens)", stage=self.name, field="prompt")
        sp = resolve_sampling_params(inp.sampling_params, self.stage.sampling)
        self.running[rid] = _Req(rid, text, ids, sp.max_tokens, time.monotonic(), stream=inp.stream)

    def tokenize(self, inp: StageInput, **_: Any) -> dict[str, Any]:
        """The ids add_request would take (text: a character each), and the stage's pid (which process ran it)."""
        if inp.prompt_token_ids is not None:
            ids = [int(t) for t in inp.prompt_token_ids]
        else:
            ids = text_ids(str(inp.prompt))
        if "__bad__" in _prompt_text(inp.prompt):
            raise RequestError("prompt: contains __bad__", stage=self.name, field="prompt", code="bad_prompt")
        return {"tokens": ids, "token_strs": None, "max_model_len": os.getpid()}

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def step(self) -> EngineStepOutput:
        self.steps += 1
        self.max_batch = max(self.max_batch, len(self.running))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outs, deltas = [], []
        for r in list(self.running.values()):
            if "__crash__" in r.text:
                os._exit(1)
            if "__step_raise__" in r.text:
                raise RuntimeError("boom")
            if "__hang__" in r.text:
                continue
            if "__error__" in r.text:
                del self.running[r.rid]
                outs.append(StageOutput(r.rid, self.name, finished=True, finish_reason="error",
                                        error="fake stage error"))
                continue
            r.out.append((sum(r.prompt_ids) * 31 + len(r.out) * 7 + self.salt) % 1000)
            if self.audio_deltas and r.stream:
                deltas.append(StageDelta(r.rid, self.name, token_ids=[r.out[-1]], finished=len(r.out) >= r.max_tokens,
                                         audio=np.full(AUDIO_SAMPLES, r.out[-1] / 1000, np.float32),
                                         sampling_rate=8000))
            if len(r.out) >= r.max_tokens:
                del self.running[r.rid]
                self.finished += 1
                n = len(r.prompt_ids) + len(r.out) - 1
                hidden = (np.arange(n * HIDDEN, dtype=np.float32).reshape(n, HIDDEN) + self.salt) / 100
                outs.append(StageOutput(
                    r.rid, self.name, prompt_token_ids=r.prompt_ids, token_ids=list(r.out),
                    text=f"{self.name}:" + ",".join(map(str, r.out)), finished=True, finish_reason="length",
                    hidden_states=hidden, metrics={"ttft_s": 0.0, "e2e_s": time.monotonic() - r.arrival}))
        return EngineStepOutput(finished=outs, deltas=deltas)

    def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def close(self) -> None:
        if (self.stage.model_kwargs or {}).get("announce_close"):
            print(f"closed {self.name}", flush=True)

    def stats(self) -> StageStats:
        return StageStats(self.name, running=len(self.running), finished=self.finished, steps=self.steps,
                          extra={"max_batch": self.max_batch})

    def info(self) -> StageInfo:
        """Its model's registered facts; `model_kwargs: {voices: [...]}` names voices."""
        voices = tuple((self.stage.model_kwargs or {}).get("voices", ()))
        return replace(registry.stage_model_entry(self.stage.model).info, voices=voices)


def _prompt_text(prompt: Any) -> str:
    """A text prompt, or the text of chat messages (their text parts): where the magic words are looked for."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        return ""
    texts = []
    for msg in prompt:
        content = msg.get("content") if isinstance(msg, dict) else None
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        texts += [p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type", "text") == "text"]
    return " ".join(texts)


def fake_factory(stage: Any) -> FakeEngine:
    return FakeEngine(stage)


def embeds_ids(hidden: np.ndarray) -> list[int]:
    """The prompt ids the fake engine derives from prompt embeddings."""
    return [int(abs(x) * 10) % 1000 for x in np.asarray(hidden)[:, 0]]


def expected_tokens(stage: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    salt = sum(map(ord, stage))
    return [(sum(prompt_ids) * 31 + i * 7 + salt) % 1000 for i in range(max_tokens)]


def text_ids(text: str) -> list[int]:
    return [ord(c) % 1000 for c in text]


def stage(name: str, **kw: Any) -> dict[str, Any]:
    """A stage dict for a fake pipeline config."""
    return {"name": name, "model": "fake", "model_path": "unused", **kw}


def chain_config(**runtime: Any) -> dict[str, Any]:
    return {
        "name": "fake_chain",
        "runtime": {"backend": "local", **runtime},
        "stages": [
            stage("thinker", final_output="text", sampling={"max_tokens": 3}),
            stage("talker", inputs=["thinker"], final_output="tokens", sampling={"max_tokens": 2}),
        ],
    }


def diamond_config(**runtime: Any) -> dict[str, Any]:
    return {
        "name": "fake_diamond",
        "runtime": {"backend": "local", **runtime},
        "stages": [
            stage("a", sampling={"max_tokens": 2}),
            stage("b", inputs=["a"], sampling={"max_tokens": 2}),
            stage("c", inputs=["a"], sampling={"max_tokens": 3}),
            stage("d", inputs=["b", "c"], input_processor="tagged_concat", final_output="tokens",
                  sampling={"max_tokens": 2}),
        ],
    }
