"""What one copy of a stage needs, before anything of it exists.

    fixed (on the stage's device)        weights          safetensors headers (weights.py)
                                         activations      a profile step's peak (profile.py), else estimated
                                         encoder cache    entries x the largest item's rows (multimodal stages)
                                         working memory   a one-shot stage's peak at its batch size (profiled)
                                         allocator        freed heap glibc keeps resident (host stages; below)
    per KV block (on the stage's device) KV              2 x layers x block_size x kv_heads x head_dim x dtype
    per KV block (host RAM)              tensor cache    block_size x the per-token outputs' bytes per token
                                                          (hidden states; the profile step discovers the rest)
                                         block pool      the KVCacheBlock objects (omni/engine/memory.py)

A measurement (profile.py) is kept in the profile store (profile_store.py), so the arithmetic plan
that `omni validate`, `omni run` and `omni serve` make without loading anything uses the numbers the
last `omni plan` measured; where there is none, activations are estimated (and the report says so).

The allocator term. A profile step measures the live peak (it trims the heap first). A serving process
holds more: glibc's malloc raises its mmap threshold to the size of the largest mmapped buffer freed so
far (up to 32 MiB on 64-bit) and its trim threshold to twice that, so after the first step the freed
activations stay in the heap, resident, up to 2 x that size, instead of going back to the OS. That is
what keeps steps from page-faulting their buffers in again (pinning the threshold, MALLOC_MMAP_THRESHOLD_,
made `omni bench throughput` 16% slower), so it is planned rather than avoided: 2 x min(32 MiB, the
step's peak), the peak being an upper bound of the step's largest buffer. Measured on the tiny chain's
soak (tests/planning/test_plan_soak.py): a thinker grew 17-27 MiB over runs with the default thresholds,
13-15 MiB with a pinned one, for a 23 MiB live peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omni import registry
from omni.config.schema import PipelineConfig, StageConfig
from omni.engine.memory import DTYPE_BYTES, HASH_BYTES_PER_BLOCK, POOL_BYTES_PER_BLOCK, StageGeometry
from omni.errors import ConfigError

from omni.planning.profile_store import ProfileRecord, ProfileStore, profile_key
from omni.planning.weights import checkpoint_weights

GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the dynamic threshold's cap


def allocator_retention(peak: int) -> int:
    """Freed heap a host process may keep resident after steps whose live peak is `peak` bytes: glibc's
    trim threshold, 2 x its mmap threshold, which follows the largest freed buffer (<= peak) up to 32 MiB."""
    return 2 * min(GLIBC_MMAP_THRESHOLD_MAX, max(0, peak))


@dataclass(slots=True)
class StageNeeds:
    stage: str
    replicas: int
    autoregressive: bool
    device: str  # "cpu" | "cuda": where the weights, activations and KV blocks live
    dtype_bytes: int
    weights: int
    weights_source: str
    activations: int
    activations_source: str  # "measured" | "measured by omni plan" | "estimated" | "not measured"
    block_size: int = 16
    max_num_seqs: int = 1
    max_num_batched_tokens: int = 1
    max_model_len: int = 0  # the config's, else the model's (0: unknown)
    prefix_caching: bool = False
    kv_per_block: int = 0
    rows_per_token: dict[str, int] = field(default_factory=dict)  # tensor cache: output name -> bytes per token
    rows_source: str = "hidden states"
    pool_per_block: int = 0
    encoder_cache: int = 0
    working: int = 0  # one-shot stages: working memory at their batch size (in `activations` for AR stages)
    allocator: int = 0  # host stages: freed heap malloc keeps resident (allocator_retention)
    hand_blocks: int | None = None  # blocks fixed by the config (num_blocks, or a memory_budget_mb number)
    hand_field: str | None = None
    profile_key: str = ""

    @property
    def rows_per_block(self) -> int:
        return self.block_size * sum(self.rows_per_token.values())

    @property
    def fixed(self) -> int:
        """Bytes on the stage's device that do not depend on the block count."""
        return self.weights + self.activations + self.encoder_cache + self.working + self.allocator

    def device_per_block(self) -> int:
        """Bytes one KV block costs on the stage's device (everything, when that device is the host)."""
        return self.kv_per_block + (self.host_per_block() if self.device == "cpu" else 0)

    def host_per_block(self) -> int:
        return self.rows_per_block + self.pool_per_block

    @property
    def min_blocks(self) -> int:
        """Blocks to run one sequence of max_model_len (fewer: the engine lowers max_model_len)."""
        if not self.autoregressive:
            return 0
        length = self.max_model_len or self.max_num_batched_tokens
        return max(2, -(-length // self.block_size))


def uses_plan(config: PipelineConfig) -> bool:
    """Whether the pipeline is planned: a budget or a workload is declared, or a stage asks for 'auto'."""
    rt = config.runtime
    return (getattr(rt, "memory", None) is not None or getattr(rt, "plan", None) is not None
            or any(s.cache.memory_budget_mb == "auto" for s in config.stages))


def is_auto(stage: StageConfig) -> bool:
    """The stage's block count is the planner's: 'auto', or no number set while the pipeline is planned."""
    c = stage.cache
    return c.memory_budget_mb == "auto" or (c.num_blocks is None and c.memory_budget_mb is None)


def stage_device(stage: StageConfig, backend: str, cuda_available: bool) -> str:
    """Where the stage's weights and KV cache go, as its engine will resolve it: "auto" is CUDA when this
    process sees a GPU (a Ray actor sees one only when the stage reserves num_gpus)."""
    if stage.device == "cuda" and not cuda_available:
        raise ConfigError(f"stage {stage.name!r}: device: cuda, but no CUDA device is visible here: use device: auto "
                          "(CUDA where there is one) or cpu", stage=stage.name, field="device")
    if stage.device != "auto":
        return stage.device
    if not cuda_available:
        return "cpu"
    return "cuda" if backend == "local" or stage.resources.num_gpus > 0 else "cpu"


def estimate_activations(g: StageGeometry, tokens: int, seqs: int, max_len: int, dtype_bytes: int) -> int:
    """An arithmetic stand-in for a profile step's peak (used only until `omni plan` measures it).

    The live tensors of one decoder layer over `tokens` packed tokens (residual, normed input, q/k/v/o:
    6 x hidden; gate, up and their product: 3 x intermediate), one sequence's attention scores in
    float32 (heads x ctx x ctx, ctx = min(tokens, max_len): the torch reference's prefill), and the
    float32 logits of the sampled rows with the sampler's two copies (3 x seqs x vocab)."""
    inter = g.intermediate_size or 4 * g.hidden_size
    ctx = min(tokens, max_len) if max_len else tokens
    return (tokens * dtype_bytes * (6 * g.hidden_size + 3 * inter) + 4 * g.num_heads * ctx * ctx
            + 3 * 4 * seqs * g.vocab_size)


def _hand_blocks(stage: StageConfig, kv_per_block: int) -> tuple[int | None, str | None]:
    c = stage.cache
    if c.num_blocks is not None:
        return c.num_blocks, "cache.num_blocks"
    if isinstance(c.memory_budget_mb, (int, float)):  # the engine's own translation (engine_config.cache_size)
        return int(c.memory_budget_mb * 2**20 // max(kv_per_block, 1)), "cache.memory_budget_mb"
    return None, None


def stage_needs(config: PipelineConfig, stage: StageConfig, *, cuda_available: bool,
                store: ProfileStore | None = None, emits_rows: bool = True) -> StageNeeds:
    """The arithmetic needs of one copy of `stage`: nothing is loaded (the stage model's class is imported
    for its checkpoint hooks). `emits_rows`: the stage keeps per-token rows (every autoregressive stage's
    engine does; see omni/engine/io/request_rows.py)."""
    entry = registry.stage_model_entry(stage.model)
    model_cls = registry.resolve_stage_model(stage.model)
    try:
        path = registry.resolve_model_path(stage.model_path)
    except ValueError as e:
        raise ConfigError(f"stage {stage.name!r}: model_path: {e}", stage=stage.name, field="model_path") from None
    device = stage_device(stage, config.runtime.backend, cuda_available)
    dtype_bytes = DTYPE_BYTES[stage.dtype]
    prefix = model_cls.checkpoint_prefix
    w = checkpoint_weights(path, dtype_bytes, prefix) if entry.checkpoint else None
    sched = stage.scheduler
    key = profile_key(stage, path, device)
    record: ProfileRecord | None = store.get(key) if store is not None else None
    needs = StageNeeds(
        stage=stage.name, replicas=stage.replicas, autoregressive=entry.info.autoregressive, device=device,
        dtype_bytes=dtype_bytes, weights=w.bytes if w else 0,
        weights_source=w.source if w else "no safetensors file: not counted",
        activations=0, activations_source="not measured",
        block_size=stage.cache.block_size, max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens, prefix_caching=stage.enable_prefix_caching,
        profile_key=key)
    if not entry.info.autoregressive:
        if record is not None:
            needs.working, needs.activations_source = record.activations, "measured by omni plan"
        return _with_allocator(needs)
    geometry = model_cls.checkpoint_geometry(Path(path))
    if geometry is None:
        raise ConfigError(f"stage {stage.name!r}: model_path: the planner cannot read the model's geometry "
                          f"(layers, KV heads, head dim) from {path}", stage=stage.name, field="model_path")
    needs.max_model_len = sched.max_model_len or geometry.max_position_embeddings
    needs.kv_per_block = 2 * geometry.num_layers * stage.cache.block_size * geometry.num_kv_heads \
        * geometry.head_dim * dtype_bytes
    needs.pool_per_block = POOL_BYTES_PER_BLOCK + (HASH_BYTES_PER_BLOCK if stage.enable_prefix_caching else 0)
    if emits_rows:
        needs.rows_per_token = {"hidden_states": geometry.hidden_size * dtype_bytes}
    if record is not None:
        needs.activations, needs.activations_source = record.activations, "measured by omni plan"
        if emits_rows:
            needs.rows_per_token, needs.rows_source = dict(record.rows_per_token), "discovered by omni plan"
    else:
        needs.activations = estimate_activations(geometry, sched.max_num_batched_tokens, sched.max_num_seqs,
                                                 needs.max_model_len, dtype_bytes)
        needs.activations_source = "estimated"
    item_rows = min(sched.max_num_batched_tokens, needs.max_model_len or sched.max_num_batched_tokens)
    needs.encoder_cache = int(model_cls.encoder_cache_bytes(dict(stage.model_kwargs), geometry, dtype_bytes, item_rows))
    needs.hand_blocks, needs.hand_field = _hand_blocks(stage, needs.kv_per_block)
    return _with_allocator(needs)


def _with_allocator(needs: StageNeeds) -> StageNeeds:
    """A host stage's allocator term (the module's docstring); a CUDA stage's activations are counted by
    torch's caching allocator, whose reserve the device budget's headroom covers."""
    if needs.device == "cpu":
        needs.allocator = allocator_retention(needs.activations + needs.working)
    return needs
