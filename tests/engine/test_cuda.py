"""The engine on a real GPU: CUDA-graph decode, side-stream row copies, bf16.

Skipped without CUDA (CI is CPU-only); run on a GPU machine with
`TRITON_INTERPRET=0 pytest tests/engine/test_cuda.py`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.store_kv import interpreting
from stages.checkpoints import TINY_ARCHS
from tests.engine_utils import assert_no_leak, generate, make_engine
from tests.tolerances import assert_rows_close, decoder_atol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                                reason="needs a CUDA GPU with real Triton kernels (TRITON_INTERPRET=0)")

PROMPTS = [[5 + i for i in range(13)], [40 + 2 * i for i in range(6)], [7, 9, 11], list(range(100, 133)),
           [3] * 5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_matches_eager(tiny_llama, dtype):
    results = {}
    for graphs in (False, True):
        engine = make_engine(tiny_llama, device="cuda", dtype=dtype, cuda_graphs=graphs, max_num_seqs=8)
        stats = engine.stats()
        assert bool(stats["cuda_graph_sizes"]) == graphs
        outs = generate(engine, PROMPTS, max_tokens=12)
        again = generate(engine, [PROMPTS[3] + [77, 78]], prefix="again", max_tokens=6)  # hit, then graph decode
        assert again[0].num_cached_tokens > 0
        if graphs:
            assert engine.stats()["cuda_graph_replays"] > 0, "decode never replayed a graph"
        assert_no_leak(engine)
        results[graphs] = outs + again
    for eager, graph in zip(results[False], results[True]):
        if dtype == "float32":
            assert eager.token_ids == graph.token_ids
            # A replayed graph runs the padded batch's kernels: reordered fp32 sums only.
            atol = decoder_atol(eager.hidden_states, layers=TINY_ARCHS["llama"], widest_sum=128)
            assert_rows_close(graph.hidden_states, eager.hidden_states, atol, eager.request_id)
        else:  # bf16: a different batch shape may flip a near-tie; most tokens agree
            same = sum(a == b for a, b in zip(eager.token_ids, graph.token_ids))
            assert same >= len(eager.token_ids) // 2
        assert graph.hidden_states.shape[0] == len(graph.prompt_token_ids) + len(graph.token_ids) - 1


def test_rows_cross_to_host_and_caching_on_off_equal(tiny_llama):
    """Hidden states arrive on the host through the side stream, cached rows included."""
    outs = {}
    for caching in (True, False):
        engine = make_engine(tiny_llama, device="cuda", caching=caching)
        first = generate(engine, [PROMPTS[3]], max_tokens=4)
        second = generate(engine, [PROMPTS[3] + [8, 9, 10]], prefix="second", max_tokens=4)
        assert (second[0].num_cached_tokens > 0) == caching
        assert isinstance(second[0].hidden_states, np.ndarray)
        assert_no_leak(engine)
        outs[caching] = first + second
        stats = engine.stats()
        assert stats["rows_staged_bytes"] > 0
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        atol = decoder_atol(b.hidden_states, layers=TINY_ARCHS["llama"], widest_sum=128)
        assert_rows_close(a.hidden_states, b.hidden_states, atol, a.request_id)  # cached vs recomputed rows
