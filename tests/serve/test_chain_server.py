"""`omni serve` on the tiny chain (thinker -> talker), with the real `openai` client against a live server.

One server for the module (in this process, local backend: `serve_in_process`; the CLI's own process is
smoke-tested in test_serve_cli.py, the Ray-served app in test_ray_serve.py). The thinker samples greedily
(its config), so replies are deterministic.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import subprocess

import numpy as np
import openai
import pytest
from PIL import Image

from tests.serve.server_utils import CHAIN, generating, held, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny_chain"
HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CHAIN, "--backend", "local") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def png_data_url(h: int = 8, w: int = 8) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _check_chat_logprobs(content, k: int, n: int) -> None:
    assert len(content) == n
    for e in content:
        assert e.logprob <= 0 and bytes(e.bytes) == e.token.encode("utf-8")
        assert len(e.top_logprobs) == k and [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy


def test_logprobs_chat_and_completions_streamed_and_not(client):
    """logprobs / top_logprobs (chat) and logprobs=k (completions), OpenAI's shapes, one entry per reply token;
    the streamed entries name the non-streamed ones' tokens (greedy: the same tokens). Their values against
    transformers: tests/engine/test_engine.py."""
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    _check_chat_logprobs(content, 2, full.usage.completion_tokens)
    streamed = [e for ch in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, logprobs=True,
                                                            top_logprobs=2, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # The same tokens and top tokens; the values as the engine computes them (this request hits the last one's
    # prefix-cache blocks: its sums are ordered otherwise, a rounding apart; values: tests/engine/test_engine.py).
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in content]
    _check_chat_logprobs(streamed, 2, len(content))
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == full.choices[0].message.content

    comp = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(0 < len(top) <= 3 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = [ch.choices[0] for ch in client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4,
                                                                logprobs=3, stream=True) if ch.choices]
    got = [(t, o) for c in chunks if c.logprobs for t, o in zip(c.logprobs.tokens, c.logprobs.text_offset)]
    assert got == list(zip(lp.tokens, lp.text_offset))


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_0_lists_the_sampled_token(client, stream):
    """logprobs: 0 is the sampled token alone in each top_logprobs entry (OpenAI, vLLM), not {}."""
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=4, logprobs=0)
    if stream:
        lps = [ch.choices[0].logprobs for ch in client.completions.create(**kw, stream=True)
               if ch.choices and ch.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        tops = [top for lp in lps for top in lp.top_logprobs]
        token_lps = [p for lp in lps for p in lp.token_logprobs]
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, tops, token_lps = lp.tokens, lp.top_logprobs, lp.token_logprobs
    assert len(tokens) == 4 and tops == [{t: p} for t, p in zip(tokens, token_lps)], (tokens, tops)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, body = server.get("/health")
    assert status == 200 and body["status"] == "ok"
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(server.url + "/health", method="HEAD"), timeout=30) as r:
        assert r.status == 200 and r.read() == b""  # a load balancer's probe


def test_chat_non_streaming_and_streaming_agree(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 6
    assert full.usage.total_tokens == full.usage.prompt_tokens + 6
    assert choice.message.audio is None  # a text pipeline

    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6  # the usage chunk comes last
    assert all(c.usage is None for c in chunks[:-1])


def test_completions(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5)
    assert full.choices[0].text and full.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=3)
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 3


def test_second_turn_hits_the_prefix_cache(client):
    first = [{"role": "system", "content": "You are a travel agent who knows every town on the coast."},
             {"role": "user", "content": "Plan a week of walking between the villages."}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8)
    turn2 = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And where should we stay?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8)
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens >= 16  # at least the system + first user turn


def test_cache_salt_keeps_tenants_apart(client):
    msgs = [{"role": "user", "content": "A long shared question about the history of the harbour town."}]
    client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    warm = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    salted = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                            extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # no hit on another tenant's blocks
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           extra_body={"cache_salt": "tenant-b"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_sampling_params_list_and_stop(client):
    base = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6).choices[0].message.content
    # per stage: the thinker's entry sets max_tokens 3 (the top-level field would win over it)
    r = client.chat.completions.create(model=MODEL, messages=HELLO,
                                       extra_body={"sampling_params_list": [{"max_tokens": 3}, None]})
    assert r.usage.completion_tokens == 3
    stop = base[len(base) // 2: len(base) // 2 + 2]
    cut = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == base[: base.index(stop)]
    # vLLM's stop_reason (the string), streamed too, and its include_stop_str_in_output
    assert cut.choices[0].model_extra["stop_reason"] == stop
    kept = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, stop=[stop],
                                          extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == base[: base.index(stop) + len(stop)]
    last = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, stop=[stop],
                                               stream=True))[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0]
    assert plain.model_extra["stop_reason"] is None


def test_sixteen_concurrent_clients(server):
    async def one(c, i: int) -> tuple[str, int]:
        text, usage = "", None
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Client {i} says hello"}], max_tokens=8,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        async with server.async_client() as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16 and all(text and n == 8 for text, n in results)
    wait_idle(server)


def test_disconnect_mid_stream_releases_every_stage(server, client):
    before = server.metrics().get(("omni_requests_total", (("finish_reason", "abort"),)), 0.0)
    with held(server, "thinker", after_steps=1):  # its first token streams out, then it cannot finish
        stream = client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # the reply has started: the thinker has run the prompt and holds its blocks
        assert server.stage_gauges("omni_stage_kv_cache_usage_ratio")["thinker"] > 0
        stream.close()  # the client goes away mid-stream
        kv = wait_idle(server)
    assert set(kv) == {"thinker", "talker"} and not any(kv.values())
    after = server.metrics()[("omni_requests_total", (("finish_reason", "abort"),))]
    assert after == before + 1
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices[0].message.content


GOOD = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
BAD_REQUESTS = [
    # (what, body, status, param, code)
    ("unknown field", {**GOOD, "logit_bias_x": {"1": 2}}, 400, "logit_bias_x", "unknown_parameter"),
    ("an OpenAI feature omni lacks", {**GOOD, "prediction": {"type": "content", "content": "x"}}, 400,
     "prediction", "unsupported_parameter"),
    ("top_logprobs without logprobs", {**GOOD, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ("a logit bias outside the vocabulary", {**GOOD, "logit_bias": {"999999": 2}}, 400, "logit_bias", "invalid_value"),
    ("a logit bias out of OpenAI's range", {**GOOD, "logit_bias": {"1": 200}}, 400, "logit_bias", "invalid_value"),
    ("unknown field in a message", {**GOOD, "messages": [{"role": "user", "content": "hi", "x": 1}]}, 400,
     "messages[0].x", "unknown_parameter"),
    ("not JSON", b"{model: nope", 400, None, "invalid_value"),
    ("wrong model", {**GOOD, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("missing messages", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("empty messages", {**GOOD, "messages": []}, 400, "messages", "invalid_value"),
    ("bad role", {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ("unknown part type", {**GOOD, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
     "messages[0].content[0]", "invalid_value"),
    ("temperature out of range", {**GOOD, "temperature": 3}, 400, "temperature", "invalid_value"),
    ("temperature as a string", {**GOOD, "temperature": "0.5"}, 400, "temperature", "invalid_value"),
    ("max_tokens 0", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("n=0", {**GOOD, "n": 0}, 400, "n", "invalid_value"),
    ("stream_options without stream", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ("audio out of a text pipeline", {**GOOD, "modalities": ["text", "audio"]}, 400, "modalities", None),
    ("prompt longer than max_model_len", {**GOOD, "messages": [{"role": "user", "content": "word " * 300}]},
     400, "messages", "context_length_exceeded"),
    ("max_tokens past max_model_len", {**GOOD, "max_tokens": 1000}, 400, "max_tokens", "context_length_exceeded"),
    ("an image for a text-only model", {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url()}}, {"type": "text", "text": "hi"}]}]},
     400, "messages[0].content[0].image_url", "invalid_value"),
    ("undecodable image", {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
     400, "messages[0].content[0].image_url.url", None),
    ("an http image URL", {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}]}]},
     400, "messages[0].content[0].image_url.url", None),
    ("audio not base64", {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "!!!", "format": "wav"}}]}]},
     400, "messages[0].content[0].input_audio.data", None),
    ("audio not audio", {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....WAVEjunk").decode(),
                                                "format": "wav"}}]}]},
     400, "messages[0].content[0].input_audio.data", None),
    ("sampling_params_list of the wrong length", {**GOOD, "sampling_params_list": [None]}, 400,
     "sampling_params_list", None),
    ("a bad field in sampling_params_list", {**GOOD, "sampling_params_list": [None, {"top_p": 0}]}, 400,
     "sampling_params_list[1].top_p", "invalid_value"),
    ("an unknown field in sampling_params_list", {**GOOD, "sampling_params_list": [{"beam_width": 2}, None]},
     400, "sampling_params_list[0].beam_width", "unknown_parameter"),
    ("min_tokens past max_tokens", {**GOOD, "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", "invalid_value"),
    ("negative min_tokens", {**GOOD, "min_tokens": -1}, 400, "min_tokens", None),
    ("a token id out of vocabulary", {"model": MODEL, "prompt": [10**9], "max_tokens": 2}, 400, "prompt",
     "invalid_value"),
    ("a stop token id out of vocabulary", {**GOOD, "stop_token_ids": [10**6]}, 400, "stop_token_ids",
     "invalid_value"),
    ("a stop token id out of vocabulary in sampling_params_list",
     {**GOOD, "sampling_params_list": [{"stop_token_ids": [10**6]}, None]}, 400,
     "sampling_params_list[0].stop_token_ids", "invalid_value"),
]


@pytest.mark.parametrize("what,body,status,param,code", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, what, body, status, param, code):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    got, _, err = server.post(path, body)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["param"] == param, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    if code is not None:
        assert err["error"]["code"] == code, err
    got, _, ok = server.post("/v1/chat/completions", GOOD)  # the server keeps serving
    assert got == 200 and ok["choices"][0]["message"]["content"], ok


def test_n_choices_chat_and_completions(client):
    """n choices: each its own request; with a seed, choice i is what n=1 gives with seed + i (reproducible, and the
    choices are not copies); usage counts the prompt once and every choice's tokens; greedy choices are equal;
    streamed, every chunk names its choice and the pieces add up to the non-streamed texts."""
    kw = dict(model=MODEL, messages=HELLO, max_tokens=6, temperature=1.0, seed=7)
    three = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**{**kw, "seed": 7 + i}) for i in range(3)]
    assert [c.message.content for c in three.choices] == [a.choices[0].message.content for a in alone]
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert len({c.message.content for c in three.choices}) > 1  # 6 tokens sampled at temperature 1, three seeds
    again = client.chat.completions.create(n=3, **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in three.choices]
    greedy = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content

    texts, finished, usage = {0: "", 1: "", 2: ""}, {}, None
    for ch in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in three.choices]
    assert sorted(finished) == [0, 1, 2] and usage.completion_tokens == three.usage.completion_tokens

    ckw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=3)
    two = client.completions.create(n=2, **ckw)
    assert [c.text for c in two.choices] == [client.completions.create(**{**ckw, "seed": 3 + i}).choices[0].text
                                             for i in range(2)]
    streamed = {0: "", 1: ""}
    for ch in client.completions.create(n=2, stream=True, **ckw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in two.choices]


def test_streamed_logprobs_name_every_token_once_with_its_own_bytes(server, client):
    """Reply tokens holding part of a UTF-8 character (each one's text alone is U+FFFD; the reply's text waits for
    the token that completes the character): streamed, each still has its logprob, once, so the chunks list the
    non-streamed reply's tokens token by token; and their `bytes` are the token's own (not U+FFFD's), so every
    token's bytes join into the reply's text. logit_bias makes the reply such tokens whatever the random model's
    numerics: the two bytes of "é" (0xC3 0xA9; byte-level BPE spells them "Ã" and "©"); a cache salt per request
    keeps each one uncached, so streamed and not compute the same sums."""
    tok = server.omni._omni._backend.workers["thinker"].engine.model.tokenizer
    lead, cont = tok.convert_tokens_to_ids("\u00c3"), tok.convert_tokens_to_ids("\u00a9")
    assert tok.unk_token_id not in (lead, cont) and lead != cont

    def kw(salt: str) -> dict:
        return dict(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=12, logprobs=True,
                    top_logprobs=2, logit_bias={str(lead): 100, str(cont): 100}, extra_body={"cache_salt": salt})

    whole = client.chat.completions.create(**kw("bytes-whole"))
    content = whole.choices[0].logprobs.content
    assert [e.token for e in content] == ["\ufffd"] * 12  # each token alone is part of a character
    assert {bytes(e.bytes) for e in content} <= {b"\xc3", b"\xa9"}
    raw = b"".join(bytes(e.bytes) for e in content)
    # the text: those bytes decoded, less a character the last token began (vLLM never emits incomplete bytes)
    assert raw.decode("utf-8", "replace")[: -1 if raw.endswith(b"\xc3") else None] == whole.choices[0].message.content
    streamed = [e for ch in client.chat.completions.create(**kw("bytes-streamed"), stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes, e.logprob, [(t.token, t.bytes) for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.bytes, e.logprob, [(t.token, t.bytes) for t in e.top_logprobs]) for e in content]
    ckw = dict(model=MODEL, prompt="a", max_tokens=12, logprobs=1, logit_bias={str(lead): 100, str(cont): 100})
    comp = client.completions.create(**ckw, extra_body={"cache_salt": "bytes-comp"})
    chunks = client.completions.create(**ckw, stream=True, extra_body={"cache_salt": "bytes-comp-streamed"})
    assert [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == \
        comp.choices[0].logprobs.tokens and len(comp.choices[0].logprobs.tokens) == 12


BATCH = ["The capital of France is", "Once upon a time", "a"]


def test_completions_batch_of_prompts_is_each_prompt_alone(client):
    """A batch of prompts (OpenAI's legacy API and vLLM take one; lm-evaluation-harness's local-completions sends
    them): one choice per prompt, in order, each what that prompt alone gives (greedy), text, logprobs and finish
    reason; as token-id lists too; usage adds up every prompt and every choice; echo with max_tokens 0 (a
    loglikelihood batch) returns each prompt alone."""
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, logprobs=1) for p in BATCH]
    batch = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=5, logprobs=1)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [(c.text, c.logprobs.tokens, c.finish_reason) for c in batch.choices] == \
        [(a.choices[0].text, a.choices[0].logprobs.tokens, a.choices[0].finish_reason) for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 15 and batch.usage.total_tokens == batch.usage.prompt_tokens + 15

    ids = [[1, 2, 3, 4, 5], [42, 43], [9]]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4) for p in ids]
    batch = client.completions.create(model=MODEL, prompt=ids, max_tokens=4)
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == 8 and batch.usage.completion_tokens == 12

    scored = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=0, echo=True, logprobs=1)
    one = [client.completions.create(model=MODEL, prompt=p, max_tokens=0, echo=True, logprobs=1) for p in BATCH]
    assert [(c.text, c.logprobs.tokens) for c in scored.choices] == \
        [(o.choices[0].text, o.choices[0].logprobs.tokens) for o in one]
    assert [c.text for c in scored.choices] == BATCH
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)


def test_completions_batch_with_n_and_streamed(client):
    """n choices of each prompt of a batch: choice prompt_index * n + i (vLLM's order), with a seed the sample n=1 of
    that prompt gives with seed + i; streamed, every chunk names its choice, the prompts' choices come interleaved as
    they are produced, and each choice's pieces add up to the non-streamed choice, echo included; the usage too."""
    kw = dict(model=MODEL, max_tokens=5, temperature=1.0, seed=11)
    two = client.completions.create(prompt=BATCH[:2], n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.text for c in two.choices] == [client.completions.create(prompt=p, **{**kw, "seed": 11 + i})
                                             .choices[0].text for p in BATCH[:2] for i in range(2)]
    texts, finished, order, usage = {}, {}, [], None
    for ch in client.completions.create(prompt=BATCH[:2], n=2, stream=True, stream_options={"include_usage": True},
                                        **kw):
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            order += [c.index] if c.text else []
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert [texts[i] for i in range(4)] == [c.text for c in two.choices]
    assert finished == {c.index: c.finish_reason for c in two.choices}
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)  # prompt 1's text starts before prompt 0's ends
    assert (usage.prompt_tokens, usage.completion_tokens) == (two.usage.prompt_tokens, two.usage.completion_tokens)

    echoed = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=3, echo=True, logprobs=1)
    streamed = {}
    for ch in client.completions.create(model=MODEL, prompt=BATCH, max_tokens=3, echo=True, logprobs=1, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in echoed.choices]
    assert all(c.text.startswith(p) for c, p in zip(echoed.choices, BATCH))


