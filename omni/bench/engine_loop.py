"""One stage's engine for the engine benchmarks (prefix, tensor-cache, throughput, cuda-graphs, token2wav),
and the one loop that drives it.

    engine(name, model, model_path, ...)   built by omni.pipeline.engine_factory.build_engine from a
                                           StageConfig: the engine a pipeline stage gets, never one
                                           wired by hand
    steps(engine, inputs)                  admit `inputs`, then step until nothing is left, yielding
                                           each step's output and its wall time
    run(engine, inputs)                    the same to the end: the finished outputs, in finish order

A benchmark that times a stage alone (no pipeline, no routing, no threads) drives it here, through
the engine contract (omni.engine.interface) only: what it reads is what a step reports
(EngineStepOutput: outputs, deltas, the forward pass's rows) and the stage's stats.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from omni.engine.interface import Engine, EngineStepOutput
from omni.messages import StageInput, StageOutput


def engine(name: str, model: str, model_path: str, *, emit_hidden_states: bool = True, cuda_graphs: bool = True,
           **stage: Any) -> Engine:
    """The engine of a stage `name` running `model` (a registered stage model) from `model_path`
    (a path or builtin:NAME); `stage`: any other StageConfig field (enable_prefix_caching, dtype, device,
    scheduler={...}, cache={...}). `emit_hidden_states` and `cuda_graphs`: engine_factory.build_engine."""
    from omni.config.schema import StageConfig
    from omni.pipeline.engine_factory import build_engine

    config = StageConfig(name=name, model=model, model_path=str(model_path), **stage)
    return build_engine(config, emit_hidden_states=emit_hidden_states, cuda_graphs=cuda_graphs)


def steps(engine: Engine, inputs: Iterable[StageInput] = (), sync: Callable[[], None] | None = None
          ) -> Iterator[tuple[EngineStepOutput, float]]:
    """Admit `inputs`, then step while the engine has work: each step's output and its wall seconds
    (`sync()` before and after it: on a GPU, torch.cuda.synchronize, so a step's kernels count in it).
    Stopping early (break) leaves the rest queued in the engine."""
    for inp in inputs:
        engine.add_request(inp)
    while engine.has_unfinished():
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        out = engine.step()
        if sync is not None:
            sync()
        yield out, time.perf_counter() - t0


def run(engine: Engine, inputs: Iterable[StageInput] = ()) -> list[StageOutput]:
    """Admit `inputs` and step until the engine is idle; every finished output, in finish order."""
    return [o for out, _ in steps(engine, inputs) for o in out.finished]
