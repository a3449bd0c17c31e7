"""`omni serve` the command: its own failures, before any model loads (exit 2 for a bad config or option, 1
for a taken port), and the one smoke test of it serving in its own process."""
from __future__ import annotations

import signal
import socket

import pytest

from omni import cli
from tests.serve.server_utils import CHAIN, omni_serve


def test_bad_config_and_options_exit_2(tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert cli.main(["serve", str(CHAIN), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert cli.main(["serve", str(CHAIN), "--stage-overrides", '{"nope": {}}']) == 2
    assert "unknown stage 'nope'" in capsys.readouterr().err
    assert cli.main(["serve", str(CHAIN), "--enable-auto-tool-choice"]) == 2  # vLLM's rule: which format to read
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,expected", [
    ("--max-body-mb", "0", "Input should be greater than or equal to 0.0009765625 MiB (got 0)"),  # 1 KiB
    ("--max-body-mb", "0.0005", "Input should be greater than or equal to 0.0009765625 MiB (got 0.0005)"),
    ("--max-body-mb", "-2.5", "Input should be greater than or equal to 0.0009765625 MiB (got -2.5)"),
    ("--max-media-mb", "0", "Input should be greater than or equal to 9.536743164e-07 MiB (got 0)"),  # 1 byte
    ("--max-body-mb", "nan", "expected a finite number of MiB (got nan)"),
    ("--max-media-mb", "inf", "expected a finite number of MiB (got inf)"),
])
def test_a_size_option_is_refused_in_its_own_unit(capsys, flag, value, expected):
    """The size options are in MiB: a refusal states the bound in MiB and echoes the value as typed (it said
    `>= 1024 (got 0)`, the settings' bytes, and a typed -2.5 came back as -2621440); nan / inf, which have no
    bytes, exit 2 the same way instead of a traceback."""
    assert cli.main(["serve", str(CHAIN), "--backend", "local", flag, value]) == 2
    assert capsys.readouterr().err.strip() == f"error: {flag}: {expected}"


def test_a_taken_port_exits_1_before_loading(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", str(CHAIN), "--backend", "local", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.server
def test_omni_serve_in_its_own_process():
    """The smoke test of the command itself (every other server test serves the same app in-process): it
    says where it listens, answers the `openai` client plainly and streamed, and SIGTERM with nothing in
    flight is a clean drain: exit 0, no traceback, the pipeline closed (test_shutdown.py covers requests in
    flight and a grace period that runs out)."""
    hello = [{"role": "user", "content": "Hello there, how are you today?"}]
    with omni_serve(CHAIN, "--backend", "local") as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["tiny_chain"]
        full = client.chat.completions.create(model="tiny_chain", messages=hello, max_tokens=4)
        assert full.choices[0].message.content and full.usage.completion_tokens == 4
        chunks = client.chat.completions.create(model="tiny_chain", messages=hello, max_tokens=4, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            full.choices[0].message.content
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        log = server.log.read_text(errors="replace")
    assert "Traceback" not in log and "omni serve: SIGTERM: draining" in log, log[-2000:]
