"""The server's parts without a server: audio and image decoding, resampling, stop strings, and how
omni's errors and pydantic's become OpenAI errors naming the request's field."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni.errors import (ContextLengthError, RequestAbortedError, RequestError, RequestTimeoutError,
                         StageError)
from omni.serve.audio.codecs import decode_audio, encode_wav, pcm16_chunks, pcm16_to_float, to_pcm16
from omni.serve.audio.resampling import resample
from omni.serve.protocol.parse import parse_request
from omni.serve.http.errors import ApiError, from_omni_error
from omni.serve.media import decode_image, parse_data_url
from omni.serve.protocol.chat import ChatCompletionRequest
from omni.serve.generation.run import StopMatcher

MB = 2**20


def tone(rate: int, seconds: float = 0.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def audio_file(x: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


# ----------------------------------------------------------------------- audio
@pytest.mark.parametrize("fmt,subtype,tol", [("WAV", "PCM_16", 1e-4), ("WAV", "PCM_24", 1e-6),
                                             ("WAV", "FLOAT", 0.0), ("FLAC", None, 1e-4)])
def test_decode_audio_formats(fmt, subtype, tol):
    x = tone(22050)
    got, rate = decode_audio(audio_file(x, 22050, fmt, subtype), "a", 64 * MB)
    assert rate == 22050 and got.dtype == np.float32
    np.testing.assert_allclose(got, x, atol=tol)


def test_decode_audio_mixes_stereo_down_and_checks_sizes():
    x = tone(16000)
    stereo = np.stack([x, -x * 0.5], axis=1)
    got, _ = decode_audio(audio_file(stereo, 16000, "WAV", "FLOAT"), "a", 64 * MB)
    np.testing.assert_allclose(got, x * 0.25, atol=1e-6)
    with pytest.raises(ApiError) as e:  # 8,000 frames x 2 channels x 4 bytes > 1,000 bytes: refused from the header
        decode_audio(audio_file(stereo, 16000, "WAV"), "clip", 1000)
    assert e.value.status == 413 and e.value.param == "clip"
    with pytest.raises(ApiError) as e:
        decode_audio(b"RIFF\x00\x00\x00\x00WAVEnothing", "clip", MB)
    assert e.value.status == 400 and e.value.param == "clip"


def test_resample_is_band_limited():
    x = tone(44100, 1.0, hz=440)
    y = resample(x, 44100, 16000)
    assert y.size == 16000
    ref = tone(16000, 1.0, hz=440)
    np.testing.assert_allclose(y[200:-200], ref[200:-200], atol=2e-3)  # edges: the FFT's periodic wrap
    up = resample(ref, 16000, 24000)
    np.testing.assert_allclose(up[300:-300], tone(24000, 1.0)[300:-300], atol=2e-3)
    assert resample(x, 16000, 16000) is not None and resample(x, 16000, 16000).size == x.size


def test_pcm16_wav_and_chunks_agree():
    x = np.linspace(-1.2, 1.2, 1001, dtype=np.float32)  # clipped at +-1
    pcm = to_pcm16(x)
    assert len(pcm) == 2002 and pcm16_to_float(pcm).max() == 1.0
    assert b"".join(pcm16_chunks(x, 100)) == pcm and len(list(pcm16_chunks(x, 100))) == 11
    samples, rate = sf.read(io.BytesIO(encode_wav(x, 24000)), dtype="int16")
    assert rate == 24000 and samples.tobytes() == pcm


# ----------------------------------------------------------------------- media
def image_bytes(h: int, w: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 200, np.uint8)).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_decode_image_formats(fmt):
    arr = decode_image(image_bytes(20, 30, fmt), "img", MB)
    assert arr.shape == (20, 30, 3) and arr.dtype == np.uint8 and abs(int(arr.mean()) - 200) <= 3


def test_image_size_is_checked_before_decoding():
    big = image_bytes(2000, 2000, "PNG")  # compresses to a few kB, decodes to 12 MB
    assert len(big) < 100_000
    with pytest.raises(ApiError) as e:
        decode_image(big, "img", 4 * MB)
    assert e.value.status == 413
    with pytest.raises(ApiError) as e:
        decode_image(image_bytes(20, 30, "PNG")[:60], "img", MB)  # truncated
    assert e.value.status == 400 and e.value.param == "img"


@pytest.mark.parametrize("url,ok", [
    ("data:image/png;base64," + base64.b64encode(b"abc").decode(), True),
    ("data:;base64," + base64.b64encode(b"abc").decode(), True),
    ("https://example.com/cat.png", False),
    ("data:image/png," + "abc", False),  # not base64
    ("data:audio/wav;base64,YWJj", False),  # not an image
    ("data:image/png;base64,@@@", False),
])
def test_data_urls(url, ok):
    if ok:
        assert parse_data_url(url, "u", "image")[1] == b"abc"
    else:
        with pytest.raises(ApiError) as e:
            parse_data_url(url, "u", "image")
        assert e.value.status == 400 and e.value.param == "u"


# ---------------------------------------------------------------- stop strings
def test_stop_strings_across_deltas():
    m = StopMatcher(["STOP", "end."])
    out = [m.feed(t) for t in ["Hello ", "wor", "ld S", "TO", "P more"]]
    assert "".join(out) == "Hello world " and m.stopped and m.feed("x") == ""
    m = StopMatcher(["ab"])
    assert m.feed("xa") == "x" and m.feed("c") == "a" and m.flush() == "c" and not m.stopped
    m = StopMatcher(["zz"])
    assert m.feed("abz") == "ab" and m.flush() == "z"
    assert StopMatcher([]).feed("anything") == "anything"


# ----------------------------------------------------------------------- errors
FIELDS = {"prompt": "messages", "speaker": "audio.voice", "max_tokens": "max_completion_tokens",
          "multi_modal_data.image[0]": "messages[0].content[1].image_url",
          "multi_modal_data.audio[0]": "messages[1].content[0].input_audio"}


@pytest.mark.parametrize("err,status,param,code", [
    (ContextLengthError("prompt: 300 tokens + max_tokens 16 = 316 exceed max_model_len 256", stage="thinker",
                        field="prompt", limit=256, actual=316), 400, "messages", "context_length_exceeded"),
    (ContextLengthError("prompt: 20 tokens + max_tokens 500 = 520 exceed max_model_len 256", stage="thinker",
                        field="sampling_params.max_tokens", limit=256, actual=520), 400, "max_completion_tokens",
     "context_length_exceeded"),
    (RequestError("multi_modal_data.audio[0]: 10 samples, at least 400 are needed", stage="thinker",
                  field="multi_modal_data.audio[0]"), 400, "messages[1].content[0].input_audio", "invalid_value"),
    (RequestError("multi_modal_data: stage 'thinker' takes no image inputs", stage="thinker",
                  field="multi_modal_data"), 400, "messages[0].content[1].image_url", "invalid_value"),
    (RequestError("speaker: 'alloy' is not available", stage="talker", field="speaker"), 400, "audio.voice",
     "invalid_value"),
    (RequestError("prompts[0]: prompt.messages[2].content: expected text", field="prompt.messages[2].content"),
     400, "messages[2].content", "invalid_value"),
    (RequestError("sampling_params.stop_token_ids: token id 9 is out of vocabulary", stage="thinker",
                  field="sampling_params.stop_token_ids", limit=9, actual=9), 400, "stop_token_ids", "invalid_value"),
    (RequestError("request_id 'x' is already in use", field="request_id", code="duplicate_request_id"), 400,
     "messages", "duplicate_request_id"),
    (RequestTimeoutError("request 'x' timed out after 1s", limit=1.0), 504, None, "request_timeout"),
    (StageError("stage 'thinker' failed: forward pass failed: RuntimeError: boom", stage="thinker"), 500, None,
     "stage_failed"),
    (RequestAbortedError("the pipeline was closed", code="shutting_down"), 503, None, "shutting_down"),
])
def test_omni_errors_map_by_type_and_code(err, status, param, code):
    """The table maps an error's type and code to the status, its field to the request's: no message is read."""
    api = from_omni_error(err, FIELDS, lambda stage, name: FIELDS.get(name, name))
    assert (api.status, api.param, api.code) == (status, param, code)
    assert err.message in api.message
    assert set(api.body()["error"]) == {"message", "type", "param", "code"}
    renamed = err.replace("something else entirely")  # the wording does not matter
    assert from_omni_error(renamed, FIELDS, lambda stage, name: FIELDS.get(name, name)).param == param


def test_sampling_fields_name_the_request_field_that_set_them():
    err = RequestError("top_p: bad", stage="talker", field="sampling_params.top_p")
    assert from_omni_error(err, FIELDS, lambda stage, name: f"sampling_params_list[1].{name}").param == \
        "sampling_params_list[1].top_p"


def test_the_server_parses_no_messages():
    import omni.serve.http.errors as errors_module

    assert "import re" not in Path(errors_module.__file__).read_text()


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x",
                                                                                        "format": "aiff"}}]}]},
     "messages[0].content[0].input_audio.format"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]},
     "messages[0].content[0].extra"),
    ({"messages": [{"role": "user", "audio": {"id": "audio-1"}, "content": "x"}]}, "messages[0].audio"),
    ({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "audio": {"format": "wav"}}, "audio"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
])
def test_request_errors_name_the_field(body, param):
    import json

    with pytest.raises(ApiError) as e:
        parse_request(ChatCompletionRequest, json.dumps({"model": "m", **body}).encode())
    assert e.value.status == 400 and e.value.param == param, e.value.body()


# ------------------------------------------------- OpenAI fields omni does not implement (issue 23, class 5)
def _openai_fields(module) -> set[str]:
    import typing

    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


def test_every_openai_request_field_is_known():
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat

    from omni.serve.protocol.completions import CompletionRequest

    assert _openai_fields(chat) <= set(ChatCompletionRequest.model_fields)
    assert _openai_fields(completion) <= set(CompletionRequest.model_fields)


CHAT_MIN = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("extra", [
    {"logprobs": False}, {"logprobs": None}, {"tool_choice": None}, {"tool_choice": "none"},
    {"response_format": {"type": "text"}}, {"response_format": None}, {"response_format": {"type": "json_object"}}, {"tools": None}, {"tools": []},
    {"n": None}, {"n": 1}, {"n": 2}, {"stream": None}, {"frequency_penalty": 0}, {"presence_penalty": 0.0},
    {"logit_bias": None}, {"logit_bias": {}}, {"top_logprobs": 0}, {"parallel_tool_calls": True},
    {"store": False}, {"service_tier": "auto"}, {"metadata": {"k": "v"}}, {"prompt_cache_key": "k"},
    {"safety_identifier": "u"}, {"user": None}, {"stop": None}, {"seed": None},
])
def test_null_or_default_openai_fields_are_accepted(extra):
    import json

    parse_request(ChatCompletionRequest, json.dumps({**CHAT_MIN, **extra}).encode())


@pytest.mark.parametrize("extra,param,code", [
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),  # needs logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),  # OpenAI's range: 0..20
    # a forced call cannot be spoken ("auto" can: the reply is voiced once it is no call, reply_stream.Run)
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "modalities": ["text", "audio"],
      "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools to call
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"},
     "tools[0].function.name", "invalid_value"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "invalid_value"),
    ({"logit_bias": {"one": 2}}, "logit_bias.one", "invalid_value"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),  # OpenAI's range: -2..2
    ({"frequency_penalty": False}, "frequency_penalty", "invalid_value"),  # not JSON's 0
    ({"presence_penalty": "high"}, "presence_penalty", "invalid_value"),
    ({"min_p": 1.5}, "min_p", "invalid_value"),
    ({"store": True}, "store", "unsupported_parameter"),
    ({"n": 0}, "n", "invalid_value"),  # OpenAI's range: 1..128
    ({"n": 129}, "n", "invalid_value"),
    ({"logprob": True}, "logprob", "unknown_parameter"),
])
def test_openai_fields_asking_for_a_missing_feature_are_refused_by_name(extra, param, code):
    import json

    with pytest.raises(ApiError) as e:
        parse_request(ChatCompletionRequest, json.dumps({**CHAT_MIN, **extra}).encode())
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.body()


def test_penalties_min_p_and_logit_bias_reach_the_text_stage():
    """OpenAI's presence / frequency penalties and logit bias, and vLLM's min_p are the text stage's sampling (the engine's
    sampler applies them: tests/engine/test_sampler.py, test_engine.py), like the other top-level fields."""
    import json

    from omni.config.loader import load_config
    from omni.sampling_params import SamplingParams
    from omni.serve.settings import ServeSettings
    from omni.serve.state import PipelineInfo
    from omni.serve.chat.jobs import chat_job

    info = PipelineInfo.of(load_config(Path(__file__).resolve().parents[2] / "stage_configs" / "tiny_chain.yaml"))
    body = {**CHAT_MIN, "presence_penalty": -0.5, "frequency_penalty": 1.25, "min_p": 0.05, "temperature": 0.8,
            "logit_bias": {"17": -100, "42": 2.5}}
    job = chat_job(parse_request(ChatCompletionRequest, json.dumps(body).encode()), info, ServeSettings(), "r")
    fields = {"presence_penalty": -0.5, "frequency_penalty": 1.25, "min_p": 0.05, "temperature": 0.8,
              "logit_bias": {17: -100.0, 42: 2.5}}  # OpenAI's keys are JSON strings: token ids here
    assert {k: job.sampling[info.text_stage][k] for k in fields} == fields
    SamplingParams(**job.sampling[info.text_stage])  # what the stage will build: valid
    assert all(k not in job.sampling.get(s, {}) for s in info.stages if s != info.text_stage for k in fields)


@pytest.mark.parametrize("extra,param,code", [
    ({"logprobs": None}, None, None), ({"echo": False}, None, None), ({"best_of": 1}, None, None),
    ({"suffix": None}, None, None), ({"echo": True}, None, None), ({"echo": True, "max_tokens": 0}, None, None),
    ({"best_of": 2}, "best_of", "unsupported_parameter"), ({"suffix": "x"}, "suffix", "unsupported_parameter"),
    ({"echo": True, "stream": True}, None, None), ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"echo": "yes"}, "echo", None),
])
def test_completion_only_openai_fields(extra, param, code):
    import json

    from omni.serve.protocol.completions import CompletionRequest

    body = json.dumps({"model": "m", "prompt": "x", **extra}).encode()
    if param is None:
        parse_request(CompletionRequest, body)
        return
    with pytest.raises(ApiError) as e:
        parse_request(CompletionRequest, body)
    assert e.value.param == param and (code is None or e.value.code == code)


def test_echo_asks_the_text_stage_for_its_decoded_prompt_and_logprobs():
    import json

    from omni.config.loader import load_config
    from omni.sampling_params import SamplingParams
    from omni.serve.protocol.completions import CompletionRequest
    from omni.serve.state import PipelineInfo
    from omni.serve.chat.jobs import completion_job

    info = PipelineInfo.of(load_config(Path(__file__).resolve().parents[2] / "stage_configs" / "tiny_chain.yaml"))

    def job(**extra):
        body = json.dumps({"model": "m", "prompt": "x", **extra}).encode()
        return completion_job(parse_request(CompletionRequest, body), info, "r")

    plain = job(max_tokens=3)
    assert not plain.echo and "echo_prompt" not in plain.sampling[info.text_stage]
    echoed = job(echo=True, max_tokens=3)
    assert echoed.echo and echoed.sampling[info.text_stage]["echo_prompt"] is True
    assert "prompt_logprobs" not in echoed.sampling[info.text_stage]  # no logprobs asked: no recompute
    scoring = job(echo=True, max_tokens=0, logprobs=2)  # lm-evaluation-harness's loglikelihood request
    s = scoring.sampling[info.text_stage]
    assert scoring.echo_only and scoring.echo_logprobs and not scoring.show_prompt_logprobs
    assert (s["max_tokens"], s["prompt_logprobs"], s["logprobs"]) == (1, 2, 2)
    SamplingParams(**s)  # what the stage will build: valid
    both = job(echo=True, logprobs=1, prompt_logprobs=3)
    assert both.show_prompt_logprobs and both.sampling[info.text_stage]["prompt_logprobs"] == 3



def test_a_duplicate_request_id_names_request_id_and_null_speech_formats_are_the_defaults():
    """QA pass: a vLLM request_id already running was a 400 naming `messages`; OpenAI's null for an optional speech
    field (what typed clients send for an unset one) was a 400."""
    import json

    from omni.config.loader import load_config
    from omni.serve.protocol.completions import CompletionRequest
    from omni.serve.settings import ServeSettings
    from omni.serve.protocol.speech import SpeechRequest
    from omni.serve.state import PipelineInfo
    from omni.serve.chat.jobs import chat_job, completion_job

    info = PipelineInfo.of(load_config(Path(__file__).resolve().parents[2] / "stage_configs" / "tiny_chain.yaml"))
    dup = RequestError("request_id 'x' is already in use", field="request_id", code="duplicate_request_id")
    chat = chat_job(parse_request(ChatCompletionRequest, json.dumps({**CHAT_MIN, "request_id": "x"}).encode()), info,
                    ServeSettings(), "chatcmpl-x")
    comp = completion_job(parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": "a", "request_id": "x"})
                                .encode()), info, "cmpl-x")
    for job in (chat, comp):
        err = from_omni_error(dup, job.fields, job.sampling_param)
        assert (err.status, err.param, err.code) == (400, "request_id", "duplicate_request_id")
    body = {"model": "m", "input": "hi", "voice": "Chelsie", "response_format": None, "stream_format": None}
    req = parse_request(SpeechRequest, json.dumps(body).encode())
    assert (req.response_format, req.stream_format) == ("mp3", "audio")


def test_only_typed_request_errors_are_the_callers_fault():
    """A RequestError raised as the pipeline takes a request is a 400 naming its field; any other exception (a
    bare ValueError: a bug, not the request) is not turned into a 400: it reaches the app as itself (a 500, its
    traceback logged by the middleware)."""
    import asyncio

    from omni.messages import StageInput
    from omni.serve.generation.job import Job
    from omni.serve.generation.run import Run

    class Raising:
        def __init__(self, exc: Exception):
            self.exc = exc

        def stream(self, *args, **kwargs):
            async def gen():
                raise self.exc
                yield  # an async generator

            return gen()

    job = Job("r", StageInput("hi"), {}, "thinker", None, "thinker", [], {"max_tokens": "max_tokens"})

    async def start(exc: Exception) -> None:
        await Run(Raising(exc), job, 24000).start()

    with pytest.raises(ApiError) as e:
        asyncio.run(start(RequestError("too many", field="sampling_params.max_tokens", stage="thinker")))
    assert e.value.status == 400 and e.value.param == "max_tokens"
    with pytest.raises(ValueError, match="a shape bug"):
        asyncio.run(start(ValueError("a shape bug")))


def test_speech_on_a_voice_agent_forces_the_llms_reply_and_speaks_an_uploaded_voice():
    """/v1/audio/speech on asr -> llm -> tts: the LLM's reply is forced to `input` (a typed turn: the recognizer
    hears nothing), not the recognizer's transcript, which the LLM would answer; an uploaded voice's clip and
    transcript ride to the speech stage; a thinker pipeline still speaks its talker's voices only."""
    from omni.messages import REFERENCE_AUDIO
    from omni.serve.protocol.speech import SpeechRequest
    from omni.serve.speech.serving import speech_job
    from omni.serve.state import PipelineInfo
    from omni.serve.voices.store import UploadedVoice

    agent = PipelineInfo("agent", ["asr", "llm", "tts", "codec"], "asr", "llm", "codec", voices=("Beckett",),
                         recognizer="asr", clones_voices=True)
    guest = UploadedVoice("guest", np.ones(2400, np.float32), 24000, "my voice", 0, 100)
    req = SpeechRequest(model="agent", input="Water the plants.", voice="guest")
    job = speech_job(req, agent, "s1", guest)
    assert job.sampling == {"llm": {"forced_text": "Water the plants."}} and job.usage_stage == "llm"
    assert job.prompt.prompt[-1] == {"role": "user", "content": "Water the plants."}
    clip = job.prompt.extra[REFERENCE_AUDIO]
    assert clip.data is guest.wave and clip.sampling_rate == 24000 and job.prompt.extra["reference_text"] == "my voice"
    named = speech_job(SpeechRequest(model="agent", input="Hi.", voice="beckett"), agent, "s2")
    assert named.prompt.extra == {"speaker": "beckett"}
    omni = PipelineInfo("m", ["thinker", "talker", "vocoder"], "thinker", "thinker", "vocoder", voices=("Ethan",))
    with pytest.raises(ApiError, match="not a voice of this pipeline"):
        speech_job(req, omni, "s3", guest)  # no stage of it clones voices
