"""The open loop of `omni bench capacity --rates` (workloads.poisson_arrivals, open_loop_timed): requests sent at
their own seeded Poisson times whatever is still running, each timed from its own submission."""
from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest

from omni.bench.workloads import closed_loop_timed, open_loop_timed, poisson_arrivals
from omni.messages import StageDelta


def test_poisson_arrivals_are_seeded_exponential_gaps_from_zero():
    times = poisson_arrivals(2000, 4.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == poisson_arrivals(2000, 4.0, seed=3) and times != poisson_arrivals(2000, 4.0, seed=4)
    gaps = np.diff(times)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)  # 1 / rate
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: the deviation is the mean
    assert poisson_arrivals(1, 2.0, seed=0) == [0.0]
    for bad in (0.0, -1.0, float("nan"), float("inf")):  # NaN would send everything at once, inf too
        with pytest.raises(ValueError, match="finite number > 0 requests per second"):
            poisson_arrivals(3, bad, seed=0)


class _SlowPipeline:
    """An AsyncOmni stand-in: every request streams one audio chunk after `first_s` and ends after `reply_s`."""

    def __init__(self, first_s: float, reply_s: float):
        self.first_s, self.reply_s = first_s, reply_s
        self.submitted: dict[str, float] = {}
        self.running = self.most_running = 0

    async def stream(self, prompt, sampling=None, request_id=None):
        self.submitted[request_id] = time.perf_counter()
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.first_s)
            yield StageDelta(request_id, "token2wav", audio=np.zeros(2400, np.float32), sampling_rate=24000)
            await asyncio.sleep(self.reply_s - self.first_s)
        finally:
            self.running -= 1


def test_requests_are_sent_at_their_times_whatever_is_still_running():
    # Slack of 0.15 s on every time: the suite runs this beside other tests on two cores.
    fake = _SlowPipeline(first_s=0.1, reply_s=1.0)
    arrivals = [0.0, 0.2, 0.4, 1.25]
    t0 = time.perf_counter()
    recs, wall = asyncio.run(open_loop_timed(fake, ["a", "b", "c", "d"], arrivals, id_prefix="r-"))
    assert [r.request_id for r in recs] == ["r-0", "r-1", "r-2", "r-3"]  # prompt order
    sent = [fake.submitted[r.request_id] - t0 for r in recs]
    for got, want in zip(sent, arrivals):
        assert want <= got < want + 0.15  # at its own time, not when an earlier reply ended
    assert fake.most_running >= 3  # the first three overlap: nobody waited for a reply to end
    for r in recs:  # timed from its own submission
        assert 0.1 <= r.first_audio_s < 0.25 and len(r.audio_deltas) == 1
    assert 2.25 <= wall < 2.55  # from the first submission to the last end (1.25 + 1.0)
    with pytest.raises(ValueError, match="2 prompts but 1 arrival"):
        asyncio.run(open_loop_timed(fake, ["a", "b"], [0.0]))


def test_a_closed_loop_of_equal_replies_sends_its_clients_together():
    # Why the open loop exists: two closed-loop clients with equal replies start every round at the same time.
    fake = _SlowPipeline(first_s=0.05, reply_s=0.4)
    t0 = time.perf_counter()
    recs, _ = asyncio.run(closed_loop_timed(fake, ["a", "b", "c", "d"], 2))
    sent = sorted(fake.submitted[r.request_id] - t0 for r in recs)
    assert sent[1] - sent[0] < 0.15 and sent[3] - sent[2] < 0.15 and sent[2] - sent[1] >= 0.25


@pytest.mark.parametrize("rates", [["0"], ["-0.5", "2"], ["nan"], ["inf"]])
def test_capacity_refuses_rates_that_are_not_finite_and_positive(rates):
    import argparse

    from omni.bench import capacity

    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    with pytest.raises(SystemExit, match="finite --rates > 0"):  # before any config or model loads
        capacity.run(parser.parse_args(["--config", "/nonexistent.yaml", "--rates", *rates]))

