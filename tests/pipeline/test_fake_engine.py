"""The fake engine (tests/fakes.py) follows the engine contract the pipeline tests rely on."""
from __future__ import annotations

from omni.messages import StageInput
from tests.fakes import HIDDEN, chain_config, expected_tokens, fake_factory, text_ids


def test_fake_engine_follows_the_contract():
    from omni.config.loader import load_config

    cfg = load_config(chain_config())
    eng = fake_factory(cfg.stages[0])
    eng.add_request(StageInput("r", prompt="hi"))
    assert eng.has_unfinished()
    outs = []
    while eng.has_unfinished():
        outs += eng.step().finished
    assert [o.token_ids for o in outs] == [expected_tokens("thinker", text_ids("hi"), 3)]
    assert outs[0].hidden_states.shape == (2 + 3 - 1, HIDDEN)
    try:
        eng.add_request(StageInput("x", prompt="__bad__"))
    except ValueError as e:
        assert "__bad__" in str(e)
    else:
        raise AssertionError("expected ValueError")
