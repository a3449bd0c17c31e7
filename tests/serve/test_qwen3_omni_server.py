"""`omni serve stage_configs/qwen3_omni_tiny.yaml` with the real `openai` client (in this process, local backend):
text and audio out, non-streamed and SSE (the pcm16 chunks are the WAV's samples), image and audio in, an
unknown voice refused naming `audio.voice`; tools, started as vLLM's users start a server for them
(`--enable-auto-tool-choice --tool-call-parser hermes`)."""
from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest

from tests.serve.server_utils import REPO, produced, serve_in_process, wait_idle
from tests.serve.test_omni_server import check_usage_streamed_and_not, png_url, stereo_wav_b64

pytestmark = pytest.mark.timeout(300)
CONFIG = REPO / "stage_configs" / "qwen3_omni_tiny.yaml"
MODEL = "qwen3_omni_tiny"
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
AUDIO_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
PCM_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "pcm16"}}


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CONFIG, "--backend", "local", "--audio-chunk-ms", "20", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_audio_reply_wav_and_streamed_pcm16_agree(server, client):
    assert "ethan" in [v.lower() for v in server.omni.voices()]  # the talker's speakers: the server's voices
    assert server.omni.shows_tools() is True  # its thinker renders Qwen3's function-calling format
    msg = client.chat.completions.create(model=MODEL, messages=HELLO, **AUDIO_OUT).choices[0].message
    assert msg.content and msg.audio.transcript == msg.content
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert samples.size > 0 and np.abs(samples).max() > 0
    text, chunks = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **PCM_OUT):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        if delta.audio is not None:
            chunks.append(np.frombuffer(base64.b64decode(delta.audio.data), "<i2"))
    assert text == msg.content and len(chunks) >= 2
    np.testing.assert_array_equal(np.concatenate(chunks), samples)
    wait_idle(server)


@pytest.mark.slow
def test_usage_counts_the_talkers_codec_tokens_and_a_one_token_reply_is_voiced(server, client):
    """As on Qwen2.5-Omni (test_omni_server.py): usage's audio tokens are the codec tokens the talker generated (one
    per frame, its first codebook: the code predictor's residual codes ride on those positions), non-streamed and in
    the streamed usage chunk; max_completion_tokens 1 with audio out (transformers' generate fails on a one-token
    reply: its talker prompt takes the row of the reply's first token, which exists once a second is sampled) is
    voiced once its text is whole, the thinker's reply forced to that text and eos."""
    full = check_usage_streamed_and_not(server, client, MODEL, AUDIO_OUT, PCM_OUT)

    engine = server.omni._omni._backend.workers["thinker"].engine
    with produced(server, "thinker") as thinker, produced(server, "talker") as talker:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=1, **AUDIO_OUT)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    assert choice.message.audio.transcript == choice.message.content
    with wave.open(io.BytesIO(base64.b64decode(choice.message.audio.data))) as w:
        assert w.getnframes() > 0
    voiced = thinker.pop(next(rid for rid in thinker if rid.endswith("-voice")))
    assert [len(ids) for ids in thinker.values()] == [1]
    forced = engine.tokenizer.encode(choice.message.content, add_special_tokens=False) + [engine.model.eos_token_id]
    assert voiced == forced  # the voicing's thinker reply: the text and eos
    (codes,) = talker.values()
    details = r.usage.completion_tokens_details
    assert (details.text_tokens, details.audio_tokens) == (1, len(codes))
    assert r.usage.completion_tokens == 1 + len(codes)
    wait_idle(server)


def test_image_and_audio_inputs_and_voice_errors(client):
    text_only = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe."}],
                                               max_tokens=4)
    for part, tokens in (({"type": "image_url", "image_url": {"url": png_url()}}, 6),  # 56x84 -> 64x96: 2x3 merged
                         ({"type": "input_audio", "input_audio": {"data": stereo_wav_b64(), "format": "wav"}}, 13)):
        r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            part, {"type": "text", "text": "Describe."}]}], **AUDIO_OUT)
        assert r.choices[0].message.content and r.choices[0].message.audio.data
        # the placeholders (1 s of audio -> 13 encoder rows) + their start/end tokens
        assert r.usage.prompt_tokens == text_only.usage.prompt_tokens + tokens + 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    assert e.value.body["param"] == "audio.voice", e.value.body


