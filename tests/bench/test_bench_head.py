"""Smoke test of `omni bench head`: both sides timed per shape and row count, the layouts reported."""

import argparse
import json

import pytest

from omni.bench import head
from omni.engine.runner import output_head


def _run(argv):
    parser = argparse.ArgumentParser()
    head.add_arguments(parser)
    return head.run(parser.parse_args(argv))


def test_bench_head_times_both_sides_for_every_row_count(capsys, monkeypatch):
    # One head above the "larger than the cache" size (lowered for the test), one below it.
    monkeypatch.setattr(output_head, "LARGE_HEAD_BYTES", 64 << 10)
    result = _run(["--shapes", "5000x32", "300x16", "--rows", "1", "3", "12", "--repeats", "2"])
    assert result["heads"]["5000x32"]["layout"] == "dual" and result["heads"]["300x16"]["layout"] == "column"
    for shape in ("5000x32", "300x16"):
        assert sorted(result["heads"][shape]["rows"], key=int) == ["1", "3", "12"]
        for side in result["heads"][shape]["rows"].values():
            assert side["linear_ms"] > 0 and side["column_ms"] > 0 and side["prepared_ms"] > 0
            assert side["speedup"] == pytest.approx(side["linear_ms"] / side["prepared_ms"])
            assert side["speedup_vs_column"] == pytest.approx(side["column_ms"] / side["prepared_ms"])
    assert result["speedup_mean"] > 0 and result["threads"] == 1
    json.dumps(result)
    assert "head 5000x32 (dual), 3 rows" in capsys.readouterr().out


def test_bench_head_rejects_a_bad_shape():
    with pytest.raises(SystemExit, match="VOCABxHIDDEN"):
        _run(["--shapes", "5000by32"])
