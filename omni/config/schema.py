"""The YAML stage graph's schema: pydantic models + their validation (data only: imports no torch,
nothing of omni/engine or omni/pipeline).

    name: tiny_chain
    runtime: {backend: ray, request_timeout_s: 600}
    stages:
      - name: thinker
        model_path: builtin:tiny-qwen2
        final_output: text
      - name: talker
        model_path: builtin:tiny-qwen2
        inputs: [thinker]
        input_processor: hidden_to_embeds
        final_output: tokens

`omni.config.loader.load_config(path_or_dict, stage_overrides=None)` is the one entry point (YAML,
overrides, the stage graph's checks); it raises `ConfigError` (a ValueError) whose message names the
stage and field.
"""
from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from omni import registry
from omni.sampling_params import SamplingParams, check_prefill_fits
from omni.config.strict import StrictFlag, no_bool_for_number

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def expand_env(value: str) -> str:
    """Expand ${VAR} and ${VAR:-default}; an unset variable without default is an error."""

    def sub(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        if var in os.environ:
            return os.environ[var]
        if default is not None:
            return default
        raise ValueError(f"environment variable {var!r} is not set (use ${{{var}:-default}} for a default)")

    out = _ENV_RE.sub(sub, value)
    return os.path.expanduser(out) if out.startswith("~") else out


def env_names(value: str) -> list[str]:
    """The environment variables a value names (`${VAR}`, `${VAR:-default}`), in order."""
    return [m.group(1) for m in _ENV_RE.finditer(value)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    _no_bool_for_number = field_validator("*", mode="before")(classmethod(no_bool_for_number))


class CacheConfig(_Model):
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV cache block (1..256).")
    num_blocks: int | None = Field(
        None, ge=2, description="Number of KV cache blocks (>= 2). None: derived from memory_budget_mb.")
    memory_budget_mb: float | Literal["auto"] | None = Field(
        None, description="Memory for the KV cache in MiB (> 0), when num_blocks is not set; 'auto': the "
        "number `omni plan` gives the stage out of its device's budget (the default when runtime.memory or "
        "runtime.plan is set). A number set by hand is honoured and checked against the budget.")
    hash_seed: int = Field(
        0, description="Seed of the prefix-cache block hashes (fixed so hashes agree across processes).")

    @field_validator("memory_budget_mb", mode="before")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        # Before coercion, so the message shows the value as written (and true/false is no number here).
        if isinstance(v, bool):
            raise ValueError(f"expected a number or 'auto', got {str(v).lower()}")
        if isinstance(v, (int, float)) and not v > 0:
            raise ValueError(f"Input should be greater than 0 (got {v!r})")
        return v

    @model_validator(mode="after")
    def _one_size(self) -> "CacheConfig":
        if self.num_blocks is not None and self.memory_budget_mb is not None:
            raise ValueError("set num_blocks or memory_budget_mb, not both")
        return self


class SchedulerConfig(_Model):
    max_num_seqs: int = Field(64, ge=1, description="Maximum number of requests in one batch (>= 1). "
                              "One-shot stages (token2wav): requests, or streamed pieces, run per step.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Maximum number of tokens computed in one step (>= 1). One-shot stages: "
        "most input tokens (e.g. codec tokens of the requests or streamed windows) in one batched call of "
        "the stage model, which bounds a batch's memory; a request larger than that runs alone.")
    max_model_len: int | None = Field(
        None, ge=1, description="Maximum sequence length (prompt + output). None: the model's maximum. "
        "Lowered (with a warning) to what the KV cache holds; a request whose prompt + max_tokens exceeds "
        "it is rejected when it arrives.")
    enable_chunked_prefill: StrictFlag = Field(
        True, description="Split long prompts over several steps instead of requiring one step for them.")

    @model_validator(mode="after")
    def _fits(self) -> "SchedulerConfig":
        if self.max_model_len is not None:  # else checked once the model's maximum is known
            check_prefill_fits(self.max_num_batched_tokens, self.max_model_len, self.enable_chunked_prefill)
        return self


class ResourcesConfig(_Model):
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the stage's Ray actor (>= 0).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the stage's Ray actor (>= 0, fractions allowed).")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources the stage's actor needs (name -> amount >= 0).")

    @field_validator("custom")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if x < 0}
        if bad:
            raise ValueError(f"custom resource amounts must be >= 0, got {bad}")
        return v


