"""`omni serve` on the tiny Qwen2.5-Omni (thinker -> talker -> token2wav): audio out, images and audio in,
with the real `openai` client against a live server in this process (`serve_in_process`; streamed audio
cut into 5 ms pcm16 chunks)."""
from __future__ import annotations

import base64
import io
import subprocess
import sys
import wave

import numpy as np
import openai
import pytest
from PIL import Image

from tests.serve.server_utils import OMNI, REPO, produced, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "qwen2_5_omni_tiny"
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
AUDIO_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"}}
PCM_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"}}


@pytest.fixture(scope="module")
def server():
    with serve_in_process(OMNI, "--backend", "local", "--audio-chunk-ms", "5") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), "<i2"), w.getframerate()


def test_audio_reply_wav_and_streamed_pcm16_agree(server, client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, **AUDIO_OUT)
    msg = full.choices[0].message
    assert msg.content and msg.audio.transcript == msg.content and msg.audio.id.startswith("audio-")
    samples, rate = wav_samples(base64.b64decode(msg.audio.data))
    assert rate == 24000 and samples.size > 0 and np.abs(samples).max() > 0

    text, transcript, chunks, ids = "", "", [], set()
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **PCM_OUT):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        if delta.audio is not None:
            ids.add(delta.audio.id)
            transcript += getattr(delta.audio, "transcript", None) or ""  # as OpenAI streams an audio reply's text
            if getattr(delta.audio, "data", None):
                chunks.append(np.frombuffer(base64.b64decode(delta.audio.data), "<i2"))
    assert text == msg.content and transcript == msg.content and len(ids) == 1
    assert len(chunks) >= 2 and all(c.size <= 120 for c in chunks)  # 5 ms at 24 kHz
    # Both replies come from the same streamed run (a non-streamed reply collects the same audio events),
    # so the pcm16 chunks concatenate to exactly the WAV's samples, one-shot or codec-chunked token2wav alike.
    np.testing.assert_array_equal(np.concatenate(chunks), samples)

    pcm = client.chat.completions.create(model=MODEL, messages=HELLO, **PCM_OUT).choices[0].message.audio
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(pcm.data), "<i2"), samples)
    wait_idle(server)


def test_a_stop_string_ends_a_spoken_reply_where_its_text_ends(server, client):
    """`stop` with audio out: the thinker itself stops at the string (SamplingParams.stop), so the talker voices the
    text up to there; the reply's text ends before the string, streamed or not, finish_reason stop."""
    free = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, **AUDIO_OUT)
    text = free.choices[0].message.audio.transcript
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text[: text.find(stop)]
    got = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, stop=[stop], **AUDIO_OUT)
    msg = got.choices[0]
    assert msg.message.audio.transcript == msg.message.content == cut and msg.finish_reason == "stop"
    assert msg.message.audio.data
    assert (got.usage.completion_tokens_details.text_tokens
            < free.usage.completion_tokens_details.text_tokens)
    streamed, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, stop=[stop], stream=True,
                                                **PCM_OUT):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert streamed == cut and finish == "stop"
    wait_idle(server)


def test_a_spoken_reply_that_ends_after_one_token_is_voiced_whole(server, client):
    """A thinker reply of one token (a stop string inside it, eos first) cannot be voiced as it comes (the talker
    voices each token from the next one's row): it was a 500. Its text is voiced once whole, by a second pass, as a
    max_tokens 1 reply is; an empty one has no audio; streamed too."""
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, logprobs=True,
                                           top_logprobs=0).choices[0].logprobs.content[0].token
    assert len(first) >= 2, first  # (the tiny checkpoint's greedy reply starts with a 2-character token)
    one = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stop=[first[1:]], **AUDIO_OUT)
    msg = one.choices[0].message
    assert (msg.content, msg.audio.transcript, one.choices[0].finish_reason) == (first[:1], first[:1], "stop")
    samples, _ = wav_samples(base64.b64decode(msg.audio.data))
    assert samples.size > 0 and one.usage.completion_tokens_details.audio_tokens > 0
    eos = server.omni._omni._backend.workers["thinker"].engine.model.eos_token_id
    empty = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, logit_bias={str(eos): 100},
                                           **AUDIO_OUT)
    assert empty.choices[0].message.content == "" and empty.choices[0].finish_reason == "stop"
    assert wav_samples(base64.b64decode(empty.choices[0].message.audio.data))[0].size == 0
    text, audio = "", 0
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stop=[first[1:]],
                                                stream=True, **PCM_OUT):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].delta.audio is not None and getattr(chunk.choices[0].delta.audio, "data", None):
                audio += len(base64.b64decode(chunk.choices[0].delta.audio.data))
    assert text == first[:1] and audio > 0
    wait_idle(server)


