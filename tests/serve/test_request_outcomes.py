"""omni_pipeline_requests_total{outcome}: a reply the client got whole counts `finished`, even when the server
stopped the stages it did not ask for (the audio of a text-only reply); a client that leaves mid-reply still
counts `aborted`."""
from __future__ import annotations

import time

import pytest

from tests.serve.server_utils import CHAIN, held, serve_in_process, wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny_chain"
PROMPTS = ["The capital of France is", "Once upon a time", "a"]


@pytest.fixture(scope="module")
def server():
    with serve_in_process(CHAIN, "--backend", "local") as s:
        yield s


def outcomes(server) -> dict[str, float]:
    return {dict(labels)["outcome"]: v for (name, labels), v in server.metrics().items()
            if name == "omni_pipeline_requests_total"}


def settled(server, want: dict[str, float], timeout_s: float = 10.0) -> dict[str, float]:
    """The counts once they reach `want` (the last request's stages may be stopped just after the reply)."""
    deadline = time.monotonic() + timeout_s
    while (got := outcomes(server)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_text_only_replies_count_finished_not_aborted(server):
    client = server.client()
    before = outcomes(server)
    for _ in range(2):  # the talker's audio is not asked for: the server stops it once the text is whole
        r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, extra_body={"ignore_eos": True})
        assert len(r.choices) == 3 and all(c.text for c in r.choices)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=4, stream=True, extra_body={"ignore_eos": True}) if c.choices)
    assert text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert chat.choices[0].message.content
    want = {**before, "finished": before.get("finished", 0) + 10}
    assert settled(server, want) == want
    wait_idle(server)


def test_a_client_that_leaves_mid_reply_still_counts_aborted(server):
    client = server.client()
    before = outcomes(server)
    with held(server, "thinker", after_steps=1):  # its first token streams out, then it cannot finish
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        wait_idle(server)
    want = {**before, "aborted": before.get("aborted", 0) + 1}
    assert settled(server, want) == want