class RouterConfig(_Model):
    """How a stage with several replicas picks one per request (omni/pipeline/routing/policy.py)."""

    imbalance_threshold: int = Field(
        4, ge=0, description="Load spread (most minus fewest requests in flight among the live replicas) "
        "above which prefix affinity is ignored and the request goes to the less loaded of two random "
        "replicas (power of two choices), as Ray Serve's PrefixCacheAffinityRouter does.")
    min_match_ratio: float = Field(
        0.5, ge=0, le=1, description="prefix_affinity: the best replica's cached prefix must cover at least "
        "this fraction of the request's blocks; a shorter match goes to the least-loaded replica instead "
        "(a shared system prompt alone should not pile every request on one replica).")
    summary_blocks: int | None = Field(
        None, ge=1, description="Block hashes the router remembers per replica (least recently used "
        "forgotten first). None: the replica's KV cache size in blocks once it is known (4096 before).")
    on_replica_failure: Literal["retry", "fail"] = Field(
        "retry", description="A request in flight on a replica that dies: retry sends it once more to "
        "another live replica (unless part of it already streamed out, or it is on a streaming edge); "
        "fail fails it with an error naming the replica.")


class InputEdge(_Model):
    """One input of a stage: `inputs: [thinker]` is `inputs: [{stage: thinker}]`."""

    stage: str = Field(description="The upstream stage.")
    stream: StrictFlag = Field(
        False, description="Stream the upstream's output in while it runs: this stage admits the request on "
        "the first chunk and its prompt grows chunk by chunk (it waits, without holding up its batch, when "
        "it has consumed all it got). Needs an input processor with a chunk form.")
    chunk_tokens: int = Field(
        16, ge=1, strict=True, description="On a streaming edge: hand over this many new tokens (or rows) at a time; the "
        "last chunk may be shorter.")