def test_completions_batch_errors_name_the_prompt(server, client):
    """A bad prompt of a batch is a 400 naming it (`prompt[1]`), whether the server or the text stage refuses it; the
    prompts already submitted are aborted, and the server keeps serving; a batch larger than the server ever runs at
    once is a 400 naming `prompt`."""
    for prompt, param, code in [(["Hi", ""], "prompt[1]", "invalid_value"),
                                (["Hi", [1, 2]], "prompt[1]", "invalid_value"),
                                ([[1, 2], [3, "x"]], "prompt[1][1]", "invalid_value"),
                                ([[1, 2], [3, 10**9]], "prompt[1]", "invalid_value"),
                                (["Hi", "There", "word " * 300], "prompt[2]", "context_length_exceeded")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert (e.value.body["param"], e.value.body["code"]) == (param, code), e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # more than the server ever runs at once (256 by default)
        client.completions.create(model=MODEL, prompt=["Hi"] * 129, n=2, max_tokens=2)
    assert e.value.body["param"] == "prompt" and "129 prompts x 2 choices" in e.value.body["message"]
    assert e.value.body["code"] == "invalid_value", e.value.body  # a code, as every other 400
    wait_idle(server)
    assert client.completions.create(model=MODEL, prompt=BATCH, max_tokens=2).usage.completion_tokens == 6


def test_disconnect_mid_batch_aborts_every_prompt(server, client):
    """The prompts of a batch run at once (the text stage batches them), and a client that leaves mid-stream aborts
    every one of them on every stage."""
    def aborted() -> float:
        return server.metrics().get(("omni_pipeline_requests_total", (("outcome", "aborted"),)), 0.0)

    before = aborted()
    with held(server, "thinker", until=generating(3)):
        stream = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        engine = server.omni._omni._backend.workers["thinker"].engine
        assert len(engine.scheduler.running) == 3  # all three prompts in the thinker's batch
        stream.close()
        kv = wait_idle(server)
    assert not any(kv.values()) and aborted() == before + 3


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "size": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["color", "size"], "additionalProperties": False}


