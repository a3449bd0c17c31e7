"""The step profiler (omni/engine/step_profile.py): a stage's time split into forward / sampling / host /
waiting, accumulated by the engine and turned into fractions over a window."""
from __future__ import annotations

import time

import pytest

from omni.engine.step_profile import PHASES, window
from tests.engine_utils import generate, make_engine


def test_window_fractions_add_to_one_by_construction():
    before = {"busy_time_s": 1.0, "forward_time_s": 0.5, "sampling_time_s": 0.1, "host_time_s": 0.4}
    after = {"busy_time_s": 3.0, "forward_time_s": 1.7, "sampling_time_s": 0.3, "host_time_s": 1.0}
    w = window(before, after, wall_s=4.0)
    assert w["stage_busy_fraction"] == pytest.approx(0.5)
    assert (w["forward"], w["sampling"], w["host"], w["waiting"]) == pytest.approx((0.3, 0.05, 0.15, 0.5))
    assert sum(w[p] for p in PHASES) == pytest.approx(1.0)
    # A step already running at the first snapshot can make busy exceed the window: waiting 0, still 1.
    over = window(before, after, wall_s=1.0)
    assert over["waiting"] == 0 and over["stage_busy_fraction"] == 1
    assert sum(over[p] for p in PHASES) == pytest.approx(1.0)
    # Nothing happened: all waiting.
    assert window(after, after, wall_s=2.0) == {"stage_busy_fraction": 0.0, "forward": 0.0, "sampling": 0.0,
                                                 "host": 0.0, "waiting": 1.0}


def test_window_of_an_engine_that_does_not_split_its_steps_counts_them_as_forward():
    before = {"step_time_s": 1.0, "busy_time_s": None}
    after = {"step_time_s": 2.5, "busy_time_s": None}
    w = window(before, after, wall_s=3.0)
    assert w == pytest.approx({"stage_busy_fraction": 0.5, "forward": 0.5, "sampling": 0.0, "host": 0.0,
                               "waiting": 0.5})


def test_engine_profile_is_busy_after_work_and_splits_its_steps(tiny_llama):
    engine = make_engine(tiny_llama)
    before = engine.stats().as_dict()
    assert before["busy_time_s"] == 0 and before["forward_time_s"] == 0 and before["sampling_time_s"] == 0
    t0 = time.perf_counter()
    generate(engine, [[5, 6, 7, 8, 9], [10, 11, 12]], max_tokens=6)
    time.sleep(0.05)  # idle: counted as waiting
    wall = time.perf_counter() - t0
    after = engine.stats().as_dict()
    assert after["forward_time_s"] > 0 and after["sampling_time_s"] > 0 and after["host_time_s"] > 0
    assert after["busy_time_s"] == pytest.approx(after["forward_time_s"] + after["sampling_time_s"]
                                                 + after["host_time_s"])
    assert after["busy_time_s"] <= wall and after["uptime_s"] >= wall
    w = window(before, after, wall)
    assert 0 < w["stage_busy_fraction"] < 1 and w["waiting"] > 0
    assert sum(w[p] for p in PHASES) == pytest.approx(1.0)
    assert w["stage_busy_fraction"] == pytest.approx(1 - w["waiting"])


def test_replicas_add_their_busy_time_and_an_engine_without_it_stays_unsplit():
    from omni.pipeline.replica_stats import merge_replica_stats

    split = merge_replica_stats([{"busy_time_s": 1.0, "forward_time_s": 0.5, "step_time_s": 0.9},
                                 {"busy_time_s": 2.0, "forward_time_s": 1.5, "step_time_s": 1.8}])
    assert split["busy_time_s"] == 3.0 and split["forward_time_s"] == 2.0
    unsplit = merge_replica_stats([{"busy_time_s": None, "step_time_s": 1.0}, {"busy_time_s": None, "step_time_s": 2.0}])
    assert unsplit["busy_time_s"] is None and unsplit["step_time_s"] == 3.0
    assert window({"busy_time_s": None, "step_time_s": 0.0}, unsplit, wall_s=6.0)["forward"] == pytest.approx(0.5)