class StageConfig(_Model):
    name: str = Field(description="Unique stage name (letters, digits, '_', '-', '.').")
    model: str = Field(
        "causal_lm", description="Registered stage model name (see omni.registry) or 'package.module:Class'.")
    model_path: str = Field(
        description="Model directory or GGUF file, or builtin:tiny-llama | builtin:tiny-qwen2 | "
        "builtin:smollm2. ${ENV} and ${ENV:-default} are expanded.")
    tokenizer: str | None = Field(None, description="Tokenizer path, when it is not next to the model.")
    inputs: list[str | InputEdge] = Field(
        default_factory=list, description="Upstream stages: names, or {stage, stream, chunk_tokens} for a "
        "streaming edge. Empty: an entry stage (gets the prompt).")
    input_processor: str | None = Field(
        None, description="Turns the upstream outputs into this stage's input: a registered name "
        "(passthrough_tokens, hidden_to_embeds, ...) or 'package.module:function'. "
        "None: the upstream generated token ids become the prompt.")
    final_output: Literal["text", "tokens", "audio", "hidden"] | None = Field(
        None, description="Return this stage's outputs to the caller, as this kind.")
    enable_prefix_caching: StrictFlag = Field(
        True, description="Reuse KV blocks (and the stage tensor cache) across requests sharing a prefix. "
        "Default: on, and off for a one-shot (not autoregressive) stage, which has no KV cache.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Paged KV cache geometry.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Batching limits.")
    sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="Default sampling parameters of this stage.")
    use_chat_template: StrictFlag = Field(
        False, description="Apply the tokenizer's chat template to text prompts.")
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig, description="Resources of the stage's Ray actor.")
    max_restarts: int = Field(
        0, ge=-1, description="How often Ray restarts the stage's actor after it dies (-1: forever).")
    replicas: int = Field(
        1, ge=1, le=64, description="Copies of the stage (1..64), each with its own engine and KV cache: on Ray, "
        "one actor each with the stage's resources, spread over the nodes; locally, engines in this process.")
    routing: Literal["prefix_affinity", "least_loaded", "round_robin"] | None = Field(
        None, description="How a request picks a replica when replicas > 1. None: prefix_affinity for a stage "
        "with prefix caching, least_loaded otherwise.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Routing thresholds (replicas > 1).")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="Model dtype.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available.")
    model_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the stage model's loader.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid stage name: use letters, digits, '_', '-', '.' "
                             "(starting with a letter or '_')")
        return v

    # model_path / tokenizer as the config wrote them, before ${VAR} expansion, where they name a variable:
    # so that an error about the path can say which variable sets it (omni/config/preflight.py)
    _as_written: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_as_written(cls, data: Any, handler: Any) -> "StageConfig":
        stage = handler(data)
        if isinstance(data, dict):
            stage._as_written = {f: data[f] for f in ("model_path", "tokenizer")
                                 if isinstance(data.get(f), str) and env_names(data[f])}
        return stage

    def path_variables(self, field: str) -> list[str]:
        """The environment variables the config's `field` (model_path, tokenizer) is written with."""
        return env_names(self._as_written.get(field, ""))

    @field_validator("model_path", "tokenizer")
    @classmethod
    def _expand(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = expand_env(v)
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _resolve(self) -> "StageConfig":
        # Facts come from the registry entries: validating imports no model code (and no torch).
        where = f"stage {self.name!r}"
        try:
            info = registry.stage_model_entry(self.model).info
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where}: model: {e.args[0]}") from None
        if not info.autoregressive and "enable_prefix_caching" not in self.model_fields_set:
            self.enable_prefix_caching = False  # the default is off for a one-shot stage
        if self.enable_prefix_caching and not info.autoregressive:
            raise ValueError(
                f"{where}: enable_prefix_caching: model {self.model!r} is not autoregressive (no KV cache), "
                "so prefix caching does not apply; set enable_prefix_caching: false")
        if self.routing == "prefix_affinity" and not self.enable_prefix_caching:
            raise ValueError(f"{where}: routing: prefix_affinity routes by what each replica's prefix cache "
                             "holds, and enable_prefix_caching is false; use least_loaded or round_robin")
        if self.final_output == "hidden" and not info.emits_hidden_states:
            raise ValueError(f"{where}: final_output: model {self.model!r} emits no hidden states; "
                             "choose text, tokens or audio")
        if self.input_processor is not None:
            if not self.inputs:
                raise ValueError(
                    f"{where}: input_processor: only a stage with `inputs` takes an input processor "
                    "(this is an entry stage: it receives the prompt)")
            try:
                registry.input_processor_entry(self.input_processor)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{where}: input_processor: {e.args[0]}") from None
        streaming = [e for e in self.input_edges if e.stream]
        if streaming:
            if len(self.inputs) != 1:
                raise ValueError(f"{where}: inputs: a streaming input must be the stage's only input "
                                 f"(got {len(self.inputs)} inputs)")
            if not info.streams_input:
                raise ValueError(f"{where}: inputs[0].stream: model {self.model!r} is a one-shot stage that "
                                 "cannot take its input in chunks (set stream: false)")
            proc = self.input_processor or "passthrough_tokens"
            if registry.input_processor_entry(proc).incremental is None:
                raise ValueError(f"{where}: inputs[0].stream: input processor {proc!r} has no chunk form, so it "
                                 "cannot sit on a streaming edge (set stream: false or use a streamable processor)")
        return self

    @property
    def input_edges(self) -> list[InputEdge]:
        """`inputs` with every plain name as a non-streaming edge."""
        return [e if isinstance(e, InputEdge) else InputEdge(stage=e) for e in self.inputs]

    @property
    def routing_policy(self) -> str:
        """`routing`, with its default resolved (left None in the config: overrides may turn caching off)."""
        if self.routing is not None:
            return self.routing
        return "prefix_affinity" if self.enable_prefix_caching else "least_loaded"