@pytest.mark.slow
def test_structured_outputs_json_schema_json_object_regex_choice(client):
    """response_format json_schema: the reply is JSON valid against the schema, streamed or not, whatever the
    (random) model prefers; json_object: a JSON object; vLLM's structured_outputs regex / choice; a schema the
    grammar engine cannot compile is a 400 naming it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    for seed in (1, 2, 3):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, temperature=1.0, seed=seed,
                                           response_format=fmt)
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"color", "size"} and value["color"] in ("red", "green", "blue")
        assert 1 <= value["size"] <= 9 and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=40, temperature=1.0, seed=1, response_format=fmt, stream=True)
        if c.choices)
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, temperature=1.0, seed=1,
                                           response_format=fmt)
    assert streamed == first.choices[0].message.content

    obj = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, temperature=0.0,
                                         response_format={"type": "json_object"}).choices[0]
    assert obj.message.content.startswith("{")
    if obj.finish_reason == "stop":  # a random model may still be inside a string at max_tokens, as with vLLM
        assert isinstance(json.loads(obj.message.content), dict)
    text = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=5,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}).choices[0]
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", text.text) and text.finish_reason == "stop"
    pick = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=1.0, seed=4,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert pick.choices[0].message.content in ("yes", "no", "maybe")

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema" and "objekt" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5,
                                       extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.value.body["param"] == "structured_outputs"


def test_prompt_logprobs_vllm_extra(client, server):
    """vLLM's prompt_logprobs on completions and chat: one entry per prompt token (null first), the token itself with
    its rank and the k most likely with ranks 1..k; a repeat gives the same numbers (recomputed, not cached)."""
    r = client.completions.create(model=MODEL, prompt="The quick brown fox jumps", max_tokens=2,
                                  extra_body={"prompt_logprobs": 2})
    lps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(lps) == r.usage.prompt_tokens and lps[0] is None
    for pos in lps[1:]:
        ranked = sorted((v["rank"], v["logprob"]) for v in pos.values())
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and v["decoded_token"] is not None for v in pos.values())
        top = [lp for rank, lp in ranked if rank <= 2]
        assert top == sorted(top, reverse=True) and len(pos) in (2, 3)  # the token itself may be one of the top 2
    again = client.completions.create(model=MODEL, prompt="The quick brown fox jumps", max_tokens=2,
                                      extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    assert again == lps
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body={"prompt_logprobs": 0})
    chat_lps = chat.choices[0].model_extra["prompt_logprobs"]
    assert len(chat_lps) == chat.usage.prompt_tokens and all(len(p) == 1 for p in chat_lps[1:])
    status, _, body = server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True,
                                                       "prompt_logprobs": 1})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


def test_completions_echo(client, server):
    """completions' echo (vLLM's semantics): the text starts with the prompt; with logprobs the prompt's tokens lead
    `logprobs` (the first null), their values those of vLLM's prompt_logprobs; max_tokens 0 returns the prompt
    alone (lm-evaluation-harness scores a continuation this way, prompt as token ids)."""
    prompt = "The quick brown fox jumps"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=1, echo=True)
    c, p = echoed.choices[0], plain.choices[0]
    assert c.text == prompt + p.text
    # (the echoed prompt with logprobs is recomputed: no cached tokens there)
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (plain.usage.prompt_tokens, 3)
    n = plain.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n + 3 and c.logprobs.tokens[n:] == p.logprobs.tokens
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert "".join(c.logprobs.tokens[:n]) == prompt  # each prompt token decoded alone, in order
    assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i])) for i in range(n + 3)]
    # The same request through vLLM's prompt_logprobs: the same computation (the prompt recomputed, where the plain
    # request above may hit the prefix cache), so the same numbers.
    vllm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=1,
                                     extra_body={"prompt_logprobs": 1})
    assert c.logprobs.token_logprobs[n:] == vllm.choices[0].logprobs.token_logprobs
    assert c.logprobs.top_logprobs[n:] == vllm.choices[0].logprobs.top_logprobs
    ids = [int(next(k for k, v in pos.items() if v["decoded_token"] == tok and v["logprob"] == lp))
           for pos, tok, lp in zip(vllm.choices[0].model_extra["prompt_logprobs"][1:], c.logprobs.tokens[1:n],
                                   c.logprobs.token_logprobs[1:n])]
    assert len(ids) == n - 1  # every prompt token's logprob is the one prompt_logprobs gives it
    assert all(len(top) in (1, 2) and c.logprobs.tokens[i] in top for i, top in enumerate(c.logprobs.top_logprobs[1:n], 1))
    assert "prompt_logprobs" not in c.model_extra  # computed for echo, not asked for

    # lm-evaluation-harness's loglikelihood request: token ids, echo, max_tokens 0, logprobs 1
    token_ids = [ids[0], *ids]  # a prompt as token ids (the fox sentence's tokens after the first, and one more)
    score = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=0, logprobs=1, echo=True,
                                      temperature=0)
    s = score.choices[0]
    assert s.text == "".join(s.logprobs.tokens) and len(s.logprobs.tokens) == len(token_ids)
    assert s.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in s.logprobs.token_logprobs[1:])
    assert score.usage.completion_tokens == 0 and score.usage.total_tokens == score.usage.prompt_tokens == len(token_ids)
    status, _, body = server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"


def _joined_logprobs(chunks) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            for key in out:
                out[key] += getattr(c.choices[0].logprobs, key)
    return out


def test_completions_echo_streamed(client):
    """A streamed echo (vLLM's): the prompt comes first, then the reply; the chunks join into the non-streamed
    reply, text and logprobs (text_offset counted over the whole text), and max_tokens 0 streams the prompt
    alone with completion_tokens 0."""
    prompt = "The quick brown fox jumps"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=1, echo=True, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=1, echo=True,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == whole.choices[0].text[: len(texts[0])] and texts[0].endswith(prompt)  # the prompt first
    assert "".join(texts) == whole.choices[0].text
    assert _joined_logprobs(chunks) == whole.choices[0].logprobs.model_dump()
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # without logprobs: the text alone
    plain = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in plain if c.choices) == whole.choices[0].text
    assert all(c.choices[0].logprobs is None for c in plain if c.choices)
    # lm-evaluation-harness's loglikelihood request, streamed: the prompt and nothing else
    ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    scored = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in scored if c.choices) == ids.choices[0].text
    assert _joined_logprobs(scored) == ids.choices[0].logprobs.model_dump()
    assert scored[-1].usage.completion_tokens == 0 and scored[-1].usage.total_tokens == ids.usage.prompt_tokens


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
    "required": ["unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _valid_weather(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"unit", "days"} and args["unit"] in ("c", "f") and 1 <= args["days"] <= 7


def test_forced_tool_calls_come_back_as_tool_calls(client):
    """tool_choice named or "required" (vLLM's semantics without a parser): the reply is constrained to the call's
    JSON and comes back as tool_calls, streamed or not; a random model's calls still follow the schemas."""
    named = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER, TIME], max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg, choice = named.choices[0].message, named.choices[0]
    assert msg.content is None and choice.finish_reason == "stop" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert _valid_weather(call.function.arguments)

    required = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER, TIME], max_tokens=120,
                                              tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1  # parallel_tool_calls false
    for c in calls:
        assert c.function.name in ("get_weather", "get_time")
        if c.function.name == "get_weather":
            assert _valid_weather(c.function.arguments)
        else:
            assert json.loads(c.function.arguments)["zone"] in ("utc", "cet")

    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], max_tokens=40,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                stream=True):
        for c in chunk.choices:
            assert not c.delta.content  # the call's JSON is not text
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "stop" and len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.name == "get_weather" and _valid_weather(deltas[0].function.arguments)
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"

    # a reply cut short is not a complete call: its text, finish_reason length
    cut = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], max_tokens=3,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("{")


