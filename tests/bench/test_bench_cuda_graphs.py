"""`omni bench cuda-graphs`: without CUDA a clean skip; `--device cpu` runs the whole measurement on the tiny
Qwen2.5-Omni thinker (both sides eager there: the same tokens, the JSON's keys). The GPU numbers are README's."""
from __future__ import annotations

import argparse

import pytest
import torch

from omni.bench import cuda_graphs as bench


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_cuda_it_is_a_clean_skip():
    res = bench.run(_args())
    assert res["gpu"] is None and "no CUDA device" in res["skipped"]


@pytest.mark.slow
def test_a_cpu_smoke_run_reports_every_key(tiny_omni):
    res = bench.run(_args("--device", "cpu", "--model", "builtin:tiny-qwen2_5-omni", "--dtype", "float32",
                          "--batch", "1", "2", "--prompt-tokens", "20", "--decode-steps", "4", "--num-blocks", "64"))
    assert res["stage_model"] == "qwen2_5_omni_thinker" and res["device"] == "cpu"
    assert set(res["batches"]) == {"1", "2"} and res["graph_replays"] == 0 and res["graph_sizes"] == []
    for level in res["batches"].values():
        assert level["graphs_ms"] > 0 and level["eager_ms"] > 0 and level["tokens_identical"] == 1
    assert res["tokens_identical"] == 1 and res["speedup_min"] > 0
