"""The request life cycle through the pipeline, real engines (stage_configs/tiny_chain.yaml, local backend):
finished and aborted ids are reused; what cannot fit is refused at once, upstream and downstream."""
from __future__ import annotations

from pathlib import Path

from omni import Omni, SamplingParams
from omni.errors import ContextLengthError
from tests.engine_utils import assert_no_leak

CONFIG = str(Path(__file__).resolve().parents[2] / "stage_configs" / "tiny_chain.yaml")
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _engines(o: Omni) -> dict:
    return {name: w.engine for name, w in o._backend.workers.items()}


def test_finished_and_aborted_ids_are_reused():
    with Omni(CONFIG, backend="local") as o:
        # issue 11, item 1: a finished id, reused, used to fail the whole next batch (KeyError: 'r1')
        [first] = o.generate([{"prompt": "a", "request_id": "r1"}], GREEDY, use_tqdm=False)
        outs = o.generate([{"prompt": "b", "request_id": "r1"}, "innocent"], GREEDY, use_tqdm=False)
        assert [first.error] + [r.error for r in outs] == [None, None, None]
        assert outs[0].request_id == "r1" and outs[0].outputs["thinker"].token_ids
        # An aborted id: closing the stream aborts r2 on the talker, which then forgets it at once.
        it = o.stream([{"prompt": "Hello", "request_id": "r2"}], GREEDY)
        assert next(it).stage == "thinker"
        it.close()
        again = o.generate([{"prompt": "Hello", "request_id": "r2"}, "innocent again"], GREEDY, use_tqdm=False)
        assert [r.error for r in again] == [None, None]
        assert o.stats()["requests"]["aborted"] == 1
        for engine in _engines(o).values():
            assert_no_leak(engine)


def test_what_cannot_fit_is_refused_at_once_upstream_and_downstream():
    # thinker: 8 blocks of 4 = 32 tokens (its max_model_len 256 is lowered to that);
    # talker: its prompt is one row per thinker row, prompt + 3: at most 20 - 8 (its max_tokens) = 12 rows.
    overrides = {"thinker": {"cache": {"num_blocks": 8}}, "talker": {"scheduler": {"max_model_len": 20}}}
    sampling = {"thinker": {"max_tokens": 4, "ignore_eos": True}}
    with Omni(CONFIG, stage_overrides=overrides, backend="local") as o:
        assert o.stats()["stages"]["thinker"]["max_model_len"] == 32
        outs = o.generate([{"prompt_token_ids": list(range(100, 140))},  # issue 11, item 2: 40 + 4 > 32
                           {"prompt_token_ids": list(range(100, 112))},  # thinker fine; talker 15 + 8 > 20
                           {"prompt_token_ids": [5, 6, 7]}],             # innocent: fits everywhere
                          sampling, use_tqdm=False)
        # Refused, not timed out: the errors below are typed context-length errors naming the limit
        # (a timeout would be a RequestTimeoutError), whatever this machine's speed.
        # Typed: the stage, the field at fault, the limit and what was asked for (messages stay human).
        err = outs[0].error
        assert isinstance(err, ContextLengthError)
        assert (err.stage, err.field, err.code, err.limit, err.actual) == (
            "thinker", "prompt", "context_length_exceeded", 32, 44)
        assert "(lowered from 256: the KV cache holds 8 blocks of 4 tokens)" in err.message
        err = outs[1].error
        assert isinstance(err, ContextLengthError)
        assert (err.stage, err.field, err.limit, err.actual) == ("talker", "sampling_params.max_tokens", 20, 23)
        assert len(outs[1].outputs["thinker"].token_ids) == 4  # what the thinker did is still reported
        assert outs[2].error is None and len(outs[2].outputs["talker"].token_ids) == 8
        for engine in _engines(o).values():
            assert_no_leak(engine)