def test_tools_and_tool_turns_reach_the_chat_template(client, server):
    """The tools and the earlier calls and results go to the text stage's chat template (this tiny tokenizer's
    template names neither, so one that does is put in for the test): the prompt grows by what they render."""
    tok = server.omni._omni._backend.workers["thinker"].engine.model.tokenizer
    template = tok.chat_template
    tok.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                         "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}"
                         "CALL {{ c.function.name }} {{ c.function.arguments.unit }}{% endfor %}{% endif %}"
                         "{{ m.content or '' }}{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n"
                         "{% endfor %}assistant:")
    try:
        plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        shown = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, tools=[WEATHER],
                                               tool_choice="none")
        assert shown.usage.prompt_tokens > plain.usage.prompt_tokens and shown.choices[0].message.tool_calls is None
        turns = HELLO + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"unit": "c", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]
        answered = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=2, tools=[WEATHER],
                                                  tool_choice="none")
        assert answered.usage.prompt_tokens > shown.usage.prompt_tokens
    finally:
        tok.chat_template = template


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" (the default with tools): this server has no parser set
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_tool_errors_name_the_field(server, body, param):
    got, _, err = server.post("/v1/chat/completions", {**GOOD, **body})
    assert got == 400 and err["error"]["param"] == param, err


def test_openai_fields_at_their_defaults_are_accepted(server):
    body = {**GOOD, "logprobs": False, "tool_choice": None, "response_format": {"type": "text"}, "n": None,
            "stream": None, "tools": None, "frequency_penalty": 0, "logit_bias": None}
    got, _, ok = server.post("/v1/chat/completions", body)
    assert got == 200 and ok["choices"][0]["message"]["content"], ok
    got, _, ok = server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logprobs": None,
                                                  "echo": False, "best_of": None})
    assert got == 200 and ok["choices"][0]["text"] is not None, ok


