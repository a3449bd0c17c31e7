"""Server VAD's models reused from session to session (omni/serve/audio/vad.py VadModels): a model given back is the
next one taken, its recurrent state reset (a new session hears nothing of the last one's speech); at most `keep` are
kept; a detector on a reused model finds speech in recorded speech as one on a fresh model does."""
from __future__ import annotations

import numpy as np

from omni.serve.audio.vad import TurnDetector, VadModels, load_model
from tests.serve.realtime_utils import speech_24k


def test_a_model_given_back_is_reused_with_its_state_reset():
    models = VadModels(keep=1)
    first = models.take()
    speech = speech_24k(3.0)
    fresh = TurnDetector(model=load_model()).feed(speech)
    assert [e.kind for e in fresh][:1] == ["speech_started"]
    used = TurnDetector(model=first)
    assert [(e.kind, e.ms) for e in used.feed(speech)] == [(e.kind, e.ms) for e in fresh]
    models.give(first)
    assert models.free == 1
    again = models.take()
    assert again is first and models.free == 0
    # its state was reset: the same speech gives the same events as on a fresh model
    assert [(e.kind, e.ms) for e in TurnDetector(model=again).feed(speech)] == [(e.kind, e.ms) for e in fresh]
    models.give(again)
    models.give(load_model())  # past `keep`: dropped, not kept
    assert models.free == 1


def test_silence_stays_quiet_on_a_reused_model():
    models = VadModels(keep=2)
    model = models.take()
    TurnDetector(model=model).feed(speech_24k(2.0))
    models.give(model)
    assert TurnDetector(model=models.take()).feed(np.zeros(24000 * 2, np.float32)) == []
