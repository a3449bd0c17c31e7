"""Multi-turn Qwen2.5-Omni with prefix caching: turn 2 hits on thinker and talker, outputs unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from omni.messages import MultiModalInput, StageInput
from tests.stages.omni_utils import image, make_chain, run_chain, talker_atol, thinker_atol
from tests.tolerances import assert_rows_close


def _conversation(chain):
    img = [MultiModalInput("image", image(7))]
    turn1 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What do you see?"}]}]
    r1 = run_chain(chain, [StageInput("t1", prompt=turn1, mm_inputs=img)])["t1"]
    stats1 = [e.stats().as_dict() for e in chain]
    turn2 = turn1 + [{"role": "assistant", "content": r1[0].text},
                     {"role": "user", "content": "Tell me more about it."}]
    r2 = run_chain(chain, [StageInput("t2", prompt=turn2, mm_inputs=img)])["t2"]
    stats2 = [e.stats().as_dict() for e in chain]
    return [r1, r2], stats1, stats2


@pytest.mark.slow
def test_second_turn_hits_thinker_and_talker_and_matches_caching_off(thinker_stage, talker_stage, token2wav_stage):
    on, s1, s2 = _conversation(make_chain(thinker_stage, talker_stage, token2wav_stage, caching=True))
    off, _, _ = _conversation(make_chain(thinker_stage, talker_stage, token2wav_stage, caching=False))
    thinker2, talker2 = on[1][0], on[1][1]
    assert thinker2.num_cached_tokens > 0 and talker2.num_cached_tokens > 0
    assert s2[0]["prefix_cache_hits"] > s1[0]["prefix_cache_hits"]  # thinker
    assert s2[1]["prefix_cache_hits"] > s1[1]["prefix_cache_hits"]  # talker
    for turn_on, turn_off in zip(on, off):
        (t_on, k_on, w_on), (t_off, k_off, w_off) = turn_on, turn_off
        assert t_on.token_ids == t_off.token_ids
        assert_rows_close(t_on.hidden_states, t_off.hidden_states, thinker_atol(t_off.hidden_states), "thinker")
        assert k_on.token_ids == k_off.token_ids
        assert_rows_close(k_on.hidden_states, k_off.hidden_states, talker_atol(k_off.hidden_states), "talker")
        # token2wav sees the same codes either way (asserted above) and runs the same shapes: bitwise.
        np.testing.assert_array_equal(w_on.audio, w_off.audio)
    assert off[1][0].num_cached_tokens == 0 and off[1][1].num_cached_tokens == 0


@pytest.mark.slow
def test_mrope_talker_mode_caches_and_matches_caching_off(thinker_stage, talker_stage, token2wav_stage):
    """transformers_compat=False (codec bos/pad added, 3-D talker positions): same caching invariants."""
    talker_stage.transformers_compat = False
    try:
        on, _, s2 = _conversation(make_chain(thinker_stage, talker_stage, token2wav_stage, caching=True))
        off, _, _ = _conversation(make_chain(thinker_stage, talker_stage, token2wav_stage, caching=False))
    finally:
        talker_stage.transformers_compat = True
    assert on[1][1].num_cached_tokens > 0
    for (t_on, k_on, w_on), (t_off, k_off, w_off) in zip(on, off):
        assert t_on.token_ids == t_off.token_ids and k_on.token_ids == k_off.token_ids
        np.testing.assert_array_equal(w_on.audio, w_off.audio)  # same codes, same shapes: bitwise