def test_out_of_vocabulary_errors_carry_the_numbers(server):
    got, _, err = server.post("/v1/chat/completions", {**GOOD, "stop_token_ids": [5, 151937]})
    assert got == 400 and err["error"]["param"] == "stop_token_ids", err
    assert "151937" in err["error"]["message"] and "vocabulary" in err["error"]["message"]


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, top_p=1.5)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.get("/nowhere", cast_to=object)


def test_metrics_parse_and_move(server, client):
    m0 = server.metrics()
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    server.post("/v1/chat/completions", {**GOOD, "model": "wrong"})
    m1 = server.metrics()
    ok = ("omni_http_requests_total", (("path", "/v1/chat/completions"), ("status", "200")))
    nf = ("omni_http_requests_total", (("path", "/v1/chat/completions"), ("status", "404")))
    assert m1[ok] == m0.get(ok, 0) + 1 and m1[nf] == m0.get(nf, 0) + 1
    length = ("omni_requests_total", (("finish_reason", "length"),))
    assert m1[length] == m0.get(length, 0) + 1
    assert m1[("omni_generation_tokens_total", ())] == m0.get(("omni_generation_tokens_total", ()), 0) + 4
    ttft = ("omni_time_to_first_token_seconds_count", (("stage", "thinker"),))
    assert m1[ttft] == m0.get(ttft, 0) + 1
    for name in ("omni_stage_kv_cache_usage_ratio", "omni_stage_prefix_cache_hit_rate",
                 "omni_stage_running_requests", "omni_stage_waiting_requests", "omni_stage_tensor_cache_bytes",
                 "omni_stage_preemptions_total"):
        assert set(server.stage_gauges(name)) == {"thinker", "talker"}, name
    assert server.stage_gauges("omni_stage_prefix_cache_queries_total")["thinker"] > 0