def test_a_spoken_reply_continues_the_conversation_by_id_or_as_sent_back(server, client):
    """OpenAI's multi-turn voice pattern: the next turn names the reply by `audio.id` (streamed or not), or sends the
    client's message object back whole; either way the thinker sees the reply's text, exactly as when the client
    sends that text as the content (same prompt: same tokens, all but the new turn cached). An id this server does
    not keep is a 400 naming it; `audio` on a user message is refused."""
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **AUDIO_OUT).choices[0].message
    streamed_id = None
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True, **PCM_OUT):
        if chunk.choices and chunk.choices[0].delta.audio is not None:
            streamed_id = chunk.choices[0].delta.audio.id
    more = {"role": "user", "content": "More"}

    def usage_of(assistant: dict):
        return client.chat.completions.create(model=MODEL, messages=[*HELLO, assistant, more], max_tokens=2).usage

    as_text = usage_of({"role": "assistant", "content": first.audio.transcript})
    by_id = usage_of({"role": "assistant", "audio": {"id": first.audio.id}})
    sent_back = usage_of(first.model_dump(exclude_none=False))
    by_streamed_id = usage_of({"role": "assistant", "audio": {"id": streamed_id}})
    assert by_id.prompt_tokens == sent_back.prompt_tokens == by_streamed_id.prompt_tokens == as_text.prompt_tokens
    assert by_id.prompt_tokens_details.cached_tokens > 0
    for bad, param in (({"role": "assistant", "audio": {"id": "audio-unknown"}}, "messages[1].audio.id"),
                       ({"role": "user", "audio": {"id": first.audio.id}, "content": "x"}, "messages[1].audio")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[*HELLO, bad, more], max_tokens=2)
        assert e.value.body["param"] == param, e.value.body
    wait_idle(server)


def test_audio_reply_in_each_of_openais_chat_formats(server, client):
    """audio.format takes OpenAI's chat formats: flac decodes to exactly the WAV's samples (the same greedy reply),
    mp3 and opus to audio of the same length give or take the codec's padding; aac has no encoder: a 400."""
    import soundfile as sf

    def reply(fmt: str) -> bytes:
        msg = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text", "audio"],
                                             audio={"voice": "Chelsie", "format": fmt}).choices[0].message
        return base64.b64decode(msg.audio.data)

    ref, rate = wav_samples(reply("wav"))
    flac, flac_rate = sf.read(io.BytesIO(reply("flac")), dtype="int16")
    assert flac_rate == rate and ref.size > 0
    np.testing.assert_array_equal(flac, ref)
    for fmt, head in (("mp3", (b"ID3", b"\xff")), ("opus", (b"OggS",))):
        data = reply(fmt)
        assert data.startswith(head), (fmt, data[:8])
        x, r = sf.read(io.BytesIO(data), dtype="float32")
        assert abs(x.size / r - ref.size / rate) < 0.1 and np.abs(x).max() > 0, (fmt, x.size, r)
    with pytest.raises(openai.BadRequestError) as e:
        reply("aac")
    assert e.value.body["param"] == "audio.format" and "flac" in e.value.body["message"], e.value.body


@pytest.mark.slow
def test_n_audio_replies(server, client):
    """n=2 with audio: each choice speaks its own text (its own audio id); greedy choices say the same, with the
    same waveform as the n=1 reply; streamed, each choice's pcm16 chunks add up to that waveform."""
    one = client.chat.completions.create(model=MODEL, messages=HELLO, **AUDIO_OUT).choices[0].message
    two = client.chat.completions.create(model=MODEL, messages=HELLO, n=2, **AUDIO_OUT)
    assert [c.index for c in two.choices] == [0, 1]
    ref, _ = wav_samples(base64.b64decode(one.audio.data))
    for c in two.choices:
        assert c.message.content == one.content and c.message.audio.transcript == one.content
        np.testing.assert_array_equal(wav_samples(base64.b64decode(c.message.audio.data))[0], ref)
    assert two.choices[0].message.audio.id != two.choices[1].message.audio.id
    chunks: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, n=2, stream=True, **PCM_OUT):
        for c in chunk.choices:
            if c.delta.audio is not None and getattr(c.delta.audio, "data", None):
                chunks[c.index].append(np.frombuffer(base64.b64decode(c.delta.audio.data), "<i2"))
    for index in (0, 1):
        np.testing.assert_array_equal(np.concatenate(chunks[index]), ref)
    wait_idle(server)


