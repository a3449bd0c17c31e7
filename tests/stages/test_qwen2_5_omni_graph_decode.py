"""The Qwen2.5-Omni thinker's CUDA-graph decode path, run here on the CPU: a graph records the forward that sees a
ForwardContext without host state (each row's rotary `delta` from the device buffer `before_graph_replay` fills),
so an eager stand-in for DecodeGraphs that runs exactly that forward, padding rows included, must give what the
host-state path gives: the same tokens, the same 3-D positions, the same rows up to the reordering of sums. On a
GPU tests/engine/test_cuda.py replays real graphs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.store_kv import interpreting
from omni.engine.runner.forward_context import set_forward_context
from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion
from tests.stages.omni_utils import CASES, thinker_atol
from tests.tolerances import assert_rows_close

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class EagerReplay:
    """DecodeGraphs' interface without CUDA: `replay(size)` runs the forward a capture records, under the capture's
    context, on the runner's persistent input buffers (padded to a capture size as on a GPU)."""

    def __init__(self, runner, sizes=(1, 2, 4, 8)):
        self.runner, self.sizes, self.replays = runner, sorted(sizes), 0
        self.captured = list(self.sizes)

    def padded_size(self, num_seqs: int):
        return next((s for s in self.sizes if s >= num_seqs), None)

    def replay(self, size: int):
        batch = self.runner.batch
        with set_forward_context(self.runner._graph_context(size)):
            out = self.runner.model.forward(batch.dev["input_ids"][:size], None, batch.dev["positions"][:size])
        self.replays += 1
        return out


@pytest.mark.slow
def test_graph_decode_equals_the_host_state_path(thinker_stage):
    stage = thinker_stage
    inputs = lambda: [StageInput(n, prompt=p, mm_inputs=mm, sampling_params=GREEDY)  # noqa: E731
                      for n, (p, mm) in CASES.items()]
    plain = make_engine(None, model=stage, block_size=4)
    for inp in inputs():
        plain.add_request(inp)
    want = run_to_completion(plain)
    graphed = make_engine(None, model=stage, block_size=4)
    replay = graphed.runner.graphs = EagerReplay(graphed.runner)
    stage.prepare_cuda_graphs(graphed.runner.batch.max_num_seqs)
    try:
        for inp in inputs():
            graphed.add_request(inp)
        got = run_to_completion(graphed)
    finally:
        stage._graph_delta = None
    assert replay.replays >= GREEDY.max_tokens - 1  # every decode step of the three replayed
    deltas = {n: stage.preprocess(inp).extra["thinker"].delta for n, inp in zip(CASES, inputs())}
    assert any(d != 0 for d in deltas.values()), "no request with a rotary delta: the buffer would go untested"
    for name in CASES:
        assert got[name].token_ids == want[name].token_ids, name
        np.testing.assert_array_equal(got[name].mm_outputs["mrope_positions"], want[name].mm_outputs["mrope_positions"])
        assert_rows_close(got[name].hidden_states, want[name].hidden_states, thinker_atol(want[name].hidden_states),
                          name)
    assert_no_leak(graphed)


@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                    reason="needs a CUDA GPU with real Triton kernels (TRITON_INTERPRET=0)")
def test_thinker_decode_replays_cuda_graphs_on_a_gpu(tiny_omni):
    from stages.qwen2_5_omni.thinker import Qwen2_5OmniThinkerStage

    stage = Qwen2_5OmniThinkerStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cuda"))
    outs = {}
    for graphs in (False, True):
        engine = make_engine(None, model=stage, block_size=4, cuda_graphs=graphs, max_num_seqs=8)
        for n, (p, mm) in CASES.items():
            engine.add_request(StageInput(n, prompt=p, mm_inputs=mm, sampling_params=GREEDY))
        outs[graphs] = run_to_completion(engine)
        stats = engine.stats().as_dict()
        assert bool(stats["cuda_graph_sizes"]) == graphs
        assert (stats["cuda_graph_replays"] > 0) == graphs, stats
        assert_no_leak(engine)
    for name in CASES:
        eager, graph = outs[False][name], outs[True][name]
        assert graph.token_ids == eager.token_ids, name
        np.testing.assert_array_equal(graph.mm_outputs["mrope_positions"], eager.mm_outputs["mrope_positions"])
        assert_rows_close(graph.hidden_states, eager.hidden_states, thinker_atol(eager.hidden_states), name)
