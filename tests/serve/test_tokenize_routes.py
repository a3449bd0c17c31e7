"""vLLM's /tokenize, /detokenize, /version and /ping on `omni serve` (the tiny chain, one server for the module).

The thinker runs with `use_chat_template: true` and the server with an API key: /tokenize of a text prompt must be
what a completion's prompt is (plain text), of chat messages what a chat completion's prompt is, token for token
(the stage's own ids, read back from `prompt_logprobs`); the routes outside /v1 but the probes need the key.
"""
from __future__ import annotations

import json

import pytest

from omni import registry
from tests.serve.server_utils import CHAIN, serve_in_process

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny_chain"
KEY = "tokenize-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Hello there, "},
                                     {"type": "text", "text": "how are you?"}]}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CHAIN, "--backend", "local", "--stage-overrides",
                          json.dumps({"thinker": {"use_chat_template": True}}), env={"OMNI_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(registry.resolve_model_path("builtin:tiny-qwen2")))


def tokenize(server, body, status=200):
    code, _, out = server.post("/tokenize", body, AUTH)
    assert code == status, out
    return out


def stage_prompt_ids(choice) -> list[int]:
    """The prompt's token ids as the stage computed them (all but the first: prompt_logprobs 0 names each token)."""
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None
    return [int(next(iter(e))) for e in entries[1:]]


def test_text_prompt_is_the_completions_prompt(server, client, tok):
    text = "Hello there, how are you today?"
    out = tokenize(server, {"model": MODEL, "prompt": text})
    assert out["tokens"] == tok(text)["input_ids"]  # plain text, whatever use_chat_template says
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256 and out["token_strs"] is None
    comp = client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert comp.usage.prompt_tokens == out["count"]
    assert stage_prompt_ids(comp.choices[0]) == out["tokens"][1:]
    assert tokenize(server, {"prompt": text})["tokens"] == out["tokens"]  # model is optional, as in vLLM
    plain = tokenize(server, {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["messages", "with-tools"])
def test_chat_messages_are_the_chat_prompt(server, client, tools):
    body = {"model": MODEL, "messages": CHAT, **({"tools": tools} if tools else {})}
    out = tokenize(server, body)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0},
                                          **({"tools": tools, "tool_choice": "none"} if tools else {}))
    assert chat.usage.prompt_tokens == out["count"] == len(out["tokens"])
    assert stage_prompt_ids(chat.choices[0]) == out["tokens"][1:]
    # vLLM's other cases: no generation prompt (a prefix of it), the tokenizer's special tokens added
    bare = tokenize(server, {**body, "add_generation_prompt": False})["tokens"]
    assert len(bare) < out["count"] and out["tokens"][:len(bare)] == bare
    assert tokenize(server, {**body, "add_special_tokens": True})["tokens"] == out["tokens"]  # Qwen2 adds none
    # the template's variables, as the chat endpoint takes them (one this template does not read changes nothing)
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    assert tokenize(server, {**body, **kw})["tokens"] == out["tokens"]
    chat_kw = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body=kw,
                                             **({"tools": tools, "tool_choice": "none"} if tools else {}))
    assert chat_kw.usage.prompt_tokens == out["count"]


def test_token_strs_and_detokenize_round_trip(server, tok):
    text = "Tokenize me, then put me back together."
    out = tokenize(server, {"prompt": text, "return_token_strs": True})
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    code, _, back = server.post("/detokenize", {"model": MODEL, "tokens": out["tokens"]}, AUTH)
    assert code == 200 and back == {"prompt": text}
    chat = tokenize(server, {"messages": CHAT})["tokens"]
    code, _, back = server.post("/detokenize", {"tokens": chat}, AUTH)  # special tokens kept, as vLLM
    assert code == 200 and back["prompt"].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/tokenize", {"model": "gpt-4o", "prompt": "Hi"}, 404, "model", "model_not_found"),
    ("/detokenize", {"model": "gpt-4o", "tokens": [1]}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "Hi", "truncate": 3}, 400, "truncate", "unknown_parameter"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi"}, 400, "prompt",
     "unknown_parameter"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "yes"}, 400, "add_special_tokens", "invalid_value"),
    ("/tokenize", {"prompt": ["Hi"]}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"messages": []}, 400, "messages", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True}, 400,
     "continue_final_message", "unsupported_parameter"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages[0].content[1]",
     "unsupported_value"),
    ("/detokenize", {"tokens": [1, 2, 10_000_000]}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]", "invalid_value"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "invalid_value"),
], ids=["wrong-model", "detok-wrong-model", "unknown-field", "prompt-and-messages", "bad-bool", "prompt-list",
        "no-prompt", "no-messages", "unsupported", "media", "out-of-vocab", "negative-id", "bool-id", "ids-as-text"])
def test_errors_are_openai_shaped(server, path, body, status, param, code):
    got, _, out = server.post(path, body, AUTH)
    assert got == status, out
    err = out["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert err["type"] == "invalid_request_error" and err["message"]
    if param == "tokens" and code == "invalid_value" and isinstance(body["tokens"], list):
        assert "out of vocabulary" in err["message"]


def test_json_only_and_the_api_key(server):
    got, _, out = server.post("/tokenize", b"prompt=Hi", {**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert got == 415 and out["error"]["code"] == "unsupported_media_type"
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            got, _, out = server.post(path, body, headers)
            assert got == 401 and out["error"]["code"] == "invalid_api_key", (path, headers)
    assert server.get("/version")[0] == 401


def test_version_and_ping(server):
    from importlib.metadata import version

    got, _, out = server.get("/version", AUTH)
    assert got == 200 and out == {"version": version("omni")}
    _, _, health = server.get("/health")
    for got, _, out in (server.get("/ping"), server.post("/ping", b"", {"Content-Type": ""})):
        assert got == 200 and out == health  # open, as /health is


def test_the_omni_apis_tokenize_and_detokenize_on_the_stage(tiny_qwen2):
    """Omni.tokenize / detokenize run on the stage's engine: a one-shot stage and a stage without a tokenizer refuse
    by name; a stage that is not the pipeline's is refused naming `stage`."""
    from omni import Omni
    from omni.errors import RequestError

    with Omni(str(CHAIN), backend="local") as o:
        out = o.tokenize({"prompt": [{"role": "user", "content": "Hi"}]}, return_token_strs=True)
        assert out["tokens"] and len(out["token_strs"]) == len(out["tokens"]) and out["max_model_len"] == 256
        assert o.detokenize(o.tokenize("Hello there")["tokens"]) == "Hello there"
        with pytest.raises(RequestError) as e:
            o.detokenize([10**9])
        assert e.value.field == "tokens"
        with pytest.raises(RequestError) as e:
            o.tokenize("Hi", stage="nope")
        assert e.value.field == "stage"
        o._backend.workers["talker"].engine.text.tokenizer = None
        with pytest.raises(RequestError, match="has no tokenizer"):
            o.tokenize("Hi", stage="talker")