def test_raw_sse_framing_with_curl(server):
    body = json.dumps({**GOOD, "max_tokens": 3, "stream": True})
    out = subprocess.run(["curl", "-sN", "--max-time", "60", "-H", "Content-Type: application/json",
                          "-d", body, f"{server.v1}/chat/completions"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    events = out.stdout.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", out.stdout[-300:]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_vllm_truncate_prompt_tokens_and_spaces_between_special_tokens(server, client):
    """vLLM's truncate_prompt_tokens: the entry stage keeps the prompt's last k tokens (usage counts those), the reply
    that of the cut prompt; -1 is max_model_len; more than max_model_len is a 400 naming the field.
    spaces_between_special_tokens is accepted (vLLM's clients send it)."""
    ids = list(range(100, 140))
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, extra_body={"truncate_prompt_tokens": 7})
    same = client.completions.create(model=MODEL, prompt=ids[-7:], max_tokens=4)
    assert cut.usage.prompt_tokens == 7 and cut.choices[0].text == same.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    got, _, err = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                  "truncate_prompt_tokens": 10**6})
    assert got == 400 and err["error"]["param"] == "truncate_prompt_tokens", err
    assert "greater than max_model_len" in err["error"]["message"]
    got, _, err = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                  "truncate_prompt_tokens": 0})
    assert got == 400 and err["error"]["param"] == "truncate_prompt_tokens", err
    for flag in (True, False):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                           extra_body={"spaces_between_special_tokens": flag})
        assert r.choices[0].message.content