def test_text_only_reply_skips_the_audio_stages(server, client):
    """A text-only reply runs the thinker alone: the talker and token2wav never get it (a one-token reply, which the
    talker cannot voice, once failed the request on Ray, where the talker got the thinker's chunk before the
    abort). The same for a batch of one-token completions, lm-evaluation-harness style."""
    submitted = lambda: {n: s["orchestrator"]["submitted"]  # noqa: E731
                         for n, s in server.omni._omni.stats()["stages"].items()}
    before = submitted()
    r = client.chat.completions.create(model=MODEL, messages=HELLO)
    assert r.choices[0].message.content and r.choices[0].message.audio is None
    one = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    batch = client.completions.create(model=MODEL, prompt=["A", "B", "C"], max_tokens=1)
    assert len(batch.choices) == 3
    after = submitted()
    assert after["thinker"] - before["thinker"] == 5
    assert after["talker"] == before["talker"] and after["token2wav"] == before["token2wav"]
    m = server.metrics()
    assert m.get(("omni_time_to_first_token_seconds_count", (("stage", "thinker"),)), 0) >= 1
    wait_idle(server)


def check_spoken_usage(usage, thinker: dict[str, list[int]], talker: dict[str, list[int]]) -> None:
    """OpenAI's usage of a spoken reply: completion_tokens = the text's tokens + the audio's, the audio's being the
    codec tokens the talker generated (`thinker` / `talker`: what each stage generated, `server_utils.produced`)."""
    (text,), (codes,) = thinker.values(), talker.values()
    details = usage.completion_tokens_details
    assert (details.text_tokens, details.audio_tokens) == (len(text), len(codes)) and len(codes) > 0
    assert usage.completion_tokens == len(text) + len(codes)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def check_usage_streamed_and_not(server, client, model: str, wav_out: dict, pcm_out: dict):
    """check_spoken_usage on a reply non-streamed and on the streamed usage chunk (stream_options.include_usage);
    returns the non-streamed completion."""
    with produced(server, "thinker") as thinker, produced(server, "talker") as talker:
        full = client.chat.completions.create(model=model, messages=HELLO, **wav_out)
    check_spoken_usage(full.usage, thinker, talker)
    with produced(server, "thinker") as thinker, produced(server, "talker") as talker:
        chunks = list(client.chat.completions.create(model=model, messages=HELLO, stream=True,
                                                     stream_options={"include_usage": True}, **pcm_out))
    check_spoken_usage(chunks[-1].usage, thinker, talker)
    return full


def test_usage_counts_the_talkers_codec_tokens_as_audio_tokens(server, client):
    """Non-streamed, and in the streamed usage chunk (stream_options.include_usage); a text-only reply has none."""
    full = check_usage_streamed_and_not(server, client, MODEL, AUDIO_OUT, PCM_OUT)
    text = client.chat.completions.create(model=MODEL, messages=HELLO)
    assert text.usage.completion_tokens == full.usage.completion_tokens_details.text_tokens  # greedy: the same text
    wait_idle(server)


def test_a_one_token_spoken_reply_is_voiced(server, client):
    """max_completion_tokens 1 with audio out: the talker voices a thinker reply from the thinker's rows of its
    tokens, and the token sampled last has none (transformers' generate fails on a one-token reply too), so the
    reply's text is voiced once it is whole: the thinker's reply forced to that text and eos. The reply is cut by
    its bound ("length"), speaks, and its usage counts its one text token and the voicing's codec tokens."""
    tokenizer = server.omni._omni._backend.workers["thinker"].engine.tokenizer
    eos = server.omni._omni._backend.workers["thinker"].engine.model.eos_token_id
    with produced(server, "thinker") as thinker, produced(server, "talker") as talker:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=1, **AUDIO_OUT)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    assert choice.message.audio.transcript == choice.message.content
    samples, _ = wav_samples(base64.b64decode(choice.message.audio.data))
    assert samples.size > 0
    (reply,) = [ids for rid, ids in thinker.items() if not rid.endswith("-voice")]
    assert len(reply) == 1  # the bound reached the thinker
    voiced = thinker[next(rid for rid in thinker if rid.endswith("-voice"))]
    assert voiced == tokenizer.encode(choice.message.content, add_special_tokens=False) + [eos]
    (codes,) = talker.values()
    details = r.usage.completion_tokens_details
    assert (details.text_tokens, details.audio_tokens) == (1, len(codes))
    assert r.usage.completion_tokens == 1 + len(codes)
    # streamed: the text (also the audio's transcript, as OpenAI streams an audio reply's text), then its audio
    text, transcript, pcm = "", "", b""
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=1, stream=True,
                                                **PCM_OUT):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        if delta.audio is not None:
            transcript += getattr(delta.audio, "transcript", None) or ""
            pcm += base64.b64decode(getattr(delta.audio, "data", None) or "")
    assert text == transcript == choice.message.content
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), samples)
    wait_idle(server)


