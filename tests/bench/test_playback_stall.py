"""The silence a listener hears in a streamed reply (workloads.playback_stall_s), on hand-made arrival times."""
from __future__ import annotations

import pytest

from omni.bench.workloads import playback_stall_s


def test_chunks_that_come_in_time_leave_no_silence():
    # 0.2 s of audio at 0.1 s plays until 0.3 s; the next chunk came at 0.25 s, so it follows on at once
    assert playback_stall_s([(0.1, 0.2), (0.25, 0.4), (0.6, 1.0)]) == 0.0
    assert playback_stall_s([]) == 0.0 and playback_stall_s([(2.0, 5.0)]) == 0.0


def test_a_late_chunk_is_silence_until_it_arrives():
    # plays 0.1-0.3, then 0.3-0.7 (the second came at 0.2), the third comes at 1.0: 0.3 s of silence; it plays
    # until 2.0, and a fourth at 2.5 adds 0.5 s more
    assert playback_stall_s([(0.1, 0.2), (0.2, 0.4), (1.0, 1.0)]) == pytest.approx(0.3)
    assert playback_stall_s([(0.1, 0.2), (0.2, 0.4), (1.0, 1.0), (2.5, 0.1)]) == pytest.approx(0.8)
