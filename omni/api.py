"""Omni: the Python entry point (vLLM-style).

    from omni import Omni, SamplingParams
    with Omni("stage_configs/tiny_chain.yaml") as o:
        for out in o.generate(["Hello", "Bonjour"], SamplingParams(temperature=0, max_tokens=8)):
            print(out.request_id, out.outputs["thinker"].text, out.outputs["talker"].token_ids)

Prompts: a string, a dict {"prompt" (text or chat messages) | "prompt_token_ids" |
"prompt_embeds", "multi_modal_data", "cache_salt", "request_id"}, a StageInput, or a
list of those (checked by omni/prompts.py before anything is queued). Sampling
parameters: one SamplingParams for every stage, a list with one per stage (config
order, vLLM-Omni's sampling_params_list), a dict
{stage: SamplingParams | dict of fields} (fields merged over that stage's defaults),
or a dict of fields merged over every stage's defaults. Fields: SamplingParams', and
vLLM's that it knows (omni/vllm_sampling.py: accepted at their defaults, refused by name otherwise).
"""
from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from omni.config.schema import PipelineConfig
from omni.config.loader import load_config
from omni.sampling_params import SamplingParams, is_sampling_field, resolve_sampling_params
from omni.errors import BackendClosedError, ConfigError, OmniError, RequestError
from omni.messages import RequestOutput, StageDelta, StageInput, StageOutput
from omni.pipeline.graph import StageGraph
from omni.pipeline.orchestrator import Orchestrator
from omni.prompts import to_stage_input
from omni.stage_info import StageInfo

logger = logging.getLogger(__name__)


def _close_pipeline(orch: Orchestrator, backend: Any) -> None:
    # The requests in flight fail first (BackendClosedError, at once): a caller still waiting for one, in another
    # thread or in a stream, must not wait for its timeout on stages that are gone.
    try:
        orch.close()
    except Exception:  # noqa: BLE001 - at interpreter exit, never raise
        logger.exception("failing the requests in flight failed")
    try:
        backend.close()
    except Exception:  # noqa: BLE001 - at interpreter exit, never raise
        logger.exception("closing the pipeline backend failed")


# Tokens a downstream stage adds around the sequence it is handed (Qwen's talkers: a few codec markers)
_MARKER_SLACK = 8


