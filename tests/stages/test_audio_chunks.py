"""The one audio chunk schedule (stages/common/audio_chunks.py), as both families' audio stages use it."""
from __future__ import annotations

import pytest

from stages.common.audio_chunks import ChunkSchedule


def _chunks(schedule: ChunkSchedule, total: int, lookahead: int = 0) -> list[int]:
    sizes, done = [], 0
    while done < total:
        end = schedule.next_end(len(sizes), done, total, complete=True, lookahead=lookahead)
        sizes.append(end - done)
        done = end
    return sizes


def test_sizes_grow_from_the_first_chunk_to_the_cap():
    assert [ChunkSchedule.from_kwargs("codes", 4, 3, 16).size(i) for i in range(6)] == [3, 4, 8, 16, 16, 16]
    assert [ChunkSchedule.from_kwargs("frames", 3, 2, 10).size(i) for i in range(6)] == [2, 3, 6, 10, 10, 10]
    assert ChunkSchedule.from_kwargs("frames", 300) == ChunkSchedule(300, 300, 300)


@pytest.mark.parametrize("unit", ["codes", "frames"])
def test_a_short_last_chunk_goes_on_its_own_for_both_families(unit):
    """token2wav (codes) and code2wav (frames) cut alike: fixed windows as transformers' chunked_decode cuts
    them, the short rest last."""
    schedule = ChunkSchedule.from_kwargs(unit, 12, 4)
    assert _chunks(schedule, 40) == [4, 12, 12, 12]
    assert _chunks(ChunkSchedule.from_kwargs(unit, 12), 40) == [12, 12, 12, 4]
    assert _chunks(ChunkSchedule.from_kwargs(unit, 4, 3, 16), 52) == [3, 4, 8, 16, 16, 5]


def test_an_incomplete_input_waits_for_its_chunk_and_the_lookahead():
    s = ChunkSchedule.from_kwargs("codes", 4, 3)
    assert s.next_end(0, 0, 3, complete=False) == 3
    assert s.next_end(0, 0, 3, complete=False, lookahead=2) is None
    assert s.next_end(0, 0, 5, complete=False, lookahead=2) == 3
    assert s.next_end(1, 3, 3, complete=True) == 3  # everything cut before the end was known: an empty piece


@pytest.mark.parametrize("unit", ["codes", "frames"])
def test_bad_sizes_name_their_kwarg(unit):
    with pytest.raises(ValueError, match=f"max_chunk_{unit}: must be >= chunk_{unit}"):
        ChunkSchedule.from_kwargs(unit, 8, cap=4)
    with pytest.raises(ValueError, match=f"first_chunk_{unit}: must be >= 1"):
        ChunkSchedule.from_kwargs(unit, 8, 0)