def test_completions_echo_shows_the_prompt_the_thinker_saw(client):
    """The omni thinker wraps a raw completions prompt in its chat template: echo returns that prompt, decoded, the
    same text its logprobs' tokens spell (not the raw string alone)."""
    r = client.completions.create(model=MODEL, prompt="Hello there", echo=True, max_tokens=0, logprobs=0)
    c = r.choices[0]
    assert "Hello there" in c.text and c.text == "".join(c.logprobs.tokens)
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens > 3 and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])


def test_tools_on_the_omni_thinker_are_refused_by_name(server):
    """The Qwen2.5-Omni thinker renders its own prompt (no tools in it): tools are refused, never dropped."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    got, _, err = server.post("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2,
                                                        "tools": [tool], "tool_choice": "none"})
    assert got == 400 and err["error"]["param"] == "tools" and "thinker" in err["error"]["message"], err


def png_url(seed: int = 0) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def stereo_wav_b64(rate: int = 44100, seconds: float = 1.0) -> str:
    t = np.arange(int(rate * seconds)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.stack([tone, tone], axis=1).tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def test_image_and_audio_inputs(client):
    text_only = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe."}],
                                               max_tokens=4)
    r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url()}},
        {"type": "input_audio", "input_audio": {"data": stereo_wav_b64(), "format": "wav"}},
        {"type": "text", "text": "Describe."}]}])
    assert r.choices[0].message.content
    # 56x84 image -> 6 tokens (2x3 merged patches); 1 s of audio at 16 kHz -> 25 tokens; + 2 x (bos, eos)
    assert r.usage.prompt_tokens == text_only.usage.prompt_tokens + 6 + 25 + 4
    assert r.usage.prompt_tokens_details.audio_tokens == 25 and text_only.usage.prompt_tokens_details.audio_tokens == 0
    again = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url(1)}}, {"type": "text", "text": "Describe."}]}])
    assert again.usage.prompt_tokens == text_only.usage.prompt_tokens + 6 + 2


def test_audio_longer_than_the_encoder_takes_names_its_part(client):
    """31 s of audio in one content part: the thinker's encoder takes 30 s; a 400 naming that part, streamed too
    (the param was null: the stage raised a plain ValueError)."""
    long_clip = {"type": "input_audio", "input_audio": {"data": stereo_wav_b64(16000, 31.0), "format": "wav"}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            r = client.chat.completions.create(model=MODEL, max_tokens=4, stream=stream, messages=[
                {"role": "user", "content": [{"type": "text", "text": "Listen."}, long_clip]}])
            list(r) if stream else None
        err = e.value.body
        assert err["param"] == "messages[0].content[1].input_audio" and "30 s" in err["message"], err


@pytest.mark.parametrize("kw,param", [
    (dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), "audio.voice"),
    (dict(stream=True, **AUDIO_OUT), "audio.format"),
    (dict(audio={"voice": "Chelsie", "format": "wav"}), "audio"),
    # streamed: refused before the stream starts (it once sent the thinker's text, then an error event)
    (dict(stream=True, modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"}), "audio.voice"),
])
def test_audio_option_errors(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, **kw)
        list(r) if kw.get("stream") else None
    assert e.value.body["param"] == param, e.value.body


def test_the_pipeline_names_its_voices_and_matches_them_in_any_case(server, client):
    """The talker's speakers are the server's voices (checked at the edge); "chelsie" is Chelsie, as Qwen3-Omni's
    talker matches its speakers."""
    assert server.omni.voices() == ("Chelsie", "Ethan")
    msgs = [client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text", "audio"],
                                           audio={"voice": voice, "format": "wav"}).choices[0].message
            for voice in ("Chelsie", "chelsie")]
    assert msgs[0].audio.data == msgs[1].audio.data
    by_id = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text", "audio"],
                                           audio={"voice": {"id": "Chelsie"}, "format": "wav"}).choices[0].message
    assert by_id.audio.data == msgs[0].audio.data  # OpenAI's {"id": voice}, as the speech endpoint takes it
    for voice, param in (({"id": "alloy"}, "audio.voice.id"), ({"name": "x"}, "audio.voice"), ("", "audio.voice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text", "audio"],
                                           audio={"voice": voice, "format": "wav"})
        assert e.value.body["param"] == param, (voice, e.value.body)
    got, _, err = server.post("/v1/audio/speech", {"model": MODEL, "input": "Hi.", "voice": {"id": "alloy"}})
    assert got == 400 and err["error"]["param"] == "voice.id" and "Chelsie" in err["error"]["message"], err


@pytest.mark.slow
def test_chat_client_example(server, tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "chat_client.py"), "--base-url", server.v1,
                          "--turn", "Hello, who are you?", "--turn", "Tell me more.", "--max-tokens", "8",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    for n in (1, 2):
        samples, rate = wav_samples((tmp_path / f"turn-{n}.wav").read_bytes())
        assert rate == 24000 and samples.size > 0
    lines = [ln for ln in out.stdout.splitlines() if "cached_tokens=" in ln]
    assert len(lines) == 2
    cached = [int(ln.split("cached_tokens=")[1].split()[0]) for ln in lines]
    assert cached[1] > 0, out.stdout  # turn 2 reuses the conversation so far


def _speech_wav(seconds: float = 2.0) -> bytes:
    """The first seconds of Moonshine's recorded speech (not the model's), as a 16-bit WAV file."""
    import soundfile as sf

    from tests.serve.realtime_utils import speech_wav

    x, rate = sf.read(str(speech_wav()), dtype="int16")
    buf = io.BytesIO()
    sf.write(buf, x[int(0.5 * rate): int((0.5 + seconds) * rate)], rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _asr_by_chat(client, data: bytes, task: str, language: str | None) -> tuple[str, int]:
    """The thinker's greedy reply to the speech-recognition prompt on the same file, through chat completions."""
    import soundfile as sf

    from omni.serve.generation.asr_job import ASR_SYSTEM, instruction, max_tokens_for

    seconds = sf.info(io.BytesIO(data)).duration
    got = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens_for(seconds), messages=[
        {"role": "system", "content": ASR_SYSTEM},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(),
                                                                             "format": "wav"}},
                                     {"type": "text", "text": instruction(task, language, None)}]}])
    return got.choices[0].message.content, got.usage.completion_tokens