class Omni:
    """A multi-stage pipeline: `generate`, `stream`, `abort`, `stats`, `close`."""

    def __init__(self, config_or_path: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig,
                 stage_overrides: str | Mapping[str, Any] | None = None, backend: str | None = None, *,
                 engine_factory: Any = None):
        """`backend`: "ray" | "local" (default: the config's runtime.backend). `engine_factory`
        (StageConfig -> engine) replaces omni.pipeline.engine_factory.build_engine, e.g. with a test
        double implementing omni.engine.interface.Engine."""
        config = load_config(config_or_path, stage_overrides)
        if backend is not None:
            if backend not in ("ray", "local"):
                raise ConfigError(f"backend: must be 'ray' or 'local', got {backend!r}")
            config = config.model_copy(update={"runtime": config.runtime.model_copy(update={"backend": backend})})
        from omni.planning.needs import uses_plan

        self.memory_plan: Any = None
        if uses_plan(config):
            # One budget per device, planned before anything is allocated: a plan that does not fit raises
            # MemoryPlanError here; one that fits sets the 'auto' stages' block counts (omni/planning/).
            from omni.planning.plan import planned_config

            config, self.memory_plan = planned_config(config)
        self.config = config
        self.graph = StageGraph.of(config)  # built by load_config, handed on to the backend and orchestrator
        if config.runtime.backend == "local":
            from omni.pipeline.local import LocalBackend

            self._backend: Any = LocalBackend(config, self.graph, engine_factory)
        else:
            try:
                from omni.pipeline.ray.client import RayBackend
            except ModuleNotFoundError as e:
                if e.name != "ray":
                    raise
                raise OmniError("runtime.backend is 'ray' but Ray is not installed: "
                                "pip install 'ray[default]', or use backend='local'") from None
            self._backend = RayBackend(config, self.graph, engine_factory)
        self._orch = Orchestrator(self.graph, self._backend, config.runtime.request_timeout_s)
        # Each stage's facts, read once as the stages started: voices(), context_reserve(), ... answer from them.
        self._infos: dict[str, StageInfo] = dict(self._backend.infos)
        self._ids = itertools.count()
        # Closes the backend (Ray actors, embedded Ray) at interpreter exit or when collected.
        self._finalizer = weakref.finalize(self, _close_pipeline, self._orch, self._backend)

    @property
    def backend(self) -> str:
        return self.config.runtime.backend

    @property
    def stage_names(self) -> list[str]:
        return list(self.graph.order)

    # ------------------------------------------------------------ requests
    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True,
                 return_hidden_states: bool = False,
                 output_modalities: Sequence[str] | None = None) -> list[RequestOutput]:
        """Run every prompt through the pipeline; one RequestOutput per prompt, in input order.

        `output_modalities` (e.g. ["text"]): the final outputs wanted (the stages' `final_output`s: text,
        tokens, audio, hidden, or a final stage's name: ["asr"] on a voice agent); only the stages they need
        run (a text-only reply skips the talker and the vocoder). None: every final output.

        A request that fails (a stage error, timeout or abort) has `error` set; others are unaffected.
        Per-token rows (hidden states, mm_outputs) are dropped from the outputs unless
        `return_hidden_states` (or the stage's final_output is "hidden").
        """
        rids = self._submit(prompts, sampling_params, return_hidden_states, stream=False,
                            output_modalities=output_modalities)
        results: dict[str, RequestOutput] = {}
        remaining = set(rids)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while remaining:
                self._orch.step()
                for rid in list(remaining):
                    out = self._orch.pop_result(rid)
                    if out is not None:
                        remaining.discard(rid)
                        results[rid] = out
                        bar.update(1)
                        if out.error:
                            logger.warning("request %s failed: %s", rid, out.error)
        except BaseException:
            for rid in remaining:
                self._orch.abort(rid)
                self._orch.pop_result(rid)
            raise
        finally:
            bar.close()
        return [results[r] for r in rids]

    def stream(self, prompts: Any, sampling_params: Any = None, *, return_hidden_states: bool = False,
               output_modalities: Sequence[str] | None = None) -> Iterator[StageDelta | StageOutput]:
        """Yield progress as it happens: a StageDelta whenever a stage generated tokens for a request
        (`token_ids`, and `text` once it is final: concatenated they give the stage's final text),
        then each final stage's StageOutput as soon as that stage finishes the request.

        A failed request yields one StageOutput with `error` set (its `stage` is where it failed).
        Closing the iterator early aborts the requests still running (on every stage).
        `output_modalities`: as for generate.
        """
        rids = self._submit(prompts, sampling_params, return_hidden_states, stream=True,
                            output_modalities=output_modalities)
        remaining = list(rids)
        try:
            while remaining:
                self._orch.step()
                for rid in list(remaining):
                    done = self._orch.is_done(rid)  # read before the events: none can be missed
                    yield from self._orch.pop_events(rid)
                    if done:
                        yield from self._orch.pop_events(rid)
                        self._orch.pop_result(rid)
                        remaining.remove(rid)
        finally:
            for rid in remaining:
                self._orch.abort(rid)
                self._orch.pop_result(rid)

    def abort(self, request_id: str) -> bool:
        """Abort a running request on every stage. False if it is not running."""
        return self._orch.abort(request_id)

    def stats(self) -> dict[str, Any]:
        """Per stage: the engine's stats (hit rate, TTFT, queue sizes, ...) + the orchestrator's counts.
        A stage with replicas: its totals, each replica's own stats under "replicas" (hit rate, running and
        waiting requests, KV usage, state, ...) and the router's decisions under "router"."""
        self._check_open()
        orch = self._orch.stats()
        engines = self._backend.stats()
        stages = {}
        for n in self.graph.order:
            stages[n] = {**engines.get(n, {}), "orchestrator": orch["stages"][n]}
            if n in orch["routers"]:
                stages[n]["router"] = orch["routers"][n]
        return {"backend": self.backend, "requests": orch["requests"], "stages": stages}

    def tokenize(self, prompt: Any, *, stage: str | None = None, add_generation_prompt: bool = True,
                 add_special_tokens: bool | None = None, return_token_strs: bool = False) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt (a string, chat messages in a dict's "prompt", token ids, a StageInput) as the
        stage computes it, `stage` the entry stage unless named: {"tokens", "token_strs", "max_model_len"}. Its own
        tokenizer and prompt renderer, where the stage runs (the omni thinkers render their system prompt too).
        vLLM's other cases: add_generation_prompt false, add_special_tokens set (the rendered template tokenized
        with or without them) where the stage's chat template renders the prompt. Raises the stage's RequestError."""
        self._check_open()
        inp = to_stage_input(prompt, "prompt", lambda: "tokenize")
        return self._backend.text(self._text_stage(stage), "tokenize", inp, add_generation_prompt=add_generation_prompt,
                                  add_special_tokens=add_special_tokens, return_token_strs=return_token_strs)

    def detokenize(self, token_ids: list[int], *, stage: str | None = None) -> str:
        """vLLM's /detokenize: the text of token ids of the stage (the entry stage unless named), special tokens
        shown. Raises the stage's RequestError (an id outside its vocabulary)."""
        self._check_open()
        return self._backend.text(self._text_stage(stage), "detokenize", list(token_ids))

    def _text_stage(self, stage: str | None) -> str:
        if stage is None:
            return self.graph.entry_stages[0]
        if stage not in self.graph.stages:
            raise RequestError(f"stage: {stage!r} is not a stage of this pipeline ({', '.join(self.graph.order)})",
                               field="stage")
        return stage

    def voices(self) -> tuple[str, ...]:
        """The voices the pipeline speaks in: the `voices` of its stages' StageInfo (the talkers: their
        speakers), sorted; () when no stage names any."""
        self._check_open()
        return tuple(sorted({v for info in self._infos.values() for v in info.voices}))

    def context_reserve(self) -> int:
        """Tokens of the entry stage's context a reply must leave free for the stages after it: each downstream
        autoregressive stage's prompt is the entry stage's sequence (a talker's: the thinker's prompt and reply,
        plus a few markers), and it needs room for its own max_tokens, and for any shorter max_model_len of its own
        (the stages' StageInfo: the lengths in force). 0 for a single stage."""
        self._check_open()
        entry = self.graph.entry_stages[0]
        entry_len = self._infos[entry].max_model_len or 0
        reserve = 0
        for name, stage in self.graph.stages.items():
            info = self._infos[name]
            if name == entry or not info.autoregressive:
                continue
            own_len = info.max_model_len or entry_len
            reserve = max(reserve, stage.sampling.max_tokens + max(0, entry_len - own_len) + _MARKER_SLACK)
        return reserve

    def min_spoken_tokens(self) -> int:
        """The fewest tokens a reply of the entry stage must have for the stages after it to voice it as it is
        generated: the most any stage asks of its input (StageInfo.min_upstream_tokens; a talker's 2: it voices its
        thinker's reply from the thinker's rows of the reply's tokens, and the token sampled last has no row);
        1 when no stage asks."""
        self._check_open()
        return max([1] + [info.min_upstream_tokens for info in self._infos.values()])

    def shows_tools(self) -> bool | None:
        """Whether a request's `tools` reach the entry stage's model (StageInfo.shows_tools: False for a model
        whose own prompt format has no tools, which refuses them), or, past an entry stage that passes them on
        (StageInfo.passes_tools_on: a voice agent's recognizer), the next stage's; None when the stage does not
        say (a chat template shows them)."""
        self._check_open()
        stage = self.graph.entry_stages[0]
        while self._infos[stage].passes_tools_on and self.graph.downstream[stage]:
            stage = self.graph.downstream[stage][0]
        return self._infos[stage].shows_tools

    def speaks_prompt(self) -> bool:
        """Whether the entry stage's model speaks its prompt (StageInfo.speaks_prompt: a text-to-speech model)."""
        self._check_open()
        return self._infos[self.graph.entry_stages[0]].speaks_prompt

    def clones_voices(self) -> bool:
        """Whether a request may hand a stage that speaks a reference clip of its own: a text-to-speech model
        (StageInfo.speaks_prompt) that takes audio, as the entry stage or as a voice agent's speech stage."""
        self._check_open()
        return any(i.speaks_prompt and (i.input_media is None or "audio" in i.input_media)
                   for i in self._infos.values())

    def transcribes_audio(self) -> bool:
        """Whether the entry stage's model is a speech recognizer (StageInfo.transcribes_audio): the clip is its
        prompt, a text prompt its context."""
        self._check_open()
        return self._infos[self.graph.entry_stages[0]].transcribes_audio

    def transcript_marker(self) -> str | None:
        """What ends the language tag the entry stage's speech recognizer writes before the transcript
        (StageInfo.transcript_marker); None: its whole reply is the transcript."""
        self._check_open()
        return self._infos[self.graph.entry_stages[0]].transcript_marker

    def input_media(self) -> tuple[str, ...] | None:
        """The multimodal inputs ("image", "audio") a request's prompt may hold: the entry stage's
        (StageInfo.input_media: () for a model that renders no prompt of its own); None when it does not say."""
        self._check_open()
        return self._infos[self.graph.entry_stages[0]].input_media

    def close(self) -> None:
        """Stop the stages (and the embedded Ray, if this started one). Idempotent. Requests still running
        (a `generate` in another thread, an unfinished `stream`) end at once with a BackendClosedError: the
        RequestOutput's `error`, a stream's final StageOutput's `error`."""
        self._finalizer()

    def __enter__(self) -> "Omni":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise BackendClosedError("this Omni pipeline is closed")

    def _submit(self, prompts: Any, sampling_params: Any, hidden: bool, stream: bool,
                output_modalities: Sequence[str] | None = None) -> list[str]:
        self._check_open()
        self.graph.stages_for(output_modalities)  # a bad value is refused before anything runs
        inputs = [self._to_input(i, p) for i, p in enumerate(_as_list(prompts))]
        sampling = self._per_stage_sampling(sampling_params)
        if isinstance(sampling_params, (list, tuple)) and len(inputs) == len(sampling_params) > 1:
            # vLLM reads a list as one SamplingParams per prompt, vLLM-Omni (and omni) as one per stage
            logger.warning("sampling_params: a list is one SamplingParams per stage (%s), not one per prompt as in "
                           "vLLM; every prompt gets all of them", ", ".join(s.name for s in self.config.stages))
        rids: list[str] = []
        try:
            for inp in inputs:
                rids.append(self._orch.add_request(inp, sampling, return_hidden_states=hidden, stream=stream,
                                                   output_modalities=output_modalities))
        except BaseException:
            for rid in rids:
                self._orch.abort(rid)
                self._orch.pop_result(rid)
            raise
        return rids

    def _new_id(self) -> str:
        while True:
            rid = str(next(self._ids))
            if not self._orch.is_known(rid):
                return rid

    def _to_input(self, i: int, p: Any) -> StageInput:
        return to_stage_input(p, f"prompts[{i}]", self._new_id)

    def _per_stage_sampling(self, sp: Any) -> dict[str, Any]:
        stages = self.graph.order
        if sp is None:
            return {}
        if isinstance(sp, SamplingParams):
            return {s: sp for s in stages}
        names = [s.name for s in self.config.stages]
        if isinstance(sp, (list, tuple)):
            if len(sp) != len(names):
                raise RequestError(f"sampling_params: a list needs one entry per stage ({len(names)}: "
                                   f"{', '.join(names)}), got {len(sp)}", field="sampling_params",
                                   limit=len(names), actual=len(sp))
            return {n: self._stage_params(n, v) for n, v in zip(names, sp) if v is not None}
        if isinstance(sp, Mapping):
            if sp and all(k in self.graph.stages for k in sp):
                return {n: self._stage_params(n, v) for n, v in sp.items() if v is not None}
            if all(is_sampling_field(k) for k in sp):
                return {n: self._stage_params(n, dict(sp)) for n in stages}
            bad = [k for k in sp if k not in self.graph.stages and not is_sampling_field(k)]
            if bad:
                raise RequestError(f"sampling_params: {bad[0]!r} is neither a stage ({', '.join(names)}) nor a "
                                   f"sampling field ({', '.join(SamplingParams.model_fields)})",
                                   field=f"sampling_params.{bad[0]}", code="unknown_parameter")
            raise RequestError(
                f"sampling_params: mixes stage names ({', '.join(k for k in sp if k in self.graph.stages)}) "
                f"and sampling fields ({', '.join(k for k in sp if k not in self.graph.stages)}); give either "
                "{stage: params, ...} or {field: value, ...}, e.g. {'thinker': {'temperature': 0}}",
                field="sampling_params")
        raise RequestError(f"sampling_params: expected a SamplingParams, a list or a dict, got {type(sp).__name__}",
                           field="sampling_params")

    def _stage_params(self, stage: str, v: Any) -> SamplingParams:
        return resolve_sampling_params(v, self.graph.stages[stage].sampling, stage)


def _as_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, Mapping, StageInput)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        if prompts and all(isinstance(t, int) for t in prompts):
            raise RequestError("prompts: a list of ints is ambiguous; pass {'prompt_token_ids': [...]}",
                               field="prompts")
        return list(prompts)
    raise RequestError(f"prompts: expected a str, a dict, a StageInput or a list of those, got {type(prompts).__name__}",
                       field="prompts")
