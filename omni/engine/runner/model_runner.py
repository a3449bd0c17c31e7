"""ModelRunner: the only place where request state becomes tensors.

Takes a SchedulerOutput (ids and counts) and runs one step in three parts:

    prepare  pack the scheduled tokens of every request into one varlen batch
             (1, total_tokens) with explicit positions, slot mapping and block
             tables, written into InputBatch's persistent buffers and uploaded
             with non-blocking copies;
    forward  run the stage model inside one scoped ForwardContext: a decode
             step on CUDA replays a captured CUDA graph (cuda_graphs.py), any
             other step runs eager; per-token outputs start their copy to host
             memory on a side stream (rows_to_host.py);
    sample   logits only for the rows that sample, then the sampler.

The forward pass with its logits and the sampler are timed into `profile` (step_profile.py).
On CPU the same code runs with host buffers as device buffers (no copies).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni.engine.runner.cuda_graphs import DecodeGraphs, default_capture_sizes
from omni.engine.runner.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from omni.engine.runner.input_batch import InputBatch
from omni.engine.core.request import Request
from omni.engine.io.rows_to_host import RowStager, StagedRows
from omni.engine.runner.sampler import Sampler, raw_logprobs
from omni.engine.core.scheduler import SchedulerOutput
from omni.engine.step_profile import StepProfile
from omni.engine.io.structured_output import advance, fill_bitmask
from omni.engine.stage_model import StageModel
from omni.engine.tensor_cache import is_per_token

# Buffer sizes when the caller gives none (tests driving a runner directly).
_DEFAULT_MAX_TOKENS = 8192
_DEFAULT_MAX_SEQS = 256
_DEFAULT_MAX_MODEL_LEN = 32768


@dataclass(slots=True)
class RunnerRequestState:
    """Tensor-side state of one request, kept while it is in the stage."""

    request: Request
    prompt_embeds: torch.Tensor | None = None  # [num_prompt_tokens, hidden]
    generator: torch.Generator | None = None
    grammar: Any = None  # the request's structured-output matcher (structured_output.py), or None
    _embeds_buf: torch.Tensor | None = None  # capacity for a growing prompt (streaming input)

    def append_prompt_embeds(self, rows: torch.Tensor) -> None:
        """Grow the prompt embeddings; capacity doubles, so a prompt streamed in k chunks costs
        O(total) copies, not O(k * total)."""
        old = self.prompt_embeds
        n, k = old.shape[0], rows.shape[0]
        buf = self._embeds_buf if self._embeds_buf is not None else old
        if buf.shape[0] < n + k:
            bigger = torch.empty((max(2 * buf.shape[0], n + k), *old.shape[1:]), dtype=old.dtype, device=old.device)
            bigger[:n] = old
            buf = bigger
        buf[n : n + k] = rows
        self._embeds_buf = buf
        self.prompt_embeds = buf[: n + k]


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    # Per-token outputs of the whole batch, rows in scheduled order, on their
    # way to host memory (wait() before reading, release() after).
    rows: StagedRows | None = None
    # Per-request outputs that are not per token (device tensors, passed through).
    other_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    slot_mapping: np.ndarray | None = None  # int64 [num_tokens], a host copy
    # (req_id, first row in the batch, number of rows) in scheduled order.
    row_ranges: list[tuple[str, int, int]] = field(default_factory=list)
    num_tokens: int = 0
    # Of the sampled requests that asked (SamplingParams.logprobs): (logprob, [(id, logprob)] most likely first).
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    # Of the requests that asked (SamplingParams.prompt_logprobs) and prefilled prompt positions this step: the
    # first position's index and, at each position in order, the next prompt token's (id, logprob, top, rank).
    prompt_logprobs: dict[str, tuple[int, list[tuple[int, float, list[tuple[int, float]], int]]]] = field(
        default_factory=dict)


@dataclass(slots=True)
class _Prepared:
    num_tokens: int
    num_seqs: int
    sample_rows: list[int]
    sample_states: list[RunnerRequestState]
    embed_rows: list[tuple[int, torch.Tensor]]  # (batch row, prompt embeds slice)
    row_ranges: list[tuple[str, int, int]]
    is_decode: bool  # every sequence schedules one token from its own token ids
    # (request id, first position, first batch row, rows, the prompt tokens those rows predict) of the requests
    # that asked for prompt_logprobs
    prompt_lp: list[tuple[str, int, int, int, list[int]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: StageModel, num_blocks: int, block_size: int,
                 attention_backend: str | None = None, *, max_num_tokens: int | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 cuda_graphs: bool = True, capture_sizes: list[int] | None = None, emit_rows: bool = True):
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.sampler = Sampler()
        self.profile = StepProfile()  # the engine shares its own (StageEngine.profile)
        self.states: dict[str, RunnerRequestState] = {}
        spec = model.kv_spec()
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=model.device),
             torch.zeros(shape, dtype=model.dtype, device=model.device))
            for _ in range(spec.num_layers)
        ]
        device = torch.device(model.device)
        max_num_tokens = max_num_tokens or _DEFAULT_MAX_TOKENS
        max_num_seqs = max_num_seqs or _DEFAULT_MAX_SEQS
        max_blocks = -(-(max_model_len or _DEFAULT_MAX_MODEL_LEN) // block_size)
        self.batch = InputBatch(max_num_tokens, max_num_seqs, max_blocks, block_size, device)
        # Per-token outputs go to host memory only for stages that hand them on.
        self._max_num_tokens = max_num_tokens
        self.stager = RowStager(device, max_num_tokens) if emit_rows else None
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self._graphs_possible(device):
            self.graphs = DecodeGraphs(self.batch, capture_sizes or default_capture_sizes(max_num_seqs))
            self.model.prepare_cuda_graphs(max_num_seqs)
            self.graphs.capture(lambda ids, pos: self.model.forward(ids, None, pos), self._graph_context)
            if not self.graphs.captured:
                self.graphs = None

    @property
    def emits_rows(self) -> bool:
        return self.stager is not None

    def enable_rows(self) -> None:
        """Start copying every step's per-token outputs to host memory (from the next step on)."""
        if self.stager is None:
            self.stager = RowStager(torch.device(self.model.device), self._max_num_tokens)

    def _graphs_possible(self, device: torch.device) -> bool:
        from kernels.dispatch import resolve_backend

        return (device.type == "cuda" and self.model.supports_cuda_graphs
                # The torch reference reads lengths back to the host: not capturable.
                and resolve_backend(self.attention_backend, self.kv_caches[0][0]) == "triton")

    @staticmethod
    def kv_bytes_per_block(model: StageModel, block_size: int) -> int:
        spec = model.kv_spec()
        elem = torch.empty((), dtype=model.dtype).element_size()
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem

    def add_request(self, state: RunnerRequestState) -> None:
        self.states[state.request.request_id] = state

    def remove_request(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def stats(self) -> dict:
        return {
            "cuda_graph_sizes": self.graphs.captured if self.graphs else [],
            "cuda_graph_replays": self.graphs.replays if self.graphs else 0,
            "rows_staged_bytes": self.stager.bytes_staged if self.stager else 0,
        }

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.is_empty:
            return RunnerOutput()
        prep = self._prepare(sched)
        t0 = time.perf_counter()
        outputs = self._forward(sched, prep)
        sampled, logprobs = self._sample(outputs["hidden_states"], prep, t0)
        prompt_logprobs = self._prompt_logprobs(outputs["hidden_states"], prep) if prep.prompt_lp else {}
        n = prep.num_tokens
        per_token = {k: v for k, v in outputs.items() if is_per_token(v, n)}
        other = {k: v for k, v in outputs.items() if k not in per_token}
        return RunnerOutput(sampled, self.stager.stage(per_token) if self.stager else None, other,
                            self.batch.np["slot_mapping"][:n].copy(), prep.row_ranges, n, logprobs, prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, prep: _Prepared) -> dict[str, tuple[int, list]]:
        """Each asking request's prompt rows of this step through the output head: the log-probability of the prompt
        token each row predicts, from the raw logits (as the generated tokens' logprobs)."""
        t0 = time.perf_counter()
        out = {}
        for rid, start, row, n, targets in prep.prompt_lp:
            logits = self.model.compute_logits(hidden[row : row + n])
            top = self.states[rid].request.sampling_params.prompt_logprobs
            tokens = torch.tensor(targets, device=logits.device)
            chosen = logits.float().gather(1, tokens.view(-1, 1))
            ranks = (logits.float() > chosen).sum(dim=-1).add_(1).tolist()  # vLLM's rank of the prompt token
            out[rid] = (start, [(t, lp, tp, r) for t, (lp, tp), r in
                                zip(targets, raw_logprobs(logits, tokens, [top] * n), ranks)])
        self.profile.sampling_s += time.perf_counter() - t0
        return out

    def _prepare(self, sched: SchedulerOutput) -> _Prepared:
        """Fill the host side of the input buffers for this step."""
        self.batch.wait_uploaded()  # the host buffers are free once the last step's copies have read them
        b = self.batch.np
        bs = self.block_size
        num_seqs = len(sched.scheduled)
        self.batch.check_fits(sched.num_batched_tokens or sum(s.num_scheduled_tokens for s in sched.scheduled),
                              num_seqs, max(len(s.block_ids) for s in sched.scheduled))
        qsl, seq_lens, tables = b["query_start_loc"], b["seq_lens"], b["block_tables"]
        ids, positions = b["input_ids"], b["positions"]
        qsl[0] = 0
        sample_rows: list[int] = []
        sample_states: list[RunnerRequestState] = []
        embed_rows: list[tuple[int, torch.Tensor]] = []
        prompt_lp: list[tuple[str, int, int, int, list[int]]] = []
        row_ranges = []
        is_decode = True
        generated_only = self.model.graphs_need_generated_tokens
        decodes_early = self.model.info.decodes_before_input_complete
        row = 0
        for i, s in enumerate(sched.scheduled):
            state = self.states[s.req_id]
            req = state.request
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            end = start + n
            ids[row : row + n] = req.all_token_ids[start:end]
            positions[row : row + n] = np.arange(start, end)
            tables[i, : len(s.block_ids)] = s.block_ids
            qsl[i + 1] = row + n
            seq_lens[i] = end
            if state.prompt_embeds is not None and start < req.num_prompt_tokens:
                stop = min(end, req.num_prompt_tokens)
                embed_rows.append((row, state.prompt_embeds[start:stop]))
            # All known tokens computed: sample the next one (not while more prompt may come).
            if end == req.num_tokens and (req.input_complete or decodes_early):
                sample_rows.append(row + n - 1)
                sample_states.append(state)
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # position p's logits predict prompt token p + 1: rows start .. min(end, P - 1) - 1
                last = min(end, req.num_prompt_tokens - 1)
                prompt_lp.append((s.req_id, start, row, last - start, list(req.all_token_ids[start + 1 : last + 1])))
            is_decode = is_decode and n == 1 and (start >= req.num_prompt_tokens or not generated_only)
            row_ranges.append((s.req_id, row, n))
            row += n
        # Slot of every token: its block's id * block_size + offset in the block.
        pos = positions[:row]
        seq_of_token = np.repeat(np.arange(num_seqs), np.diff(qsl[: num_seqs + 1]))
        b["slot_mapping"][:row] = tables[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        return _Prepared(row, num_seqs, sample_rows, sample_states, embed_rows, row_ranges,
                         is_decode and not embed_rows, prompt_lp)

    def _forward(self, sched: SchedulerOutput, prep: _Prepared) -> dict[str, torch.Tensor]:
        n_tok, n_seq = prep.num_tokens, prep.num_seqs
        padded = self.graphs.padded_size(n_seq) if (self.graphs and prep.is_decode) else None
        if padded is not None:
            self.batch.fill_padding(n_tok, n_seq, padded)
            self.batch.upload(padded, padded)
            self.model.before_graph_replay([s.req_id for s in sched.scheduled], padded)
            self._before_forward()
            out = self.graphs.replay(padded)
            return {k: (v[:n_tok] if is_per_token(v, padded) else v) for k, v in out.items()}

        self.batch.upload(n_tok, n_seq)
        dev = self.batch.dev
        ids = dev["input_ids"][:n_tok]
        inputs_embeds = None
        if prep.embed_rows:
            # Stages fed with embeddings: prompt rows come from the upstream
            # stage, generated tokens from the model's own embedding table.
            inputs_embeds = self.model.embed(ids)
            for r, emb in prep.embed_rows:
                inputs_embeds[r : r + emb.shape[0]] = emb.to(inputs_embeds.dtype)
        qsl = self.batch.np["query_start_loc"][: n_seq + 1]
        ctx = self._context(n_tok, n_seq, req_ids=[s.req_id for s in sched.scheduled],
                            num_computed_tokens=[s.num_computed_tokens for s in sched.scheduled],
                            query_start_loc_cpu=qsl.tolist())
        self._before_forward()
        with set_forward_context(ctx):
            return self.model.forward(None if prep.embed_rows else ids, inputs_embeds,
                                      dev["positions"][:n_tok])

    def _before_forward(self) -> None:
        if self.stager is not None:
            self.stager.before_forward()

    def _context(self, num_tokens: int, num_seqs: int, **host_view) -> ForwardContext:
        dev = self.batch.dev
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:num_tokens],
            block_tables=dev["block_tables"][:num_seqs],
            query_start_loc=dev["query_start_loc"][: num_seqs + 1],
            seq_lens=dev["seq_lens"][:num_seqs],
        )
        return ForwardContext(meta, self.kv_caches, self.attention_backend, **host_view)

    def _graph_context(self, size: int) -> ForwardContext:
        return self._context(size, size)

    def _sample(self, hidden: torch.Tensor, prep: _Prepared, t_forward: float) -> tuple[dict[str, int], dict]:
        """Tokens of the rows that sample, and the log-probabilities of those that asked; the time since
        `t_forward` up to the sampler is the forward's."""
        if not prep.sample_rows:
            self.profile.forward_s += time.perf_counter() - t_forward
            return {}, {}
        if prep.sample_rows != list(range(prep.num_tokens)):
            hidden = hidden.index_select(0, self.batch.upload_sample_rows(prep.sample_rows))
        logits = self.model.compute_logits(hidden)
        t_sampler = time.perf_counter()  # the sampler's inputs (histories, banned tokens) are sampling's
        self.profile.forward_s += t_sampler - t_forward
        states = prep.sample_states
        params = [st.request.sampling_params for st in states]
        histories = None
        if any(p.repetition_penalty != 1.0 for p in params):
            histories = [st.request.all_token_ids for st in states]
        banned = None
        if any(p.min_tokens for p in params):
            # vLLM's min_tokens: until a request has that many tokens, neither its eos nor its stop
            # tokens may be sampled (ignore_eos or not).
            banned = [[*p.stop_token_ids, *(() if st.request.eos_token_id is None else (st.request.eos_token_id,))]
                      if st.request.num_output_tokens < p.min_tokens else [] for st, p in zip(states, params)]
        outputs = None
        if any(p.uses_output_penalties for p in params):
            outputs = [st.request.output_token_ids for st in states]
        grammars = [st.grammar for st in states]
        allowed = fill_bitmask(grammars, logits.shape[-1]) if any(g is not None for g in grammars) else None
        tokens = self.sampler(logits, params, [st.generator for st in states], histories, banned, outputs, allowed)
        token_list = tokens.tolist()
        sampled = {st.request.request_id: tok for st, tok in zip(states, token_list)}
        if allowed is not None:
            for st, tok in zip(states, token_list):
                if st.grammar is not None and advance(st.grammar, tok):
                    st.request.structured_done = True  # the scheduler's stop rule ends it this step
        logprobs = {}
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asked:  # from the raw logits (the sampler never modifies them), as vLLM's default
            idx = torch.tensor(asked, device=logits.device)
            lps = raw_logprobs(logits.index_select(0, idx), tokens.index_select(0, idx),
                               [params[i].logprobs for i in asked])
            logprobs = {states[i].request.request_id: lp for i, lp in zip(asked, lps)}
        self.profile.sampling_s += time.perf_counter() - t_sampler
        return sampled, logprobs
