"""Qwen3-ASR's prompt equals `Qwen3ASRProcessor.apply_transcription_request`'s token ids (with its language and
context options); what the processor does not take is refused naming the field."""
from __future__ import annotations

import numpy as np
import pytest

from omni.errors import RequestError
from omni.messages import MultiModalInput, StageInput
from tests.stages.qwen3_asr.asr_utils import clips


def _ids(processor, clip, language=None, context=None) -> list[int]:
    return processor.apply_transcription_request(clip, language=language, prompt=context)["input_ids"][0].tolist()


@pytest.mark.parametrize("language,context", [(None, None), ("de", None), ("FRENCH", None), (None, "Godot, Beckett"),
                                              ("yue", "粤语")])
def test_prompt_ids_equal_the_processors(asr_stage, asr_processor, language, context):
    clip = clips()["b"]
    inp = StageInput("p", prompt=context, mm_inputs=[MultiModalInput("audio", clip, 16000)],
                     mm_processor_kwargs={"language": language} if language else None)
    prepared = asr_stage.preprocess(inp)
    assert prepared.token_ids == _ids(asr_processor, clip, language, context)
    feat = prepared.mm_features[0]
    assert prepared.token_ids[feat.offset:feat.offset + feat.length] == [asr_stage.audio_token_id] * feat.length


def test_chat_messages_give_the_same_prompt(asr_stage, asr_processor):
    """The context as system messages (joined, as the template joins them) and the clip as the user's audio part."""
    clip = clips()["a"]
    messages = [{"role": "system", "content": "Godot, "},
                {"role": "system", "content": [{"type": "text", "text": "Beckett"}]},
                {"role": "user", "content": [{"type": "audio"}]}]
    inp = StageInput("m", prompt=messages, mm_inputs=[MultiModalInput("audio", clip, 16000)],
                     mm_processor_kwargs={"language": "en"})
    assert asr_stage.preprocess(inp).token_ids == _ids(asr_processor, clip, "en", "Godot, Beckett")


def test_a_clip_shorter_than_the_extractors_minimum_is_padded_as_the_processor_pads_it(asr_stage, asr_processor):
    clip = clips()["a"][:900]
    inp = StageInput("s", mm_inputs=[MultiModalInput("audio", clip, 16000)])
    assert asr_stage.preprocess(inp).token_ids == _ids(asr_processor, clip)


@pytest.mark.parametrize("kwargs,field", [
    (dict(mm_processor_kwargs={"language": "xx"}), "mm_processor_kwargs.language"),
    (dict(mm_processor_kwargs={"language": 7}), "mm_processor_kwargs.language"),
    (dict(mm_processor_kwargs={"task": "translate"}), "mm_processor_kwargs.task"),
    (dict(prompt=[{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe it."}]}]),
     "prompt[0].content[1]"),
    (dict(prompt=[{"role": "assistant", "content": "language English<asr_text>"}]), "prompt[0].content"),
    (dict(prompt_token_ids=[1, 2, 151676], mm_processor_kwargs={"language": "en"}), "mm_processor_kwargs.language"),
])
def test_what_the_processor_does_not_take_is_refused_naming_the_field(asr_stage, kwargs, field):
    inp = StageInput("bad", mm_inputs=[MultiModalInput("audio", clips()["a"], 16000)], **kwargs)
    with pytest.raises(RequestError) as e:
        asr_stage.preprocess(inp)
    assert e.value.field == field


@pytest.mark.parametrize("media,field", [
    (MultiModalInput("image", np.zeros((8, 8, 3), np.uint8)), "multi_modal_data.image[0]"),
    (MultiModalInput("audio", np.zeros(0, np.float32), 16000), "multi_modal_data.audio[0]"),
    (MultiModalInput("audio", np.zeros(1600, np.float32), 24000), "multi_modal_data.audio[0]"),
])
def test_media_it_cannot_hear_is_refused_naming_the_input(asr_stage, media, field):
    with pytest.raises(RequestError) as e:
        asr_stage.preprocess(StageInput("bad", mm_inputs=[media]))
    assert e.value.field == field


@pytest.mark.parametrize("n,field", [(0, "multi_modal_data.audio"), (2, "multi_modal_data.audio[1]")])
def test_one_clip_a_request_as_the_processor_takes_them(asr_stage, n, field):
    inp = StageInput("n", prompt="", mm_inputs=[MultiModalInput("audio", clips()["a"], 16000)] * n)
    with pytest.raises(RequestError) as e:
        asr_stage.preprocess(inp)
    assert e.value.field == field


def test_token_ids_are_taken_as_they_are_their_placeholders_matched_to_the_clips(asr_stage):
    clip = MultiModalInput("audio", clips()["a"], 16000)
    ids = [151644, 151669, 151676, 151670, 151645]
    prepared = asr_stage.preprocess(StageInput("ids", prompt_token_ids=ids, mm_inputs=[clip]))
    n = prepared.mm_features[0].length
    assert prepared.token_ids == [151644, 151669] + [151676] * n + [151670, 151645] and n == 33  # 2.5 s: 13 rows a second, 7 for the last half
    with pytest.raises(RequestError, match="2 audio mm_inputs but 1 audio placeholders"):
        asr_stage.preprocess(StageInput("two", prompt_token_ids=ids, mm_inputs=[clip, clip]))