VLLM_DEFAULTS = {"priority": 0, "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None,
                 "bad_words": [], "logits_processors": None, "return_tokens_as_token_ids": False,
                 "return_token_ids": False, "structural_tag": None, "guided_grammar": None, "vllm_xargs": None,
                 "kv_transfer_params": None, "mm_processor_kwargs": None, "guided_decoding_backend": "auto"}
VLLM_CHAT_DEFAULTS = {"echo": False, "add_generation_prompt": True, "continue_final_message": False,
                      "add_special_tokens": False, "chat_template": None, "documents": None,
                      "chat_template_kwargs": {"enable_thinking": False}, "media_io_kwargs": None}


def test_vllm_request_fields_at_their_defaults_are_accepted(server, client):
    """Clients written for vLLM send its own fields, often at their defaults (the QA pass: a 400 for each before):
    accepted there; any other value of one omni does not implement is a 400 naming it (unsupported_parameter)."""
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    got = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                         extra_body={**VLLM_DEFAULTS, **VLLM_CHAT_DEFAULTS})
    assert got.choices[0].message.content == plain.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                     extra_body={**VLLM_DEFAULTS, "add_special_tokens": True, "prompt_embeds": None})
    assert comp.choices[0].text
    for name, value in [("use_beam_search", True), ("priority", 1), ("bad_words", ["x"]), ("echo", True),
                        ("continue_final_message", True), ("return_tokens_as_token_ids", True)]:
        status, _, err = server.post("/v1/chat/completions", {**GOOD, name: value})
        assert status == 400 and err["error"]["param"] == name, (name, err)
        assert err["error"]["code"] == "unsupported_parameter", err
    status, _, err = server.post("/v1/completions", {"model": MODEL, "prompt": "a", "add_special_tokens": False})
    assert status == 400 and err["error"]["param"] == "add_special_tokens", err