@pytest.mark.slow
def test_realtime_spoken_turns_on_qwen3_omni(server):
    """`/v1/realtime` on Qwen3-Omni with the real `openai` client: a spoken turn (recorded human speech) answered
    in speech (pcm16 deltas, their transcript), then a typed turn that hits the thinker's and the talker's prefix
    caches with the whole first turn."""
    import asyncio

    from tests.serve.realtime_utils import pcm16, ran_to_its_end, speech_24k, until

    session = {"type": "realtime", "audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}}}

    async def go():
        conn = await server.async_client().realtime.connect(model=MODEL).enter()
        try:
            await until(conn, "session.created")
            await conn.session.update(session=session)
            await until(conn, "session.updated")
            data = pcm16(speech_24k(2.0))
            for i in range(0, len(data), 4800):
                await conn.input_audio_buffer.append(audio=base64.b64encode(data[i:i + 4800]).decode())
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            seen: list = []
            first = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(first), first.status_details
            chunks = [base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta"]
            assert chunks and all(len(c) % 2 == 0 for c in chunks)
            assert np.abs(np.frombuffer(b"".join(chunks), "<i2")).max() > 0
            assert "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And then?"}]})
            await conn.response.create()
            second = (await until(conn, "response.done")).response
            assert ran_to_its_end(second)
            assert second.usage.input_token_details.cached_tokens >= (first.usage.input_tokens // 16 - 1) * 16 > 0
            # a spoken reply bounded to one token: voiced (its text forced with eos), "incomplete" by its bound
            seen = []
            with produced(server, "talker") as talker:
                await conn.response.create(response={"max_output_tokens": 1})
                short = (await until(conn, "response.done", seen)).response
            assert short.status == "incomplete" and short.status_details.reason == "max_output_tokens"
            assert short.output[0].content[0].transcript and not any(e.type == "error" for e in seen)
            assert any(e.type == "response.output_audio.delta" for e in seen)
            (codes,) = talker.values()
            details = short.usage.output_token_details
            assert (details.text_tokens, details.audio_tokens) == (1, len(codes))
            assert short.usage.output_tokens == 1 + len(codes)
        finally:
            await conn.close()

    asyncio.run(go())
    wait_idle(server)
    assert server.stage_gauges("omni_stage_prefix_cache_hits_total")["talker"] > 0


@pytest.mark.slow
def test_speech_endpoint_on_qwen3_omni(server, client):
    """`/v1/audio/speech` on Qwen3-Omni: the thinker forced to the input, the talker and code2wav voice it; the
    streamed pcm is the WAV's samples (greedy stages: the same speech again)."""
    text = "Good morning, this is a test."
    wav = client.audio.speech.create(model=MODEL, input=text, voice="Ethan", response_format="wav").content
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert samples.size > 0 and np.abs(samples).max() > 0
    with client.audio.speech.with_streaming_response.create(model=MODEL, input=text, voice="Ethan",
                                                            response_format="pcm") as resp:
        pcm = b"".join(resp.iter_bytes())
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), samples)
    thinker = server.omni._omni._backend.workers["thinker"].engine
    seen = []
    real = thinker.add_request

    def spy(inp):
        seen.append(inp.sampling_params)
        return real(inp)

    thinker.add_request = spy
    try:
        client.audio.speech.create(model=MODEL, input=text, voice="Ethan", response_format="wav")
    finally:
        del thinker.add_request
    assert [p.forced_text for p in seen] == [text]  # the thinker's reply is exactly the input
    wait_idle(server)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
ASK = {"role": "user", "content": "What is the weather in Paris for two days?"}
CALL_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def _prompt_tokens(server, messages, tools) -> int:
    """What the thinker's prompt is when it shows the model the tools (qwen3_omni_inputs.render_chatml)."""
    from stages.qwen3_omni.inputs import render_chatml

    thinker = server.omni._omni._backend.workers["thinker"].engine.model
    return len(thinker.tokenizer(render_chatml(messages, thinker.system_prompt, tools))["input_ids"])


