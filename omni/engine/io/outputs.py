"""Output assembly of one autoregressive stage (vLLM's output processor): what a step's tokens mean as text.

    stop strings     each step's tokens fed to the requests that have them; the one whose text holds one
                     ends there (stop_strings.py)
    logprobs         the sampled tokens' and the prompt's log-probabilities, on their requests, with texts
    outputs          one StageOutput a request: finished (text, stop reason, prompt report, rows, timings),
                     aborted, or failed

The scheduler knows tokens only; everything textual about a request's reply is kept and built here, and
dropped (`drop`) at the engine's one release point.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from omni.errors import OmniError
from omni.messages import StageOutput, TokenLogprob
from omni.sampling_params import SamplingParams

from omni.engine.core.request import Request, RequestStatus
from omni.engine.core.scheduler import Scheduler
from omni.engine.io.detokenizer import final_decode
from omni.engine.io.prompt_report import prompt_report
from omni.engine.io.request_rows import FinishedRows
from omni.engine.io.request_streams import RequestStreams
from omni.engine.io.stop_strings import StopText
from omni.engine.io.token_bytes import TokenBytes
from omni.engine.stats import StepCounters

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class OutputProcessor:
    def __init__(self, name: str, tokenizer: Any, scheduler: Scheduler, streams: RequestStreams,
                 counters: StepCounters):
        self.name = name
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer) if tokenizer is not None else None
        self.scheduler = scheduler
        self.streams = streams
        self.counters = counters
        self.stops: dict[str, StopText] = {}  # requests with stop strings: their text, watched (stop_strings.py)

    def watch_stops(self, rid: str, params: SamplingParams, forced: bool) -> StopText | None:
        """Start watching a new request's text for its stop strings (its streamed text is this watcher's then).
        A forced reply is exactly its tokens: nothing cuts it; a stage without a tokenizer (e.g. a talker given the
        one SamplingParams a caller set for every stage) makes no text a stop string could end."""
        if params.stop and not forced and self.tokenizer is not None:
            self.stops[rid] = StopText(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                       params.skip_special_tokens)
        return self.stops.get(rid)

    def drop(self, rid: str) -> None:
        self.stops.pop(rid, None)

    def stop_strings(self, sampled: dict[str, int], finished: list[Request]) -> list[Request]:
        """Feed this step's tokens to the requests with stop strings; those whose text now holds one end here
        (returned: finished in this step like the ones update() ended). One that update() ended anyway (eos,
        max_tokens) has its text settled and searched once more."""
        done = {r.request_id: r for r in finished}
        ended = []
        for rid in sampled:
            st = self.stops.get(rid)
            if st is None:
                continue
            if rid in done:
                req = done[rid]
                st.feed(req.text_token_ids(), req.num_output_tokens >= req.sampling_params.min_tokens)
                st.finish()
                continue
            req = self.scheduler.requests.get(rid)
            # vLLM's min_tokens holds stop strings back too: none is looked for before it (one that ended earlier
            # never stops the reply)
            check = req is not None and req.num_output_tokens >= req.sampling_params.min_tokens
            if req is not None and st.feed(req.output_token_ids, check) is not None:
                stopped = self.scheduler.stop(rid)
                if stopped is not None:
                    ended.append(stopped)
        return ended

    def record_logprobs(self, logprobs: dict[str, tuple[float, list[tuple[int, float]]]],
                        finished: list[Request]) -> None:
        """The sampled tokens' log-probabilities, on the requests that took their token this step (not an
        aborted one, nor a forced reply, whose tokens were not sampled), with the tokens' texts."""
        done = {r.request_id: r for r in finished}
        text = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        raw = self.token_bytes or (lambda t: None)
        for rid, (lp, top) in logprobs.items():
            req = self.scheduler.requests.get(rid) or done.get(rid)
            if req is None or req.forced_token_ids is not None or len(req.output_logprobs) >= req.num_output_tokens:
                continue
            token = req.output_token_ids[len(req.output_logprobs)]
            req.output_logprobs.append(TokenLogprob(token, lp, text(token), [(t, p, text(t), raw(t)) for t, p in top],
                                                    token_bytes=raw(token)))

    def record_prompt_logprobs(self, prompt_logprobs: dict[str, tuple[int, list[Any]]],
                               finished: list[Request]) -> None:
        """The prompt positions' log-probabilities this step computed, from position `first` on."""
        for rid, (first, entries) in prompt_logprobs.items():
            req = self.scheduler.requests.get(rid) or next((r for r in finished if r.request_id == rid), None)
            have = len(req.prompt_logprobs) if req is not None else first
            if req is not None and first <= have < first + len(entries):  # a recomputed prefill adds nothing twice
                req.prompt_logprobs.extend(entries[have - first :])

    def aborted(self, req: Request) -> StageOutput:
        """What the stage knew of the prompt when it stopped (its cache hit and split by kind), as a finished
        output reports it: the prompt was read whether or not the reply was done."""
        mm, cached_mm = req.mm_token_counts()
        return StageOutput(req.request_id, self.name, prompt_token_ids=list(req.prompt_token_ids),
                           token_ids=list(req.output_token_ids), finished=True, finish_reason="abort",
                           num_cached_tokens=max(req.num_cached_tokens, 0), prompt_mm_tokens=mm,
                           cached_mm_tokens=cached_mm)

    def failed(self, req: Request, error: OmniError) -> StageOutput:
        self.counters.errors += 1
        return StageOutput(req.request_id, self.name, prompt_token_ids=list(req.prompt_token_ids), finished=True,
                           finish_reason="error", error=error)

    def finished(self, req: Request, rows: FinishedRows | None = None) -> StageOutput:
        rid = req.request_id
        ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
        self.counters.record_finished(ttft)
        out = StageOutput(
            rid, self.name,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),
            finished=True,
            finish_reason=_FINISH_REASONS.get(req.status, "stop"),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics={"ttft_s": ttft or 0.0, "e2e_s": time.monotonic() - req.arrival_time},
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
        )
        report = prompt_report(req, self.tokenizer)
        out.prompt_text, out.prompt_token_texts, out.prompt_logprobs = report.text, report.token_texts, report.logprobs
        out.prompt_mm_tokens, out.cached_mm_tokens = req.mm_token_counts()
        if self.tokenizer is not None and not req.sampling_params.detokenize:
            out.text = ""  # vLLM's detokenize false: the tokens are the reply
        elif self.tokenizer is not None:
            out.text = final_decode(self.tokenizer, req.text_token_ids(), req.sampling_params.skip_special_tokens)
            streamed = self.streams.final_text(rid)
            if streamed is not None and streamed != out.text and rid not in self.stops:
                # A decoder whose output is not prefix-stable: the caller saw the deltas, keep them true.
                logger.warning("stage %s: streamed text of %s differs from its full decode", self.name, rid)
                out.text = streamed
        params = req.sampling_params
        stop = self.stops.get(rid)
        if stop is not None:  # its text ends at its stop string (stop_strings.py)
            stop.finish()
            out.text = stop.final_text()
            if stop.stopped is not None:
                out.finish_reason, out.stop_reason = "stop", stop.stopped
        if (out.stop_reason is None and req.ended_by_stop_token and req.output_token_ids[-1] in params.stop_token_ids
                and (params.ignore_eos or req.output_token_ids[-1] != req.eos_token_id)):
            out.stop_reason = req.output_token_ids[-1]  # vLLM's: the stop token id (eos is none)
        if rows is not None:
            out.hidden_states, out.mm_outputs, out.passthrough = rows.hidden_states, rows.mm_outputs, rows.passthrough
        return out
