"""The `omni` command on bad input: config and prompts-file errors exit 2 with one line naming the
line or field, before anything loads; Ctrl-C and SIGTERM exit quietly with 130 / 143."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from omni import cli
from tests.fakes import chain_config

REPO = Path(__file__).resolve().parents[1]


def real_stage(name: str, **kw) -> dict:
    return {"name": name, "model": "causal_lm", "model_path": "builtin:tiny-qwen2", **kw}


@pytest.fixture
def no_engines(monkeypatch):
    """Nothing may load: a bad prompts file or config is refused before any stage starts."""
    import omni.pipeline.engine_factory as engine_factory

    def refuse(stage):
        raise AssertionError(f"stage {stage.name} was started")

    monkeypatch.setattr(engine_factory, "build_engine", refuse)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: ")
    return err


@pytest.mark.parametrize("line,expected", [
    ('{"promt": "hi"}', "unknown key 'promt' (allowed: prompt, prompt_token_ids"),
    ('{"prompt": 5}', "prompt: expected text or a list of chat messages, got int"),
    ("5", "expected a JSON string or object, got int: 5"),
    ("[1, 2]", "expected a JSON string or object, got list"),
    ("{}", "needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'"),
    ('{"prompt_token_ids": "12"}', "prompt_token_ids: expected a list of ints"),
    ('{"prompt_token_ids": []}', "prompt_token_ids: the prompt is empty (0 tokens)"),
    ('{"prompt": [{"role": "user"}]}', "prompt.messages[0].content: expected text or a list of content parts"),
    ('{"prompt": [{"role": "user", "content": [{"type": "hologram"}]}]}', "messages[0].content[0]: expected a dict"),
    ('{"prompt": "x", "multi_modal_data": {"audio": [[[0.1], 16000, 1]]}}', "multi_modal_data.audio[0]"),
    ('{"prompt": "x", "request_id": 7}', "request_id: expected a str, got int"),
    # inline arrays: their shape is checked now, not by the stage once the models have loaded
    ('{"prompt": "x", "multi_modal_data": {"image": 5}}',
     "multi_modal_data.image[0]: expected a file path, or an HxW or HxWxC array with C in (1, 3, 4), got shape ()"),
    ('{"prompt": "x", "multi_modal_data": {"image": [[[[0, 0, 0, 0, 0]]]]}}', "image[0]: expected a file path, or an HxW"),
    ('{"prompt": "x", "multi_modal_data": {"audio": [[[0.1, 0.2]]]}}',
     "multi_modal_data.audio[0]: expected a file path, or a mono 1-D waveform, got shape (1, 2)"),
    ('{"prompt": "x", "request_id": "fine"}', "request_id: 'fine' is already used on line 1"),
    ("{oops", "invalid JSON"),
])
def test_bad_prompts_file_line_exits_2_naming_the_line(tmp_path, capsys, no_engines, line, expected):
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(yaml.safe_dump(chain_config()))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine", "request_id": "fine"}\n\n' + line + "\n")  # the bad one is on line 3
    # Refused before anything starts: `no_engines` fails the test if a stage is built (no clock needed).
    assert cli.main(["run", str(cfg), "--prompts-file", str(prompts)]) == 2
    err = one_line_error(capsys)
    assert f"--prompts-file {prompts}:3: " in err and expected in err, err


@pytest.mark.parametrize("media,expected", [
    ({"audio": "nope.wav"}, "multi_modal_data.audio[0]: no such file: {dir}/nope.wav"),
    ({"audio": ["clip.wav", "text.wav"]},
     "multi_modal_data.audio[1]: {dir}/text.wav: not a readable audio file (WAV, FLAC, OGG or MP3)"),
    ({"image": "clip.wav"}, "multi_modal_data.image[0]: {dir}/clip.wav: not a readable image (PNG, JPEG"),
    ({"image": ["sub"]}, "multi_modal_data.image[0]: not a file: {dir}/sub"),
    ({"image": ""}, "multi_modal_data.image[0]: expected a file path, got an empty string"),
    ({"video": "nope.mp4"}, "multi_modal_data.video[0]: no such file: {dir}/nope.mp4"),
    ({"video": ["clip.wav"]}, "multi_modal_data.video[0]: {dir}/clip.wav: the file holds no video stream"),
    ({"video": "text.wav"}, "multi_modal_data.video[0]: {dir}/text.wav: not a readable video file"),
])
def test_a_bad_media_file_exits_2_naming_the_line_field_and_file(tmp_path, capsys, no_engines, media, expected):
    from tests.serve.realtime_utils import speech_wav

    folder = tmp_path / "prompts"  # the paths are relative to the prompts file's folder, not the cwd
    (folder / "sub").mkdir(parents=True)
    shutil.copy(speech_wav(), folder / "clip.wav")
    (folder / "text.wav").write_text("not audio")
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(yaml.safe_dump(chain_config()))
    prompts = folder / "p.jsonl"
    prompts.write_text('"fine"\n' + json.dumps({"prompt": "x", "multi_modal_data": media}) + "\n")
    # Refused before anything starts: `no_engines` fails the test if a stage is built.
    assert cli.main(["run", str(cfg), "--prompts-file", str(prompts)]) == 2
    err = one_line_error(capsys)
    assert f"--prompts-file {prompts}:2: " + expected.format(dir=folder) in err, err


@pytest.mark.parametrize("command,value", [("plan", "inf"), ("serve", "inf"), ("run", "nan"), ("run", "0")])
def test_memory_gb_is_refused_in_gib_before_anything_loads(tmp_path, capsys, no_engines, command, value):
    """--memory-gb is in GiB: what it cannot be is said in GiB, as typed (inf crashed the plan converting it to
    bytes, a traceback instead of this line)."""
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(yaml.safe_dump(chain_config()))
    extra = ["--prompt", "hi"] if command == "run" else []
    assert cli.main([command, str(cfg), "--memory-gb", value, *extra]) == 2
    assert one_line_error(capsys) == f"error: --memory-gb: expected a finite number of GiB > 0 (got {value})"


def test_an_empty_prompt_is_refused_before_anything_loads(tmp_path, capsys, no_engines):
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(yaml.safe_dump(chain_config()))
    assert cli.main(["run", str(cfg), "--prompt", "hi", "--prompt", "  "]) == 2
    assert one_line_error(capsys) == "error: --prompt: prompt 2 is empty"


@pytest.mark.parametrize("stage,expected", [
    (real_stage("a", model_path="/nonexistent/model"),
     "stage 'a': model_path: model path '/nonexistent/model' does not exist"),
    (real_stage("a", model_path="builtin:tiny-gpt"), "stage 'a': model_path: unknown builtin model 'tiny-gpt'"),
    (real_stage("a", tokenizer="/nonexistent/tok"), "stage 'a': tokenizer: tokenizer path '/nonexistent/tok'"),
    (real_stage("a", cache={"block_size": True}), "stage 'a': cache.block_size: expected a number, got true"),
    (real_stage("a", inputs=[5], cache={"memory_budget_mb": "lots"}),
     "stage 'a': inputs[0]: expected a string or an object (got 5); "
     'stage \'a\': cache.memory_budget_mb: expected a number or "auto" (got "lots")'),
    (real_stage("a", enable_prefix_caching=1), "stage 'a': enable_prefix_caching: expected true or false (got 1)"),
])
@pytest.mark.parametrize("command", ["validate", "run"])
def test_config_errors_exit_2_before_anything_starts(tmp_path, capsys, no_engines, command, stage, expected):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"runtime": {"backend": "local"}, "stages": [{**stage, "final_output": "text"}]}))
    # Before anything starts: `no_engines` fails the test if a stage is built (no clock needed).
    assert cli.main([command, str(cfg), *(["--prompt", "hi"] if command == "run" else [])]) == 2
    assert expected in one_line_error(capsys)


@pytest.mark.parametrize("overrides,expected", [
    ('{"talker": {"inputs": [7]}}', "stage 'talker': inputs[0]: expected a string or an object (got 7)"),
    ('{"thinker": {"cache": {"memory_budget_mb": "lots"}}}',
     'stage \'thinker\': cache.memory_budget_mb: expected a number or "auto" (got "lots")'),
    ('{"thinker": {"enable_prefix_caching": "yes"}}',
     "stage 'thinker': enable_prefix_caching: expected true or false (got 'yes')"),
])
def test_stage_overrides_errors_exit_2_naming_the_field(tmp_path, capsys, no_engines, overrides, expected):
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(yaml.safe_dump(chain_config()))
    assert cli.main(["run", str(cfg), "--prompt", "hi", "--stage-overrides", overrides]) == 2
    assert one_line_error(capsys) == f"error: {expected}"


def test_duplicate_yaml_key_names_both_lines(tmp_path, capsys):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("stages:\n  - name: a\n    model_path: builtin:tiny-qwen2\n    final_output: text\n"
                   "    cache: {block_size: 4}\n    cache: {num_blocks: 8}\n")
    assert cli.main(["validate", str(cfg)]) == 2
    assert f"{cfg}:6: invalid YAML: duplicate key 'cache' (first on line 5)" in one_line_error(capsys)


def test_unreadable_config_exits_2(tmp_path, capsys):
    cfg = tmp_path / "binary.yaml"
    cfg.write_bytes(b"stages: \xff\xfe\n")
    assert cli.main(["validate", str(cfg)]) == 2
    assert f"{cfg}: cannot read the config" in one_line_error(capsys)


def test_validate_checks_the_shipped_configs_paths():
    for name in ("tiny_chain", "qwen2_5_omni_tiny", "fan_out"):
        assert cli.main(["validate", str(REPO / "stage_configs" / f"{name}.yaml")]) == 0


def test_paths_on_a_cluster_are_left_to_its_nodes(tmp_path, capsys):
    cfg = tmp_path / "remote.yaml"
    cfg.write_text(yaml.safe_dump({"runtime": {"ray_address": "ray://head:10001"},
                                   "stages": [real_stage("a", model_path="/models/only/on/the/gpu/nodes",
                                                         final_output="text")]}))
    assert cli.main(["validate", str(cfg)]) == 0
    assert "model paths: not checked here (the stages run on the Ray cluster at ray://head:10001)" in \
        capsys.readouterr().out


# ------------------------------------------------------------------ signals
# A terminal delivers Ctrl-C to a process whose SIGINT is Python's default handler; a process
# started in the background of a non-interactive shell inherits SIGINT ignored, so restore it. The
# pipeline's engines are the fake ones (tests/fakes.py, in the stage actors too: Omni's engine_factory
# defaults to fake_factory in this process) and the prompts "__hang__": they never finish, so the
# signal comes while they run however fast the machine is.
_LAUNCH = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "import omni.api, tests.fakes; _init = omni.api.Omni.__init__; "
           "omni.api.Omni.__init__ = lambda self, *a, **kw: _init(self, *a, **{'engine_factory': "
           "tests.fakes.fake_factory, **kw}); "
           "from omni.cli import main; sys.exit(main(sys.argv[1:]))")


def run_and_signal(sig: int, backend: str) -> tuple[int, str, float]:
    """Start `omni run` on requests that never finish, send `sig` once it is generating; (exit status,
    stderr, seconds to exit)."""
    args = [sys.executable, "-c", _LAUNCH, "run", "stage_configs/tiny_chain.yaml", "--backend", backend,
            *[a for i in range(8) for a in ("--prompt", f"__hang__ {i}")]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = ""
    try:
        deadline = time.monotonic() + 120
        while "Processed prompts" not in err and time.monotonic() < deadline:
            err += proc.stderr.read(1)  # the progress bar shows once generate() runs
            assert err or proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=60)
        return proc.returncode, err + rest, time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig,code,message", [
    (signal.SIGINT, 130, "omni: interrupted (Ctrl-C)"),
    (signal.SIGTERM, 143, "omni: terminated (SIGTERM)"),
])
def test_signals_exit_quietly(tmp_path, capsys, monkeypatch, sig, code, message):
    """In this process, with fake engines: the signal comes while `omni run` waits on a request."""
    import omni.pipeline.engine_factory as engine_factory
    from tests.fakes import fake_factory

    def factory(stage):
        engine = fake_factory(stage)
        if stage.name == "thinker":
            step = engine.step

            def signalling_step():  # the signal comes while the request runs: not after a guessed delay
                if engine.steps == 0:
                    os.kill(os.getpid(), sig)
                return step()

            engine.step = signalling_step
        return engine

    monkeypatch.setattr(engine_factory, "build_engine", factory)
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(yaml.safe_dump(chain_config(request_timeout_s=60)))
    previous = signal.getsignal(signal.SIGTERM)
    # A suite started as a background job (`make test &` from a script) inherits SIGINT ignored, and Python keeps
    # it ignored: Ctrl-C's handler here is the one an interactive `omni run` has.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # __hang__ never finishes; an ignored signal would end in the 60 s request timeout's message instead.
        rc = cli.main(["run", str(cfg), "--prompt", "__hang__", "--json"])
    finally:
        signal.signal(signal.SIGINT, previous_int)
    assert rc == code
    err = capsys.readouterr().err
    assert err.strip() == message, err
    assert signal.getsignal(signal.SIGTERM) is previous  # restored


@pytest.mark.slow
@pytest.mark.ray
def test_sigterm_on_ray_closes_the_pipeline_quietly():
    """Ray's blocking calls only let a KeyboardInterrupt through: SIGTERM must take that way out."""
    rc, err, _ = run_and_signal(signal.SIGTERM, "ray")
    assert rc == 143, err[-2000:]
    assert "Traceback" not in err and err.rstrip().endswith("omni: terminated (SIGTERM)"), err[-2000:]
    # A pipeline that does not close is caught by run_and_signal's communicate(timeout=60), ~10x the
    # few seconds a Ray shutdown takes; the time it took is not compared to a machine-dependent figure.