class RuntimeConfig(_Model):
    backend: Literal["ray", "local"] = Field(
        "ray", description="ray: one actor per stage; local: every stage in this process.")
    ray_address: str | None = Field(
        None, description="Ray cluster to connect to. None: RAY_ADDRESS / the enclosing Ray job if any, "
        "else an embedded local Ray.")
    namespace: str | None = Field(None, description="Ray namespace of the stage actors.")
    request_timeout_s: float = Field(600.0, gt=0, description="A request still unfinished after this fails.")
    stream_chunk_timeout_s: float = Field(
        60.0, gt=0, description="Longest a stage waits on a streaming edge without a word from its producer "
        "(a chunk, or the producer's signal that it still holds the request, sent every third of this while it "
        "is queued or busy): the request then fails with an error naming the edge (a producer that died or lost "
        "it). A busy or queued producer never runs it out; request_timeout_s bounds the whole request.")
    stage_start_timeout_s: float = Field(
        300.0, gt=0, description="Time a stage may take to start (model load, waiting for resources).")
    wait_for_nodes: StrictFlag = Field(
        False, description="On Ray, a stage whose actor no node of the cluster can hold (resources) is refused at "
        "start. true: wait for a node that can, up to stage_start_timeout_s (an autoscaling cluster adds one).")
    log_to_driver: StrictFlag = Field(
        False, description="Forward the stage actors' stdout/stderr to this process (embedded Ray).")
    max_pending_requests: int = Field(
        256, ge=1, description="Requests `omni serve` runs at once (>= 1); past it a new request gets "
        "503 with a Retry-After header instead of waiting in an unbounded queue.")
    memory: MemoryConfig | None = Field(
        None, description="One memory budget per device for all the stages on it (omni plan); with it every "
        "stage's cache.memory_budget_mb defaults to 'auto'.")
    plan: WorkloadPlanConfig | None = Field(
        None, description="The workload to size the prefix caches for (omni plan); with it every stage's "
        "cache.memory_budget_mb defaults to 'auto'.")


class MemoryConfig(_Model):
    """One memory budget per device, shared by the stages placed on it (omni/planning/, `omni plan`)."""

    budget_gb: float | None = Field(
        None, gt=0, description="The budget of each device the stages use, in GiB (> 0): host RAM for CPU stages "
        "(and every stage's tensor cache), GPU memory for CUDA stages. None: what the device has free "
        "(host: available RAM; GPU: free memory), of which 90% is planned.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="A GPU's budget as a fraction of its total memory (0..1], as vLLM's "
        "option. With both set, this is each GPU's budget and budget_gb the host's (CPU stages, tensor caches, "
        "block pools).")


class WorkloadPlanConfig(_Model):
    """The workload the caches are sized for: every prefix-cached stage keeps this many conversations cached."""

    concurrent_conversations: int = Field(
        ge=1, description="Conversations whose context every prefix-cached stage keeps cached at once (>= 1).")
    context_tokens: int = Field(
        ge=1, description="Tokens of one conversation's context, in the entry stage's tokens (>= 1); a downstream "
        "stage's own sequence is longer by what it generates per turn (its sampling.max_tokens).")


class PipelineConfig(_Model):
    name: str = Field("pipeline", description="Pipeline name (shown in logs and actor names).")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="Where and how stages run.")
    stages: list[StageConfig] = Field(description="The stages; `inputs` edges make them a DAG (checked by "
                                      "omni.pipeline.graph.StageGraph when the config is loaded).")
    # The validated DAG over `stages` (omni.pipeline.graph.StageGraph), built once where the config is
    # loaded and handed on with it: StageGraph.of(config). Not data: never dumped or compared.
    _graph: Any = PrivateAttr(None)

    def __eq__(self, other: object) -> bool:
        # Pydantic compares private attributes too; the graph is derived from `stages`, so only the data counts.
        if not isinstance(other, PipelineConfig):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)
