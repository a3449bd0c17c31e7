"""ModelRunner: the only place where request state becomes tensors.

Takes a SchedulerOutput (ids and counts), packs the scheduled tokens of every
request into one varlen batch `(1, total_tokens)` with explicit positions,
builds the paged-attention metadata, runs the stage model inside one scoped
ForwardContext, computes logits only for rows that sample, and samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .request import Request
from .sampling import Sampler
from .scheduler import SchedulerOutput
from .stage_model import StageModel


@dataclass(slots=True)
class RunnerRequestState:
    """Tensor-side state of one request, kept while it is in the stage."""

    request: Request
    prompt_embeds: torch.Tensor | None = None  # [num_prompt_tokens, hidden]
    generator: torch.Generator | None = None


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    # Per-token outputs of the whole batch, rows in scheduled order.
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    slot_mapping: torch.Tensor | None = None
    # (req_id, first row in the batch, number of rows) in scheduled order.
    row_ranges: list[tuple[str, int, int]] = field(default_factory=list)
    num_tokens: int = 0


class ModelRunner:
    def __init__(self, model: StageModel, num_blocks: int, block_size: int,
                 attention_backend: str | None = None):
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.sampler = Sampler()
        self.states: dict[str, RunnerRequestState] = {}
        spec = model.kv_spec()
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=model.device),
             torch.zeros(shape, dtype=model.dtype, device=model.device))
            for _ in range(spec.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model: StageModel, block_size: int) -> int:
        spec = model.kv_spec()
        elem = torch.empty((), dtype=model.dtype).element_size()
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem

    def add_request(self, state: RunnerRequestState) -> None:
        self.states[state.request.request_id] = state

    def remove_request(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.is_empty:
            return RunnerOutput()
        bs = self.block_size
        num_seqs = len(sched.scheduled)
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        seq_lens = np.zeros(num_seqs, dtype=np.int32)
        max_blocks = max(len(s.block_ids) for s in sched.scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        sample_rows: list[int] = []
        sample_states: list[RunnerRequestState] = []
        embed_rows: list[tuple[int, torch.Tensor]] = []  # (batch row, prompt embeds slice)
        row_ranges = []
        row = 0
        for i, s in enumerate(sched.scheduled):
            state = self.states[s.req_id]
            req = state.request
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            end = start + n
            token_ids.extend(req.all_token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(s.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            block_tables[i, : len(s.block_ids)] = s.block_ids
            query_start[i + 1] = query_start[i] + n
            seq_lens[i] = end
            if state.prompt_embeds is not None and start < req.num_prompt_tokens:
                stop = min(end, req.num_prompt_tokens)
                embed_rows.append((row, state.prompt_embeds[start:stop]))
            if end == req.num_tokens:  # all known tokens computed: sample the next one
                sample_rows.append(row + n - 1)
                sample_states.append(state)
            row_ranges.append((s.req_id, row, n))
            row += n

        device = self.model.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(device)
        slot_t = torch.from_numpy(np.concatenate(slots)).to(device)
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            block_tables=torch.from_numpy(block_tables).to(device),
            query_start_loc=torch.from_numpy(query_start).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            max_query_len=int((query_start[1:] - query_start[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
        )
        inputs_embeds = None
        if embed_rows:
            # Stages fed with embeddings: prompt rows come from the upstream
            # stage, generated tokens from the model's own embedding table.
            inputs_embeds = self.model.embed(ids)
            for r, emb in embed_rows:
                inputs_embeds[r : r + emb.shape[0]] = emb.to(inputs_embeds.dtype)
        ctx = ForwardContext(meta, self.kv_caches, self.attention_backend,
                             req_ids=[s.req_id for s in sched.scheduled],
                             num_computed_tokens=[s.num_computed_tokens for s in sched.scheduled],
                             query_start_loc_cpu=query_start.tolist())
        with set_forward_context(ctx):
            outputs = self.model.forward(None if embed_rows else ids, inputs_embeds, pos_t)

        sampled: dict[str, int] = {}
        if sample_rows:
            hidden = outputs["hidden_states"]
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
            params = [st.request.sampling_params for st in sample_states]
            histories = None
            if any(p.repetition_penalty != 1.0 for p in params):
                histories = [st.request.all_token_ids for st in sample_states]
            tokens = self.sampler(logits, params, [st.generator for st in sample_states], histories)
            for st, tok in zip(sample_states, tokens.tolist()):
                sampled[st.request.request_id] = tok
        return RunnerOutput(sampled, outputs, slot_t, row_ranges, len(token_ids))