@pytest.mark.slow
def test_transcriptions_and_translations_with_the_openai_client(server, client):
    """`/v1/audio/transcriptions` and `/translations`: the pipeline's thinker writes down (or translates) a real
    recorded clip; the text is exactly its greedy reply to the speech-recognition prompt on the same samples (asked
    through chat completions), as json, as text and streamed (deltas that add up to the done event's text)."""
    data = _speech_wav()
    want, tokens = _asr_by_chat(client, data, "transcribe", "en")
    got = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en")
    assert got.text == want and got.usage.output_tokens == tokens and got.usage.input_tokens > 30
    details = got.usage.input_token_details  # 2 s of audio: 50 placeholder tokens; the rest is the instruction
    assert (details.audio_tokens, details.text_tokens) == (50, got.usage.input_tokens - 50)
    as_text = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en",
                                                 response_format="text")
    assert as_text == want
    events = list(client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en",
                                                     stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == events[-1].text == want
    translated = client.audio.translations.create(model=MODEL, file=("clip.wav", data))
    assert translated.text == _asr_by_chat(client, data, "translate", None)[0]
    wait_idle(server)


@pytest.mark.slow
def test_transcription_logprobs_stream_every_token_with_its_own_bytes(server, client):
    """include[]=logprobs: one logprob per reply token, streamed and not alike, token by token. The clip's greedy
    reply has a token holding part of a UTF-8 character (its text alone is U+FFFD, its text waits for the next
    token): the stream still carries its logprob, with the delta of the text it is part of; and its `bytes` are the
    token's own, so the tokens' bytes join into the transcript."""
    from tests.serve.realtime_utils import speech_wav

    data = speech_wav().read_bytes()
    whole = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), include=["logprobs"])
    lps = whole.logprobs
    assert len(lps) == whole.usage.output_tokens
    partial = [lp for lp in lps if lp.token == "\ufffd"]
    assert partial  # the case under test
    assert all(bytes(int(b) for b in lp.bytes) != "\ufffd".encode() for lp in partial)
    assert b"".join(bytes(int(b) for b in lp.bytes) for lp in lps).decode("utf-8", "replace") == whole.text
    events = list(client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), include=["logprobs"],
                                                     stream=True))
    deltas, done = events[:-1], events[-1]
    assert {e.type for e in deltas} == {"transcript.text.delta"} and done.type == "transcript.text.done"
    streamed = [lp for e in deltas for lp in e.logprobs]
    for got in (streamed, done.logprobs):
        assert [(lp.token, lp.bytes) for lp in got] == [(lp.token, lp.bytes) for lp in lps]
        # (values a rounding apart at most: the second request hits the first one's prefix-cache blocks)
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    for e in deltas:  # each delta's tokens spell its text
        assert b"".join(bytes(int(b) for b in lp.bytes) for lp in e.logprobs).decode("utf-8", "replace") == e.delta
    wait_idle(server)


