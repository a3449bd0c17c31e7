"""One Higgs Audio v2 request speaking several pieces of text (an LLM's reply as it streams): each piece after the
first is a new user turn after the audio of the ones before it, in the same request (its KV kept). The frames of a
later turn equal transformers' `generate` on the conversation rendered with the earlier turns' audio as assistant
turns, whether the next piece was there when a turn ended or came while the request waited."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.messages import MultiModalInput, StageInput
from omni.sampling_params import SamplingParams
from stages.checkpoints.builtin import builtin_path
from stages.higgs_audio_v2 import model as model_module
from stages.higgs_audio_v2.delay import DelayState, build_delay_pattern
from stages.higgs_audio_v2.edges import DelayedFrames
from stages.higgs_audio_v2.payloads import SpeakNext
from tests.engine_utils import assert_no_leak
from tests.stages.higgs_audio_v2.higgs_utils import VOICE_TEXT, engine_for, load_stage, voice_codes

FIRST, SECOND = "The sun rises in the east.", "And it sets in the west, every single day."
END_AT = 9  # the first turn's codebook 0 ends at this step (a random model rarely ends a turn by itself)


class _FirstTurnEnds(DelayState):
    """The delay pattern's state, with codebook 0 made to end at step END_AT in the first turn only (the rest of the
    pattern, the other codebooks' ends, is the real one)."""

    made = 0

    def __init__(self, ids, prompt_tail):
        super().__init__(ids, prompt_tail)
        type(self).made += 1
        self.turn, self.step = type(self).made, 0

    def mask(self, scores, last_token):
        out = super().mask(scores, last_token)
        if self.turn == 1 and self.step == END_AT:
            out[0, :] = float("-inf")
            out[0, self.ids.stream_eos] = 0.0
        self.step += 1
        return out


@pytest.fixture(scope="module", params=["tiny", "k8"])
def setup(request, tmp_path_factory):
    from transformers import HiggsAudioV2ForConditionalGeneration

    path = builtin_path(f"tiny-higgs-audio-v2{'' if request.param == 'tiny' else '-k8'}")
    hf = HiggsAudioV2ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    k, c = hf.config.num_codebooks, hf.config.audio_stream_bos_id
    voices = {"alice": voice_codes(k, c, 40, 0)}
    return path, hf, load_stage(path, voices, tmp_path_factory.mktemp("voices")), voices


@pytest.fixture
def turns(monkeypatch):
    _FirstTurnEnds.made = 0
    monkeypatch.setattr(model_module, "DelayState", _FirstTurnEnds)


def _frames(out) -> np.ndarray:
    rows = np.asarray(out.mm_outputs["audio_codes"])
    return rows[rows[:, 0] >= 0].astype(np.int64)


def _drive(engine, rid: str, max_steps: int = 500) -> list:
    finished = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        step = engine.step()
        finished += step.finished
        engine.kv.check_integrity()
    return finished


def _split(frames: np.ndarray, k: int, bos: int) -> tuple[np.ndarray, np.ndarray]:
    """A two-turn generation -> (the first turn's frames, all-bos to all-eos; the second turn's frames)."""
    ends = np.flatnonzero((frames == bos + 1).all(axis=1))
    assert len(ends) >= 1, "the first turn did not end"
    return frames[:ends[0] + 1], frames[ends[0] + 1:]


def _reference(hf, stage, voices, first_turn: np.ndarray, n: int) -> np.ndarray:
    """transformers on the conversation: the voice, the first piece, its audio as an assistant turn (the frames as
    generated), the second piece."""
    cfg = hf.config
    k = cfg.num_codebooks
    # the prompt's tokens, as the chat template renders the conversation (an audio turn of these many frames)
    clips = [voices["alice"], np.zeros((k, len(first_turn) - k - 1), np.int64)]
    stage.prompter.voices.encode = lambda _m, _where: clips.pop(0)
    audio_turn = {"role": "assistant", "content": [{"type": "audio"}]}
    messages = [{"role": "user", "content": VOICE_TEXT}, audio_turn, {"role": "user", "content": FIRST}, audio_turn,
                {"role": "user", "content": SECOND}]
    try:
        ids = stage.prompter.prepare(StageInput("hf", prompt=messages, mm_inputs=[
            MultiModalInput("audio", np.zeros(10, np.float32)) for _ in range(2)])).token_ids
    finally:
        del stage.prompter.voices.encode
    audio = np.concatenate([build_delay_pattern(voices["alice"], cfg.audio_stream_bos_id, cfg.audio_stream_eos_id),
                            first_turn])
    with torch.no_grad():
        t = torch.tensor([ids])
        out = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=n,
                          audio_input_ids=torch.tensor(audio)[None],
                          audio_input_ids_mask=torch.ones(1, audio.shape[0], dtype=torch.bool))
    return out[0, audio.shape[0]:].numpy()


