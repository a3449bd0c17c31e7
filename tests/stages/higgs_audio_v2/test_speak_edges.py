"""The text -> Higgs Audio v2 edge (an LLM's reply spoken as it streams): the first complete sentence starts the TTS
request, each later piece follows as SpeakNext, the pieces joined are the reply; a plain edge speaks the whole reply."""
from __future__ import annotations

import pytest

from omni.errors import OmniError
from omni.messages import StageDelta, StageInput, StageOutput
from stages.higgs_audio_v2.payloads import SpeakNext
from stages.higgs_audio_v2.speak_edges import SpokenPieces, text2speech, text2speech_chunk

REPLY = "Sure. Dr. Smith arrived at 3.30 p.m. on Monday, and the meeting ran long! Was it worth it? Maybe"
REQUEST = StageInput("r", prompt=[{"role": "user", "content": [{"type": "audio"}]}], extra={"speaker": "alice"},
                     cache_salt="s")


def _chunks(text: str, size: int) -> list[StageDelta]:
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    return [StageDelta("r", "llm", text=p, finished=i == len(parts) - 1) for i, p in enumerate(parts)]


@pytest.mark.parametrize("size", [1, 3, 17, 1000])
def test_pieces_start_the_request_then_follow_and_join_to_the_reply(size):
    state, spoken, first = SpokenPieces(), [], None
    for chunk in _chunks(REPLY, size):
        part = text2speech_chunk(chunk, REQUEST, state)
        if first is None:
            if part is None:
                continue
            first = part
            assert part.prompt and part.extra == {"speaker": "alice"} and part.cache_salt == "s"
            assert part.input_complete == chunk.finished
            spoken.append(part.prompt)
        elif part is not None and part.payload is not None:
            assert part.prompt is None and isinstance(part.payload, SpeakNext)
            spoken.append(part.payload.text)
        if first is not None and first.payload is not None:
            spoken.append(first.payload.text)
            first.payload = None
    assert first is not None and first.prompt == "Sure."
    assert " ".join(spoken).split() == REPLY.split()  # nothing lost, nothing twice


def test_the_first_piece_waits_for_its_sentence_end():
    state = SpokenPieces()
    assert text2speech_chunk(StageDelta("r", "llm", text="Hello there"), REQUEST, state) is None
    part = text2speech_chunk(StageDelta("r", "llm", text=". And"), REQUEST, state)
    assert part is not None and part.prompt == "Hello there." and part.payload is None


def test_an_empty_reply_is_an_error_not_silence_forever():
    with pytest.raises(OmniError, match="no text to speak"):
        text2speech_chunk(StageDelta("r", "llm", text="  ", finished=True), REQUEST, SpokenPieces())
    with pytest.raises(OmniError, match="no text to speak"):
        text2speech({"llm": StageOutput("r", "llm", text="")}, REQUEST)


def test_a_plain_edge_speaks_the_whole_reply_in_the_requests_voice():
    inp = text2speech({"llm": StageOutput("r", "llm", text=f" {REPLY} ")}, REQUEST)
    assert inp.prompt == REPLY and inp.extra == {"speaker": "alice"} and inp.payload is None


def test_the_first_piece_is_cut_sooner_at_a_clause_or_a_few_words():
    state = SpokenPieces()
    long = "Well honestly I would say that the answer depends on many things we have not discussed yet. Next one."
    part = text2speech_chunk(StageDelta("r", "llm", text=long), REQUEST, state)
    assert part is not None and part.prompt == "Well honestly I would say"  # a word boundary by 28 characters
    rest = text2speech_chunk(StageDelta("r", "llm", text=" And more", finished=True), REQUEST, state)
    spoken = [part.prompt, part.payload.text if part.payload else "", rest.payload.text]
    assert " ".join(spoken).split() == (long + " And more").split()
    state = SpokenPieces()  # a clause end once the piece holds 8 characters
    part = text2speech_chunk(StageDelta("r", "llm", text="Of course, the station is north of here, past the bridge. "),
                             REQUEST, state)
    assert part.prompt == "Of course," and part.payload.text == "the station is north of here, past the bridge."
    state = SpokenPieces()  # a shorter clause goes on with the rest
    part = text2speech_chunk(StageDelta("r", "llm", text="Ok, see you. "), REQUEST, state)
    assert part.prompt == "Ok, see you." and part.payload is None


def test_a_voice_of_the_requests_own_is_the_tts_requests_reference_clip():
    """An uploaded voice rides in extra[REFERENCE_AUDIO] past the recognizer and the LLM: the TTS request's prompt
    audio is the clip (the stage's reference, as a speech request's own clip), its transcript stays in extra; the
    request's other media (the clip the recognizer heard) never reach the TTS."""
    import numpy as np

    from omni.messages import REFERENCE_AUDIO, MultiModalInput

    clip = MultiModalInput("audio", np.ones(2400, np.float32), sampling_rate=24000)
    heard = MultiModalInput("audio", np.zeros(16000, np.float32), sampling_rate=16000)
    own = StageInput("r", prompt=REQUEST.prompt, mm_inputs=[heard], cache_salt="s",
                     extra={"reference_text": "my voice", REFERENCE_AUDIO: clip})
    for inp in (text2speech({"llm": StageOutput("r", "llm", text="Hi there.")}, own),
                text2speech_chunk(StageDelta("r", "llm", text="Hi there. And", finished=False), own, SpokenPieces())):
        assert inp.mm_inputs == [clip] and inp.extra == {"reference_text": "my voice"}
    assert own.extra[REFERENCE_AUDIO] is clip  # the request itself is left as it was
    assert text2speech_chunk(StageDelta("r", "llm", text="Hi there.", finished=True), REQUEST,
                             SpokenPieces()).mm_inputs == []
    bad = StageInput("r", extra={REFERENCE_AUDIO: clip})  # a clip without its transcript
    with pytest.raises(OmniError, match="reference_text"):
        text2speech({"llm": StageOutput("r", "llm", text="Hi.")}, bad)
