"""One request inside one stage: token ids, counters and incremental block hashes.

Pure Python (no torch): the scheduler and the KV cache manager only ever see
counters and token ids. Everything else is derived.

Block hashes are kept in step with the tokens: every time a block of
``block_size`` tokens becomes full, its chained hash is appended to
``block_hashes`` by the ``block_hasher`` the stage handed in (the KV cache
manager's, or ``None`` when prefix caching is off, in which case nothing is
ever hashed).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from omni.engine.core.kv_cache.hashing import BlockHash, BlockHasher


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal input (image, audio clip, ...) placed in the prompt.

    The prompt holds ``length`` placeholder tokens for it starting at
    ``offset``; ``mm_hash`` identifies its *content*, so that two prompts with
    identical placeholder tokens but different images never share a KV block.
    """

    mm_hash: str
    offset: int
    length: int
    modality: str = ""  # "image" | "audio" | ...: usage counts the prompt's tokens per modality (not hashed)

    def __post_init__(self) -> None:
        if not isinstance(self.mm_hash, str) or not self.mm_hash:
            raise ValueError(f"MultiModalFeature.mm_hash must be a non-empty str, got {self.mm_hash!r}")
        if self.offset < 0:
            raise ValueError(f"MultiModalFeature.offset must be >= 0, got {self.offset}")
        if self.length < 1:
            raise ValueError(f"MultiModalFeature.length must be >= 1, got {self.length}")


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. Every status after PREEMPTED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6


class Request:
    """A request of one stage.

    ``all_token_ids`` is prompt + output; ``block_hashes`` has one entry per
    full block of it (only when a block hasher is set). The scheduler owns
    ``num_computed_tokens``, ``num_cached_tokens`` and ``status``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        sampling_params: Any = None,
        mm_features: Sequence[MultiModalFeature] = (),
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        prompt_embeds_digests: list[bytes] | None = None,
        block_hasher: "BlockHasher | None" = None,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        # The prompt list is kept as given (callers hand over ownership, as in
        # vLLM): one copy fewer per request on the admission path.
        self.prompt_token_ids: list[int] = (
            prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        )
        self.output_token_ids: list[int] = []
        # One omni.messages.TokenLogprob per output token when sampling_params.logprobs is set (the engine fills
        # it; this module imports nothing of the outputs, the KV manager's side needs none of it).
        self.output_logprobs: list[Any] = []
        # (token id, logprob, [(id, logprob)] best first, rank) of prompt tokens 1.. as the prefill computes them
        # (sampling_params.prompt_logprobs; the engine adds the texts at the end).
        self.prompt_logprobs: list[tuple[int, float, list[tuple[int, float]], int]] = []
        # prompt + output in one list, so that hashing and the runner never
        # concatenate on the hot path.
        self.all_token_ids: list[int] = self.prompt_token_ids.copy()
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # Monotonic, like the scheduler's first_token_time,
        # so that TTFT and e2e latencies are differences on one clock.
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        num_prompt = len(self.prompt_token_ids)
        # Sorted by offset: the hasher scans them in order and stops early.
        features = tuple(sorted(mm_features, key=lambda f: f.offset)) if mm_features else ()
        for f in features:
            if f.offset + f.length > num_prompt:
                raise ValueError(
                    f"request {request_id!r}: mm_features entry at offset {f.offset} with length "
                    f"{f.length} ends past the prompt ({num_prompt} tokens)"
                )
        self.mm_features: tuple[MultiModalFeature, ...] = features
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.prompt_embeds_digests = list(prompt_embeds_digests) if prompt_embeds_digests is not None else None

        self.status = RequestStatus.WAITING
        # False while more prompt may come (a streaming edge): the request computes
        # what it has, then waits without sampling (the scheduler skips it).
        self.input_complete = True
        # Tokens computable with the input received so far (a model that decodes while its
        # input still streams in); None: all of them.
        self.compute_limit: int | None = None
        # Compute the whole prompt even when its blocks are cached (the engine sets
        # it when the stage's row store cannot vouch for cached blocks' rows).
        self.skip_prefix_hits = False
        # The reply, when forced (SamplingParams.forced_token_ids / forced_text): all but its last token
        # are output tokens from admission on; the scheduler appends the last instead of a sampled one.
        self.forced_token_ids: list[int] | None = None
        # Set by the runner when the request's structured-output grammar is complete (structured_output.py).
        self.structured_done = False
        # Set by the scheduler when the last output token ended the request as eos or one of stop_token_ids.
        self.ended_by_stop_token = False
        self.num_computed_tokens = 0
        # -1 until the scheduler first schedules the request and records how
        # many prompt tokens came from the prefix cache.
        self.num_cached_tokens = -1
        # Set by the scheduler; TTFT = first_token_time - arrival_time.
        self.first_token_time: float | None = None

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    # -- derived counters -------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def computable_tokens(self) -> int:
        """num_tokens, capped by compute_limit while a streamed input is behind."""
        return self.num_tokens if self.compute_limit is None else min(self.num_tokens, self.compute_limit)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def text_token_ids(self) -> list[int]:
        """The output tokens the reply's text is made of: all of them, but the eos or stop token that ended the
        request (vLLM's: its text is left out unless include_stop_str_in_output; the token ids keep it)."""
        params = self.sampling_params
        if self.ended_by_stop_token and not getattr(params, "include_stop_str_in_output", False):
            return self.output_token_ids[:-1]
        return self.output_token_ids

    @property
    def block_hasher(self) -> "BlockHasher | None":
        return self._block_hasher

    def mm_token_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """The prompt's multimodal placeholder tokens per modality, and those of them inside its cached prefix
        [0, num_cached_tokens) (usage splits the prompt by kind): known from the request's first scheduling on."""
        cached = max(self.num_cached_tokens, 0)
        prompt: dict[str, int] = {}
        hit: dict[str, int] = {}
        for f in self.mm_features:
            kind = f.modality or "other"
            prompt[kind] = prompt.get(kind, 0) + f.length
            hit[kind] = hit.get(kind, 0) + max(0, min(f.length, cached - f.offset))
        return prompt, hit

    @property
    def is_finished(self) -> bool:
        """True for the FINISHED_* statuses."""
        return self.status > RequestStatus.PREEMPTED

    # -- mutation ----------------------------------------------------------
    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled token(s); hash every block that became full."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        hasher = self._block_hasher
        # Cheap guard first: most decode steps do not complete a block.
        if hasher is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.block_hashes.extend(hasher(self))

    def append_input(self, token_ids: list[int]) -> None:
        """Input that follows the outputs (a model that takes input after it replied: StageInfo.
        takes_input_after_output): kept in the output as tokens the request did not sample, so that prompt +
        output stays the sequence the model computes."""
        if not self.output_token_ids:
            raise ValueError(f"request {self.request_id!r}: input after the outputs needs an output first")
        self.append_output_token_ids(list(token_ids))

    def extend_prompt(self, token_ids: list[int], prompt_embeds_digests: list[bytes] | None = None) -> None:
        """Grow the prompt (streaming input; only before any token is generated); hash every
        block that became full. `prompt_embeds_digests`: the whole list, one per prompt block."""
        if self.output_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt cannot grow after generation started")
        self.prompt_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if prompt_embeds_digests is not None:
            self.prompt_embeds_digests = prompt_embeds_digests
        hasher = self._block_hasher
        if hasher is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.block_hashes.extend(hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