def test_vllm_guided_fields_request_id_and_whole_number_floats(server, client):
    got = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8,
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert got.choices[0].message.content in ("yes", "no")
    schema = {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"],
              "additionalProperties": False}
    js = client.completions.create(model=MODEL, prompt="{", max_tokens=40, extra_body={"guided_json": schema})
    assert json.loads(js.choices[0].text)["b"] in ("x", "y")
    fmt = client.completions.create(model=MODEL, prompt="{", max_tokens=40, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}})
    assert json.loads(fmt.choices[0].text)["b"] in ("x", "y")
    status, _, err = server.post("/v1/chat/completions", {**GOOD, "guided_choice": ["a"], "guided_regex": "a"})
    assert status == 400 and err["error"]["param"] == "guided_regex", err
    mine = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                          extra_body={"request_id": "my-id-7"})
    assert mine.id == "chatcmpl-my-id-7"
    status, _, ok = server.post("/v1/chat/completions", {**GOOD, "max_tokens": 3.0, "n": 1e0})
    assert status == 200 and ok["usage"]["completion_tokens"] == 3, ok
    for bad in (3.5, "3", True):
        status, _, err = server.post("/v1/chat/completions", {**GOOD, "max_tokens": bad})
        assert status == 400 and err["error"]["param"] == "max_tokens", (bad, err)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    for make in (lambda **kw: client.chat.completions.create(model=MODEL, messages=HELLO, **kw),
                 lambda **kw: client.completions.create(model=MODEL, prompt="Once upon a time", **kw)):
        chunks = list(make(max_tokens=6, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert all(c.usage is not None for c in chunks)
        done = [c.usage.completion_tokens for c in chunks]
        assert done == sorted(done) and done[-1] == 6 and done[0] < 6
        assert {c.usage.prompt_tokens for c in chunks[1:]} == {chunks[-1].usage.prompt_tokens}
        plain = list(make(max_tokens=6, stream=True, stream_options={"include_usage": True}))
        assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_no_max_tokens_generates_up_to_the_context_left(server, client):
    """vLLM's: a request without max_tokens is bounded by the stage's default and by what the context leaves; a
    prompt near max_model_len (256 here) is not refused for a bound the client never sent."""
    ids = list(range(100, 352))  # 252 tokens: 4 left, the stage's default is 8
    got = client.completions.create(model=MODEL, prompt=ids)
    assert got.usage.completion_tokens == 4 and got.choices[0].finish_reason == "length"
    status, _, err = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 8})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
