"""Higgs Audio v2 speaking a text LLM's reply (a voice agent's mouth): `text_to_higgs_audio_v2`, registered in
stages/__init__.py.

    llm  (any causal LM)   the reply, streamed a few tokens at a time
    tts  (higgs_audio_v2)  the reply spoken piece by piece in ONE request: the first piece is its prompt (with the
                           request's voice), each later piece a new user turn after the audio of the pieces before it

On a streaming edge the reply is cut by `SentenceCutter` (stages/common/sentence_pieces.py): a piece goes on as soon as
its sentence (or a long clause) is complete, so the first audio waits for the first sentence, not the whole reply (and
the first piece is cut sooner: at its first clause, or by a few words).
The voice stays one across pieces: the reference clip is the request's prefix (its blocks hit the prefix cache) and
every piece is spoken after the audio of the ones before it, as Higgs' own long-form generation conditions each chunk
on the audio generated so far. The pieces joined are the reply's text (nothing lost, nothing twice).

On a plain edge (the LLM finished first) the whole reply is the prompt of one turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omni.errors import OmniError
from omni.messages import REFERENCE_AUDIO, MultiModalInput, StageDelta, StageInput, StageOutput

from stages.common.processors import single_upstream
from stages.common.sentence_pieces import SentenceCutter
from stages.higgs_audio_v2.payloads import SpeakNext

EDGE = "text_to_higgs_audio_v2"


def _input(request: StageInput, text: str, **kwargs) -> StageInput:
    """The TTS request speaking `text`; a voice of the request's own (extra[REFERENCE_AUDIO], an uploaded voice)
    is its reference clip, the last audio of its prompt, as a speech request's own clip is."""
    extra = dict(request.extra)
    clip = extra.pop(REFERENCE_AUDIO, None)
    if clip is not None and (not isinstance(clip, MultiModalInput) or clip.modality != "audio"
                             or extra.get("reference_text") is None):
        raise OmniError(f"{EDGE}: extra[{REFERENCE_AUDIO!r}] of request {request.request_id!r} must be an audio "
                        "MultiModalInput with its transcript as extra['reference_text']")
    return StageInput(request.request_id, prompt=text, extra=extra, cache_salt=request.cache_salt,
                      mm_inputs=[clip] if clip is not None else [], **kwargs)


def _nothing_to_say(request: StageInput) -> OmniError:
    return OmniError(f"{EDGE}: the upstream reply of request {request.request_id!r} has no text to speak")


def text2speech(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """The upstream's finished reply, spoken as one turn."""
    text = (single_upstream(upstream, EDGE).text or "").strip()
    if not text:
        raise _nothing_to_say(request)
    return _input(request, text)


# The first piece is cut sooner (the first audio waits for it): at its sentence end, at a clause end once it holds
# FIRST_CLAUSE_CHARS, or at a word boundary by FIRST_MAX_CHARS; the pieces after it as SentenceCutter's defaults.
FIRST_CLAUSE_CHARS, FIRST_MAX_CHARS = 8, 28


@dataclass(slots=True)
class SpokenPieces:
    """The streaming edge's state per request: the cutter (an eager one until the first piece), whether the request
    has started."""

    cutter: SentenceCutter = field(default_factory=lambda: SentenceCutter(FIRST_CLAUSE_CHARS, FIRST_MAX_CHARS))
    started: bool = False

    def feed(self, text: str) -> list[str]:
        pieces = self.cutter.feed(text)
        if pieces and not self.started:  # the first piece is out: the rest is cut at sentence ends
            rest = "".join(pieces[1:]) + (self.cutter.flush() or "")
            self.cutter = SentenceCutter()
            pieces = pieces[:1] + self.cutter.feed(rest)
        return pieces


def text2speech_chunk(chunk: StageDelta, request: StageInput, state: SpokenPieces) -> StageInput | None:
    """The pieces a chunk of the reply completes: the first starts the request, the rest follow as SpeakNext."""
    pieces = state.feed(chunk.text)
    if chunk.finished:
        rest = state.cutter.flush()
        pieces += [rest] if rest else []
    pieces = [p for p in pieces if p.strip()]
    if not state.started:
        if not pieces:
            if chunk.finished:
                raise _nothing_to_say(request)
            return None
        state.started = True
        later = " ".join(p.strip() for p in pieces[1:])
        return _input(request, pieces[0].strip(), payload=SpeakNext(later) if later else None,
                      input_complete=chunk.finished)
    return StageInput(request.request_id, payload=SpeakNext(" ".join(p.strip() for p in pieces)) if pieces else None)