def _speech_slice(data: bytes, start_s: float, end_s: float) -> bytes:
    """The samples [start_s, end_s) of a 16 kHz 16-bit WAV as a WAV of their own (the same int16 values: the
    server decodes them to the same floats as the slice it cut from the whole clip)."""
    import soundfile as sf

    x, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 16000
    buf = io.BytesIO()
    sf.write(buf, x[int(start_s * rate):int(end_s * rate)], rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.slow
def test_timestamped_transcripts_are_the_segments_transcribed_one_by_one(server, client):
    """verbose_json, srt and vtt, and `chunking_strategy`: the clip (a real recorded reading, ~10 s, six phrases)
    is cut at its silences by Silero VAD, and each segment's text is exactly the thinker's greedy reply to the
    speech-recognition prompt on that segment's samples alone; the segments' tokens are that reply's, the
    timestamps are the VAD's spans, and every format carries the same texts."""
    import soundfile as sf

    from omni.serve.transcription.speech_segments import VadOptions, speech_segments
    from omni.serve.transcription.formats import cue_text, timestamp
    from omni.serve.audio.vad import speech_probabilities
    from tests.serve.realtime_utils import speech_wav

    x, rate = sf.read(str(speech_wav()), dtype="int16")
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="PCM_16")
    data = buf.getvalue()
    spans = speech_segments(speech_probabilities(x.astype(np.float32) / 32768, rate), x.size / rate, VadOptions())
    assert len(spans) >= 3
    verbose = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en",
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    assert verbose.duration == pytest.approx(x.size / rate, abs=1e-3) and verbose.language == "en"
    assert [(s.start, s.end) for s in verbose.segments] == [(s.start_s, s.end_s) for s in spans]
    want = [_asr_by_chat(client, _speech_slice(data, s.start_s, s.end_s), "transcribe", "en") for s in spans]
    assert [s.text for s in verbose.segments] == [text.strip() for text, _ in want]
    assert [len(s.tokens) for s in verbose.segments] == [tokens for _, tokens in want]
    assert verbose.usage.output_tokens == sum(tokens for _, tokens in want)
    assert all(s.avg_logprob < 0 and 0 <= s.no_speech_prob < 0.5 for s in verbose.segments)
    texts = [s.text for s in verbose.segments if s.text]
    assert verbose.text == " ".join(texts)

    srt = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en",
                                             response_format="srt")
    cues = [cue_text(t) for t in texts if cue_text(t)]  # (the tiny model's text has blank lines)
    timings = [f"{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}" for s in verbose.segments
               if cue_text(s.text)]
    assert srt == "".join(f"{i}\n{t}\n{c}\n\n" for i, (t, c) in enumerate(zip(timings, cues), 1))
    vtt = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en",
                                             response_format="vtt")
    assert vtt == "WEBVTT\n\n" + "".join(f"{t.replace(',', '.')}\n{c}\n\n" for t, c in zip(timings, cues))

    chunked = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en",
                                                 chunking_strategy="auto", include=["logprobs"])
    assert chunked.text == verbose.text
    assert len(chunked.logprobs) == verbose.usage.output_tokens
    events = list(client.audio.transcriptions.create(model=MODEL, file=("clip.wav", data), language="en",
                                                     chunking_strategy={"type": "server_vad", "threshold": 0.5},
                                                     stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert events[-1].type == "transcript.text.done" and "".join(deltas) == events[-1].text == verbose.text
    assert len(deltas) == len(texts)  # one delta a segment, in order
    translated = client.audio.translations.create(model=MODEL, file=("clip.wav", data),
                                                  response_format="verbose_json")
    assert translated.task == "translate" and translated.language == "en"
    assert [(s.start, s.end) for s in translated.segments] == [(s.start, s.end) for s in verbose.segments]
    wait_idle(server)


@pytest.mark.parametrize("fields,files,status,param", [
    ({"model": MODEL, "response_format": "srt", "stream": "true"}, True, 400, "stream"),
    ({"model": MODEL, "timestamp_granularities[]": "word", "response_format": "verbose_json"}, True, 400,
     "timestamp_granularities"),
    ({"model": MODEL, "timestamp_granularities[]": "segment"}, True, 400, "timestamp_granularities"),
    ({"model": MODEL, "include[]": "logprobs", "response_format": "verbose_json"}, True, 400, "include"),
    ({"model": MODEL, "include[]": "tokens"}, True, 400, "include[0]"),
    ({"model": MODEL, "chunking_strategy": "manual"}, True, 400, "chunking_strategy"),
    ({"model": MODEL, "chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "2"}, True, 400,
     "chunking_strategy.threshold"),
    ({"model": MODEL, "chunking_strategy": "{not json"}, True, 400, "chunking_strategy"),
    ({"model": MODEL, "known_speaker_names[]": "ann"}, True, 400, "known_speaker_names"),
    ({"model": MODEL, "language": "English"}, True, 400, "language"),
    ({"model": MODEL, "language": "hh"}, True, 400, "language"),  # two letters, but no ISO-639-1 code
    ({"model": MODEL, "language": "zz"}, True, 400, "language"),
    ({"model": MODEL, "temperature": "2"}, True, 400, "temperature"),
    ({"model": MODEL, "frobnicate": "1"}, True, 400, "frobnicate"),
    ({"model": "whisper-1"}, True, 404, "model"),
    ({"model": MODEL}, False, 400, "file"),
    ({"model": MODEL}, "not audio", 400, "file"),
])
def test_transcription_errors_name_the_field(server, fields, files, status, param):
    data = b"this is not an audio file" if files == "not audio" else _speech_wav(0.5)
    parts = [(k, None, v.encode()) for k, v in fields.items()] + ([("file", "clip.wav", data)] if files else [])
    boundary = "omni-test-boundary"
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"'.encode()
                    + (f'; filename="{name}"'.encode() if name else b"") + b"\r\n\r\n" + v + b"\r\n"
                    for k, name, v in parts) + f"--{boundary}--\r\n".encode()
    got, _, err = server.post("/v1/audio/transcriptions", body,
                              headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert got == status and err["error"]["param"] == param, err
    assert "<_io." not in err["error"]["message"]  # libsndfile's words, not the file object's repr


def test_transcription_takes_multipart_only(server):
    status, _, body = server.post("/v1/audio/transcriptions", {"model": MODEL})
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"


def test_tokenize_is_the_thinkers_own_prompt(server, client):
    """vLLM's /tokenize on Qwen2.5-Omni: the thinker renders its own prompt (system prompt, chat format), and
    /tokenize counts exactly what a chat completion's usage.prompt_tokens reports; a plain prompt too (as a user
    turn, as the thinker takes a completions prompt); the rendered text comes back through /detokenize."""
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    status, _, out = server.post("/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, out
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert out["count"] == chat.usage.prompt_tokens == len(out["tokens"])
    status, _, text = server.post("/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert status == 200 and "Hello there, how are you?" in text["prompt"] and "<|im_start|>system" in text["prompt"]
    status, _, plain = server.post("/tokenize", {"model": MODEL, "prompt": "Hello there"})
    comp = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2)
    assert status == 200 and plain["count"] == comp.usage.prompt_tokens, plain
    status, _, err = server.post("/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert status == 400 and err["error"]["param"] == "add_generation_prompt", err
