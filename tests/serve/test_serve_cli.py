"""`omni serve`'s own failures, before any model loads: exit 2 for a bad config or option, 1 for a taken port."""
from __future__ import annotations

import socket

from omni import cli
from tests.serve.server_utils import CHAIN


def test_bad_config_and_options_exit_2(tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert cli.main(["serve", str(CHAIN), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert cli.main(["serve", str(CHAIN), "--stage-overrides", '{"nope": {}}']) == 2
    assert "unknown stage 'nope'" in capsys.readouterr().err


def test_a_taken_port_exits_1_before_loading(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", str(CHAIN), "--backend", "local", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
