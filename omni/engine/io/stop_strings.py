"""StopText: one request's reply text, watched for its stop strings (SamplingParams.stop, vLLM's semantics).

The scheduler has no text, so the engine feeds each request with stop strings its new tokens after every step
(`feed`); the first step whose text holds a stop string ends the request there (Scheduler.stop), finish_reason
'stop', stop_reason the string. The earliest match in the text wins; the text ends before it, or after it with
include_stop_str_in_output; the token ids keep every token generated, the one that completed the string included
(as vLLM's). Each step searches only for matches that end in the new text. Before min_tokens tokens there is no
search at all (vLLM's min_tokens holds stop strings back too), and a match that ended then never counts.

Streamed text (`take`) holds back the last (longest stop string - 1) characters while the reply runs, so that no
delta ever carries the beginning of a stop string that the next token completes (vLLM's stop buffer); nothing is
held back with include_stop_str_in_output (the string is part of the reply then). The deltas concatenate to
`final_text()`.
"""
from __future__ import annotations

from typing import Any

from omni.engine.io.detokenizer import IncrementalDetokenizer


class StopText:
    def __init__(self, tokenizer: Any, stops: list[str], include: bool, skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = list(stops)
        self.include = include
        self.longest = max(len(s) for s in self.stops)
        self.hold = 0 if include else self.longest - 1
        self.fed = 0  # output tokens fed so far
        self.sent = 0  # characters taken for deltas so far
        self.stopped: str | None = None  # the stop string that ended the reply
        self.end: int | None = None  # where the reply's text ends once stopped
        self.flushed = False
        self.unchecked = 0  # text made before min_tokens: no match may end in it

    def feed(self, output_token_ids: list[int], check: bool = True) -> str | None:
        """The request's output tokens so far (the new ones are past those fed before): the stop string their
        new text ends, if any (then the reply ends). `check` False (min_tokens not reached): text only, no search;
        a match that ended in it is never looked for later (vLLM's)."""
        if self.stopped is None and len(output_token_ids) > self.fed:
            before = len(self.detok.text)
            self.detok.add(list(output_token_ids[self.fed:]))
            self.fed = len(output_token_ids)
            if check:
                self._search(before)
            else:
                self.unchecked = len(self.detok.text)
        return self.stopped

    def finish(self) -> None:
        """The reply ended (eos, max_tokens, a stop string): settle its text's last characters and search them."""
        if not self.flushed:
            self.flushed = True
            if self.stopped is None:
                before = len(self.detok.text)
                self.detok.flush()
                self._search(before)

    def _search(self, before: int) -> None:
        text = self.detok.text
        # a match ends past `before` (earlier ones were looked for) and past the text made before min_tokens
        end = max(before, self.unchecked)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s, max(0, end - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.stopped = best[1]
            self.end = best[0] + (len(best[1]) if self.include else 0)

    def final_text(self) -> str:
        return self.detok.text[: self.end] if self.stopped is not None else self.detok.text

    def take(self, final: bool) -> str:
        """The text a stream may send now (all of what is left when `final`)."""
        if final:
            self.finish()
        if final or self.stopped is not None:
            text = self.final_text()
            limit = len(text)
        else:
            text = self.detok.text
            limit = max(self.sent, len(text) - self.hold)
        out = text[self.sent:limit]  # (a match never starts before what was sent: the hold-back keeps it back)
        self.sent = max(self.sent, limit)
        return out