@pytest.mark.slow
def test_tools_reach_the_thinker_and_its_calls_come_back(server, client):
    """The Qwen3-Omni thinker shows the model the tools (Qwen3's format) and the earlier calls and results; a
    Hermes call in its reply (forced here: the random model says what it is told) comes back as tool_calls,
    streamed or not, and a named `tool_choice` makes it produce a valid call by itself."""
    import json

    told = {"sampling_params_list": [{"forced_text": CALL_REPLY}, {}, {}]}
    got = client.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], max_tokens=60, extra_body=told)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert got.usage.prompt_tokens == _prompt_tokens(server, [ASK], [WEATHER])
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER],
                                                          max_tokens=60, extra_body=told, stream=True) if c.choices]
    calls = [tc for c in streamed for tc in c.choices[0].delta.tool_calls or []]
    assert [tc.function.name for tc in calls] == ["get_weather"] and streamed[-1].choices[0].finish_reason == "tool_calls"

    # the next turn: the call and its result are in the prompt, as the template writes them
    turn2 = [ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    reply = client.chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER], max_tokens=4,
                                           tool_choice="none")
    as_template = [ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris",
                                                                                              "days": 2}}}]},
        turn2[2]]
    assert reply.usage.prompt_tokens == _prompt_tokens(server, as_template, [WEATHER])

    forced = client.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], max_tokens=80,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced.choices[0].message.tool_calls, forced
    [call] = forced.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"} and isinstance(args["days"], int)
    # a reply that must be a call cannot be spoken (a call has no speech): refused naming the field
    got, _, err = server.post("/v1/chat/completions", {"model": MODEL, "messages": [ASK], "tools": [WEATHER],
                                                        "tool_choice": "required", **AUDIO_OUT})
    assert got == 400 and err["error"]["param"] == "tool_choice", err
    wait_idle(server)


def test_transcriptions_on_qwen3_omni(server, client):
    """/v1/audio/transcriptions on Qwen3-Omni: its thinker writes down a real recorded clip, as it answers the same
    speech-recognition prompt through chat completions."""
    from omni.serve.generation.asr_job import ASR_SYSTEM, instruction, max_tokens_for
    from tests.serve.test_omni_server import _speech_wav

    data = _speech_wav(1.0)
    got = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data))
    want = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens_for(1.0), messages=[
        {"role": "system", "content": ASR_SYSTEM},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(),
                                                                             "format": "wav"}},
                                     {"type": "text", "text": instruction("transcribe", None, None)}]}])
    assert got.text and got.text == want.choices[0].message.content
    wait_idle(server)


def test_a_spoken_reply_with_tools_is_voiced_once_it_is_no_call(server, client):
    """tool_choice "auto" with audio out: the reply is decided in text first; a call comes back as tool_calls with
    no audio (a call has no speech), a text reply is voiced, its audio exactly that of the same prompt with the
    same reply spoken in one go (tool_choice "none"), streamed too (the text, then the audio)."""
    text_reply = {"sampling_params_list": [{"forced_text": "It will be sunny in Paris."}, {}, {}]}
    call = client.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], max_tokens=60,
                                          extra_body={"sampling_params_list": [{"forced_text": CALL_REPLY}, {}, {}]},
                                          **AUDIO_OUT)
    assert call.choices[0].finish_reason == "tool_calls" and call.choices[0].message.audio is None
    assert call.choices[0].message.tool_calls[0].function.name == "get_weather"
    spoken = client.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], max_tokens=60,
                                            extra_body=text_reply, **AUDIO_OUT).choices[0]
    at_once = client.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], tool_choice="none",
                                             max_tokens=60, extra_body=text_reply, **AUDIO_OUT).choices[0]
    assert spoken.finish_reason == "stop" and spoken.message.content == at_once.message.content
    assert spoken.message.tool_calls is None and spoken.message.audio.transcript == spoken.message.content
    assert base64.b64decode(spoken.message.audio.data) == base64.b64decode(at_once.message.audio.data)
    with wave.open(io.BytesIO(base64.b64decode(spoken.message.audio.data))) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert samples.size > 0
    text, pcm, order = "", [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], max_tokens=60,
                                                extra_body=text_reply, stream=True, **PCM_OUT):
        delta = chunk.choices[0].delta
        if delta.content:
            text += delta.content
            order.append("text")
        if delta.audio is not None and delta.audio.data:
            pcm.append(np.frombuffer(base64.b64decode(delta.audio.data), "<i2"))
            order.append("audio")
    assert text == spoken.message.content and order.index("audio") > max(i for i, k in enumerate(order) if k == "text")
    np.testing.assert_array_equal(np.concatenate(pcm), samples)
    wait_idle(server)


