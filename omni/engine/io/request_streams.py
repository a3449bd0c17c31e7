"""RequestStreams: what a stage keeps for requests that stream, out or in.

Out (StageInput.stream): every step that computes tokens of the request yields
a StageDelta: the tokens sampled this step, their text once it is final
(IncrementalDetokenizer), and how many tokens have rows by now (a streaming
edge reads those rows, request_rows.py, while the request runs).

In (StageInput.input_complete=False): the prompt grows chunk by chunk. Token
ids need nothing here, but a prompt of *embeddings* is hashed through one
digest per block of rows, and a chunk rarely ends on a block boundary: the
rows of the last, partial block are kept until the block fills, then its
digest is final.

    prompt rows:  [ block 0 ][ block 1 ][ blo|        chunk k ends mid-block 2
    digests:        final      final     provisional (recomputed when rows arrive)
    tail:                                [ blo]       kept here

Only full blocks are ever hashed, so a provisional digest is never used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from omni.messages import StageDelta

from omni.engine.io.detokenizer import IncrementalDetokenizer
from omni.engine.io.stop_strings import StopText
from omni.engine.io.prompt_report import prompt_report


def block_digests(rows: np.ndarray, block_size: int) -> list[bytes]:
    """One digest per block of rows (the last block may be partial)."""
    return [xxhash.xxh3_128_digest(rows[i : i + block_size].tobytes()) for i in range(0, rows.shape[0], block_size)]


@dataclass(slots=True)
class _Stream:
    deltas: bool
    detok: IncrementalDetokenizer | StopText | None
    tail: np.ndarray | None  # prompt-embedding rows of the last partial block (growing inputs)
    sent_prompt: bool = False  # the first delta carries the prompt ids
    sent_echo: bool = False  # with echo, the first delta with generated tokens carries the prompt's report
    sent_tokens: int = 0  # output tokens the deltas carried so far


class RequestStreams:
    def __init__(self, name: str, tokenizer: Any, block_size: int):
        self.name = name
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._streams: dict[str, _Stream] = {}
        self.num_deltas = 0

    def __contains__(self, rid: str) -> bool:
        return rid in self._streams

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def add(self, rid: str, *, deltas: bool, prompt_rows: np.ndarray | None, text: StopText | None = None,
            skip_special_tokens: bool = True, detokenize: bool = True) -> None:
        """`text`: the request's stop-string watcher, whose text its deltas carry (held back where a stop string
        may begin, cut where one ended it). `detokenize` false: the deltas carry no text."""
        detok = (text if text is not None else IncrementalDetokenizer(self.tokenizer, skip_special_tokens)) if (
            deltas and detokenize and self.tokenizer is not None) else None
        tail = None
        if prompt_rows is not None:
            tail = prompt_rows[prompt_rows.shape[0] // self.block_size * self.block_size:].copy()
        self._streams[rid] = _Stream(deltas, detok, tail)

    def drop(self, rid: str) -> None:
        self._streams.pop(rid, None)

    def extended_digests(self, rid: str, digests: list[bytes], num_prompt: int, rows: np.ndarray) -> list[bytes]:
        """The prompt's digest list after appending `rows` to a prompt of `num_prompt` embedding rows."""
        st = self._streams[rid]
        tail = st.tail if st.tail is not None else rows[:0]
        joined = np.concatenate([tail, rows]) if tail.shape[0] else rows
        full = num_prompt // self.block_size
        new = digests[:full] + block_digests(joined, self.block_size)
        end = (num_prompt + rows.shape[0]) // self.block_size * self.block_size
        st.tail = joined[end - full * self.block_size:].copy()
        return new

    def step_deltas(self, scheduled_ids: list[str], sampled: dict[str, int], requests: dict[str, Any],
                    finished: dict[str, Any]) -> list[StageDelta]:
        """Deltas of the streamed requests scheduled this step. `requests`: still running (id -> Request);
        `finished`: finished in this step (id -> Request); their text is flushed to the end."""
        out = []
        for rid in scheduled_ids:
            st = self._streams.get(rid)
            if st is None or not st.deltas:
                continue
            req = requests.get(rid) or finished.get(rid)
            if req is None:  # failed in this step: its terminal output says why
                continue
            # Output tokens whose preceding row is computed by now: the one sampled this step, or (a forced
            # reply, prefilled in one pass) those of its tokens the pass has reached; a preempted request
            # recomputing tokens already sent sends nothing again.
            ready = max(0, min(req.num_output_tokens, req.num_computed_tokens - req.num_prompt_tokens + 1))
            new = list(req.output_token_ids[st.sent_tokens:ready])
            st.sent_tokens = max(st.sent_tokens, ready)
            done = rid in finished
            if isinstance(st.detok, StopText):  # (the engine fed it this step's tokens)
                text = st.detok.take(final=done)
            else:
                # the detokenizer holds the tokens sent before; at the end, not a stop token the text leaves out
                ids = req.text_token_ids() if done else req.output_token_ids
                text = st.detok.add(list(ids[len(st.detok.ids):ready])) if st.detok is not None else ""
                if done and st.detok is not None:
                    text += st.detok.flush()
            delta = StageDelta(rid, self.name, new, text, req.num_prompt_tokens, req.num_computed_tokens, done)
            if req.sampling_params.logprobs is not None:
                delta.logprobs = req.output_logprobs[st.sent_tokens - len(new):st.sent_tokens]
            if not st.sent_prompt:
                delta.prompt_token_ids, st.sent_prompt = list(req.prompt_token_ids), True
                delta.num_cached_tokens = max(req.num_cached_tokens, 0)  # scheduled by now: its cache hit is known
                delta.prompt_mm_tokens, delta.cached_mm_tokens = req.mm_token_counts()
            if new and not st.sent_echo and req.sampling_params.echo_prompt:
                # The prompt is computed by the time a token is sampled, so its logprobs are all there.
                report = prompt_report(req, self.tokenizer)
                delta.prompt_text, delta.prompt_token_texts = report.text, report.token_texts
                delta.prompt_logprobs, st.sent_echo = report.logprobs, True
            out.append(delta)
        self.num_deltas += len(out)
        return out

    def final_text(self, rid: str) -> str | None:
        """The streamed text of a request (deltas concatenated), or None when it did not stream text."""
        st = self._streams.get(rid)
        if st is None or st.detok is None:
            return None
        return st.detok.final_text() if isinstance(st.detok, StopText) else st.detok.text
