"""The engine on a real GPU: CUDA-graph decode, side-stream row copies, bf16.

Skipped without CUDA (CI is CPU-only); run on a GPU machine with
`TRITON_INTERPRET=0 pytest tests/engine/test_cuda.py`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.store_kv import interpreting
from stages.checkpoints.tiny_lm import TINY_ARCHS
from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leak, generate, make_engine, run_to_completion
from tests.tolerances import assert_rows_close, decoder_atol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                                reason="needs a CUDA GPU with real Triton kernels (TRITON_INTERPRET=0)")

# No prompt repeats one token: rows that nearly equal their neighbours would let a shifted row pass the tolerance
# (assert_rows_close refuses such a check).
PROMPTS = [[5 + i for i in range(13)], [40 + 2 * i for i in range(6)], [7, 9, 11], list(range(100, 133)),
           [3, 1, 4, 15, 9]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_matches_eager(tiny_llama, dtype):
    results = {}
    for graphs in (False, True):
        engine = make_engine(tiny_llama, device="cuda", dtype=dtype, cuda_graphs=graphs, max_num_seqs=8)
        stats = engine.stats().as_dict()
        assert bool(stats["cuda_graph_sizes"]) == graphs
        outs = generate(engine, PROMPTS, max_tokens=12)
        again = generate(engine, [PROMPTS[3] + [77, 78]], prefix="again", max_tokens=6)  # hit, then graph decode
        assert again[0].num_cached_tokens > 0
        if graphs:
            assert engine.stats().as_dict()["cuda_graph_replays"] > 0, "decode never replayed a graph"
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
        stats = engine.stats().as_dict()
        assert stats["rows_staged_bytes"] > 0
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        atol = decoder_atol(b.hidden_states, layers=TINY_ARCHS["llama"], widest_sum=128)
        assert_rows_close(a.hidden_states, b.hidden_states, atol, a.request_id)  # cached vs recomputed rows


@pytest.mark.parametrize("graphs", [False, True])
def test_steps_that_sample_nothing_leave_the_next_steps_inputs_alone(tiny_llama, graphs):
    """A step that samples nothing (a chunk of a long prompt, a prompt streamed in one token at a time) ends without
    a host sync; the next step must not refill the pinned input buffers before the GPU has copied them (it did: a
    streamed prompt decoded other tokens on an H100)."""
    prompt = [3 + (7 * i) % 900 for i in range(61)]
    whole = generate(make_engine(tiny_llama, device="cuda", cuda_graphs=graphs), [prompt], max_tokens=10)[0]
    chunked = make_engine(tiny_llama, device="cuda", cuda_graphs=graphs, max_num_batched_tokens=8)
    assert generate(chunked, [prompt], max_tokens=10)[0].token_ids == whole.token_ids
    streamed = make_engine(tiny_llama, device="cuda", cuda_graphs=graphs)
    streamed.add_request(StageInput("r", prompt_token_ids=prompt[:1], input_complete=False,
                                    sampling_params=SamplingParams(temperature=0.0, max_tokens=10)))
    for i in range(1, len(prompt)):
        streamed.step()  # computes what it has; samples nothing until the prompt is complete
        streamed.extend_request("r", prompt[i : i + 1], last=i == len(prompt) - 1)
    outs = run_to_completion(streamed)
    assert outs["r"].token_ids == whole.token_ids
    assert_no_leak(streamed)
