"""kernels/tuned.py: the sweep's winners are written per GPU and shape, and read back at launch."""

from __future__ import annotations

import json

import pytest

from kernels import tuned
from omni.bench import kernels as bench


def test_merge_then_lookup_round_trip(tmp_path):
    path = tmp_path / "attn.json"
    assert tuned.lookup("GPU X", "bf16", 128, "decode", path) is None  # no file: untuned
    tuned.merge("GPU X", "bf16", 128,
                {"decode": {"block_m": 16, "tile": 64, "num_warps": 4, "num_stages": 2, "num_segments": 1}}, path)
    tuned.merge("GPU X", "bf16", 128, {"prefill": {"block_m": 128, "tile": 128, "num_warps": 8, "num_stages": 2}},
                path)
    assert tuned.lookup("GPU X", "bf16", 128, "decode", path) == (16, 64, 4, 2)  # kept by the second merge
    assert tuned.lookup("GPU X", "bf16", 128, "prefill", path) == (128, 128, 8, 2)
    assert tuned.lookup("GPU X", "bf16", 64, "prefill", path) is None  # other head size: heuristic
    assert tuned.lookup("GPU Y", "bf16", 128, "prefill", path) is None  # other GPU: heuristic
    data = json.loads(path.read_text())
    assert set(data["GPU X"]["bf16/d128"]["decode"]) == set(tuned.FIELDS)  # num_segments stays heuristic


def test_merge_rejects_incomplete_or_unknown_entries(tmp_path):
    with pytest.raises(ValueError, match="lacks"):
        tuned.merge("G", "bf16", 128, {"decode": {"block_m": 16}}, tmp_path / "a.json")
    with pytest.raises(ValueError, match="kind must be"):
        tuned.merge("G", "bf16", 128, {"mixed": dict.fromkeys(tuned.FIELDS, 16)}, tmp_path / "a.json")


def test_shipped_file_is_valid():
    data = json.loads(tuned.ATTENTION_FILE.read_text())
    for gpu, shapes in data.items():
        for shape, kinds in shapes.items():
            dtype, d = shape.split("/d")
            for kind in kinds:
                cfg = tuned.lookup(gpu, dtype, int(d), kind)
                assert cfg is not None and all(v > 0 for v in cfg)


def test_bench_writes_the_sweep_winners(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    args = bench.resolve_shape(parser.parse_args(["--sweep", "--write-config", str(tmp_path / "w.json"),
                                                  "--head-dim", "64"]))
    dec = {"best_config": {"block_m": 16, "tile": 128, "num_segments": 1, "num_warps": 4, "num_stages": 3}}
    pre = {"best_config": {"block_m": 64, "tile": 64, "num_segments": None, "num_warps": 4, "num_stages": 2}}
    written = bench._write_config(args, "GPU Z", dec, pre)
    assert written == str(tmp_path / "w.json")
    assert tuned.lookup("GPU Z", "bf16", 64, "decode", tmp_path / "w.json") == (16, 128, 4, 3)
    assert tuned.lookup("GPU Z", "bf16", 64, "prefill", tmp_path / "w.json") == (64, 64, 4, 2)