@pytest.mark.parametrize("caching", [True, False])
def test_next_piece_queued_is_spoken_as_the_next_turn_equal_to_transformers(setup, turns, caching):
    path, hf, stage, voices = setup
    engine = engine_for(stage, path, caching=caching)
    sp = SamplingParams(temperature=0.0, max_tokens=60)
    engine.add_request(StageInput("r", prompt=FIRST, sampling_params=sp, extra={"speaker": "alice"},
                                  input_complete=False))
    engine.extend_request("r", [], payload=SpeakNext(SECOND), last=True)
    (out,) = _drive(engine, "r")
    assert out.error is None and out.finish_reason == "length"
    first, second = _split(_frames(out), hf.config.num_codebooks, hf.config.audio_stream_bos_id)
    assert len(second) > 5
    np.testing.assert_array_equal(second, _reference(hf, stage, voices, first, len(second)))
    assert_no_leak(engine)


def test_a_turn_waits_for_the_next_piece_and_the_end_ends_the_reply(setup, turns):
    path, hf, stage, voices = setup
    engine = engine_for(stage, path)
    sp = SamplingParams(temperature=0.0, max_tokens=200)
    engine.add_request(StageInput("w", prompt=FIRST, sampling_params=sp, extra={"speaker": "alice"},
                                  input_complete=False))
    assert _drive(engine, "w") == []  # the first turn ended; nothing to speak yet: it waits, holding its blocks
    req = engine.scheduler.requests["w"]
    assert req.num_computed_tokens == req.num_tokens - 1 and engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.extend_request("w", [], payload=SpeakNext(SECOND))
    _FirstTurnEnds.made = 0  # the second turn ends at END_AT too
    assert _drive(engine, "w") == []
    engine.extend_request("w", [], last=True)  # the reply is over: the request ends after the turn it spoke
    (out,) = _drive(engine, "w")
    assert out.error is None and out.finish_reason == "stop"
    frames = _frames(out)
    k, bos = hf.config.num_codebooks, hf.config.audio_stream_bos_id
    first, second = _split(frames, k, bos)
    assert (second[-1] == bos + 1).all() and (second[0] == bos).all()
    np.testing.assert_array_equal(second[:END_AT], _reference(hf, stage, voices, first, END_AT))
    feed = DelayedFrames(stream_bos=bos, stream_eos=bos + 1)
    feed.add(frames)
    assert len(feed.aligned()) == (len(first) - k - 1) + (len(second) - k - 1)  # both turns' codes, one after another
    assert_no_leak(engine)


def test_a_turn_is_as_long_as_its_text_allows_then_the_next_is_spoken(setup, monkeypatch):
    """model_kwargs.turn_frames_per_char: a turn's codebook 0 ends at frame max(MIN_TURN_FRAMES, ceil(per_char x
    characters)), the others after it as the delay pattern has them; the next piece follows (a random model would
    never end a turn by itself). Here the bound is below where these models end a turn of their own."""
    path, hf, stage, voices = setup
    k = hf.config.num_codebooks
    monkeypatch.setattr(model_module, "MIN_TURN_FRAMES", 4)
    monkeypatch.setattr(stage, "turn_frames_per_char", 0.3)
    engine = engine_for(stage, path)
    engine.add_request(StageInput("c", prompt=FIRST, sampling_params=SamplingParams(temperature=0.0, max_tokens=200),
                                  extra={"speaker": "alice"}, input_complete=False))
    engine.extend_request("c", [], payload=SpeakNext(SECOND), last=True)
    (out,) = _drive(engine, "c")
    assert out.error is None and out.finish_reason == "stop"
    first, second = _split(_frames(out), k, hf.config.audio_stream_bos_id)
    eos = hf.config.audio_stream_eos_id
    cap = max(4, -(-len(FIRST) * 3 // 10))  # 8 frames: these models do not end this turn by then (END_AT's test)
    # codebook 0 ends at frame `cap`, codebook k (k >= 1) at cap + k + 1: the all-eos frame is frame cap + K
    assert len(first) == cap + k + 1 and first[cap, 0] == eos != first[cap - 1, 0]
    assert len(second) <= max(4, -(-len(SECOND) * 3 // 10)) + k + 1  # 13 frames at most (it may end by itself)
    assert_no_leak(engine)