@pytest.mark.slow
def test_realtime_forced_tool_choice_on_qwen3_omni(server):
    """A forced tool_choice in a realtime session (a named function, then "required"): the reply is constrained to a
    call, so even the random thinker makes a valid one, and it comes as function_call items only (no message item,
    no audio); a reply cut short by max_output_tokens is no call and comes as the message's text, incomplete JSON."""
    import asyncio
    import json

    from tests.serve.realtime_utils import ran_to_its_end, until

    # bounded values: the random model fills an open integer until max_output_tokens
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}}
    other = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}
    thinker = server.omni._omni._backend.workers["thinker"].engine
    real, grammars = thinker.add_request, []
    calls = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": ' \
            '{"city": "Oslo", "days": 1}}]'

    def spy(inp):
        grammars.append(inp.sampling_params.structured_outputs["json"])
        inp.sampling_params = inp.sampling_params.model_copy(update={"structured_outputs": None,
                                                                     "forced_text": calls})
        return real(inp)

    async def go():
        conn = await server.async_client().realtime.connect(model=MODEL).enter()
        try:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "tools": [tool, other], "tool_choice": {
                "type": "function", "name": "get_weather"}, "audio": {"input": {"turn_detection": None}}})
            updated = (await until(conn, "session.updated")).session
            assert updated.tool_choice.name == "get_weather"
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": ASK["content"]}]})
            await conn.response.create(response={"max_output_tokens": 80})
            seen: list = []
            named = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(named), named.status_details
            [call] = named.output
            args = json.loads(call.arguments)
            assert call.type == "function_call" and call.name == "get_weather" and set(args) == {"city", "days"}
            assert not any(e.type.startswith(("response.output_audio", "response.content_part")) for e in seen)
            done = next(e for e in seen if e.type == "response.function_call_arguments.done")
            assert (done.call_id, done.arguments) == (call.call_id, call.arguments)

            # "required": the reply is a list of calls of any tools; the random thinker never closes the list, so
            # it is told the reply, in place of the grammar it was sent (which is checked)
            thinker.add_request = spy
            await conn.response.create(response={"tool_choice": "required"})
            required = (await until(conn, "response.done")).response
            del thinker.add_request
            assert ran_to_its_end(required), required.status_details
            assert [(o.type, o.name, json.loads(o.arguments)) for o in required.output] == [
                ("function_call", "get_time", {"zone": "CET"}), ("function_call", "get_weather", {"city": "Oslo",
                                                                                                   "days": 1})]
            assert len({o.call_id for o in required.output}) == 2
            [schema] = grammars
            assert schema["type"] == "array" and schema["minItems"] == 1
            assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["get_weather"],
                                                                                            ["get_time"]]

            await conn.response.create(response={"max_output_tokens": 3})  # too short for a whole call
            seen = []
            cut = (await until(conn, "response.done", seen)).response
            assert [o.type for o in cut.output] == ["message"] and cut.status == "incomplete"
            assert cut.status_details.reason == "max_output_tokens" and cut.output[0].status == "incomplete"
            text = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
            assert text and cut.output[0].content[0].transcript == text and cut.usage.output_tokens == 3
            with pytest.raises(ValueError):
                json.loads(text)
            await conn.session.update(session={"type": "realtime", "tool_choice": {"type": "function",
                                                                                   "name": "nope"}})
            err = await until(conn, "error")
            assert err.error.param == "session.tool_choice.name"
        finally:
            await conn.close()

    try:
        asyncio.run(go())
    finally:
        thinker.__dict__.pop("add_request", None)
    wait_idle(server)


def test_realtime_function_calls_on_qwen3_omni(server):
    """Realtime function calling (session.tools, as a voice agent uses it): a reply holding a Hermes call (the
    random thinker says what it is told) streams its text up to the call, then the call comes as a function_call
    item (response.function_call_arguments.*), unspoken; the client's function_call_output item goes into the next
    turn's prompt with the call (Qwen3's format), and that reply is spoken, on the prefix caches."""
    import asyncio
    import json

    from omni.sampling_params import SamplingParams
    from tests.serve.realtime_utils import ran_to_its_end, until

    tool = {"type": "function", "name": "get_weather", "description": "The forecast.",
            "parameters": WEATHER["function"]["parameters"]}
    answer = "It will be sunny in Paris."
    told = [CALL_REPLY, answer]  # the thinker's replies, in order
    prompts: list = []
    thinker = server.omni._omni._backend.workers["thinker"].engine
    real = thinker.add_request

    def spy(inp):
        if inp.tools and not (inp.sampling_params is not None and inp.sampling_params.forced_text):
            prompts.append(inp.prompt)
            params = inp.sampling_params or SamplingParams()
            inp.sampling_params = params.model_copy(update={"forced_text": told.pop(0)})
        return real(inp)

    async def go():
        conn = await server.async_client().realtime.connect(model=MODEL).enter()
        try:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "tools": [tool], "audio": {
                "input": {"turn_detection": None}, "output": {"voice": "Ethan"}}})
            updated = await until(conn, "session.updated")
            assert [t.name for t in updated.session.tools] == ["get_weather"]
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": ASK["content"]}]})
            await conn.response.create()
            seen: list = []
            first = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(first), first.status_details
            assert [o.type for o in first.output] == ["message", "function_call"]
            # each output item is done before the next is added (the message once held its done events to the end)
            items = [(e.type.rsplit(".", 1)[-1], e.output_index) for e in seen
                     if e.type in ("response.output_item.added", "response.output_item.done")]
            assert items == [("added", 0), ("done", 0), ("added", 1), ("done", 1)], items
            text = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
            assert text == "Checking.\n" == first.output[0].content[0].transcript  # no call markup
            assert not any(e.type == "response.output_audio.delta" for e in seen)  # a call has no speech
            done = next(e for e in seen if e.type == "response.function_call_arguments.done")
            call = first.output[1]
            assert (done.name, done.call_id, done.item_id) == ("get_weather", call.call_id, call.id)
            assert json.loads(done.arguments) == {"city": "Paris", "days": 2} == json.loads(call.arguments)
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": "Sunny, 21 C"})
            await until(conn, "conversation.item.done")
            await conn.response.create()
            seen = []
            second = (await until(conn, "response.done", seen)).response
            assert ran_to_its_end(second) and [o.type for o in second.output] == ["message"]
            assert second.output[0].content[0].transcript == answer
            audio = b"".join(base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta")
            assert audio and np.abs(np.frombuffer(audio, "<i2")).max() > 0
            assert second.usage.input_token_details.cached_tokens > 0
        finally:
            await conn.close()

    thinker.add_request = spy
    try:
        asyncio.run(go())
    finally:
        del thinker.add_request
    assert not told
    turn2 = prompts[1]
    assert turn2[-2] == {"role": "assistant", "content": "Checking.\n", "tool_calls": [
        {"id": turn2[-2]["tool_calls"][0]["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
    assert turn2[-1] == {"role": "tool", "tool_call_id": turn2[-2]["tool_calls"][0]["id"], "content": "Sunny, 21 C"}
    wait_idle(server)


def _video_url(name: str) -> str:
    data = (REPO / "tests" / "data" / "video" / f"{name}.mp4").read_bytes()
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def test_video_url_with_and_without_its_audio_track(client):
    """vLLM-Omni's Qwen3 query: a video_url part and mm_processor_kwargs.use_audio_in_video at the request's top
    level. The prompt holds the video's placeholders (2 temporal patches of 20x28 patches: 280 rows) and, with its
    track, the track's too (2.8 s: 36 rows) between the audio start/end tokens; the talker voices a video, and refuses
    one with its track naming the setting (transformers' talker cannot place it)."""
    question = {"type": "text", "text": "What happens here?"}
    text_only = client.chat.completions.create(model=MODEL, max_tokens=2,
                                               messages=[{"role": "user", "content": [question]}])
    part = {"type": "video_url", "video_url": {"url": _video_url("talk")}}
    messages = [{"role": "user", "content": [part, question]}]
    plain = client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
    heard = client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages,
                                           extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}})
    assert plain.usage.prompt_tokens == text_only.usage.prompt_tokens + 280 + 2
    assert heard.usage.prompt_tokens == text_only.usage.prompt_tokens + 280 + 36 + 4
    voiced = client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages, **AUDIO_OUT)
    assert voiced.choices[0].message.audio.data
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages, **AUDIO_OUT,
                                       extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}})
    assert e.value.body["param"] == "mm_processor_kwargs.use_audio_in_video", e.value.body


@pytest.mark.parametrize("body,param,words", [
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]}]},
     "messages[0].content[0].video_url.url", "only data: URLs"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()}}]}]},
     "messages[0].content[0].video_url", "not a readable video file"),
    ({"messages": HELLO, "mm_processor_kwargs": {"num_frames": 8}}, "mm_processor_kwargs.num_frames",
     "not a setting"),
    ({"messages": HELLO, "mm_processor_kwargs": {"use_audio_in_video": "yes"}},
     "mm_processor_kwargs.use_audio_in_video", "expected true or false"),
])
def test_bad_video_requests_name_the_field(server, body, param, words):
    got, _, err = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert got == 400 and err["error"]["param"] == param and words in err["error"]["message"], err
