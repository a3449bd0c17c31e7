"""The `omni` command: validate, run (local backend, fake engine), bench dispatch."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from omni import cli
from omni.cli.bench import BENCHES
from omni.cli.jsonable import dumps
from tests.fakes import chain_config, expected_tokens, fake_factory, text_ids

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def chain_yaml(tmp_path):
    p = tmp_path / "chain.yaml"
    p.write_text(yaml.safe_dump(chain_config()))
    return p


@pytest.fixture
def fake_engines(monkeypatch):
    """`omni run` builds engines with the default factory: make that the fake engine."""
    import omni.pipeline.engine_factory as engine_factory

    monkeypatch.setattr(engine_factory, "build_engine", fake_factory)


def test_validate_prints_the_graph(chain_yaml, capsys):
    assert cli.main(["validate", str(chain_yaml)]) == 0
    out = capsys.readouterr().out
    assert "pipeline 'fake_chain': 2 stage(s), backend=local" in out
    assert "thinker: fake (unused)  <- <prompt>  prefix_caching=on  final_output=text" in out
    assert "talker: fake (unused)  <- thinker via passthrough_tokens" in out
    assert "entry: thinker; final outputs: thinker (text), talker (tokens)" in out
    assert out.strip().endswith("OK")


def test_validate_with_overrides_and_json(chain_yaml, capsys):
    assert cli.main(["validate", str(chain_yaml), "--stage-overrides",
                     '{"talker": {"enable_prefix_caching": false}}']) == 0
    assert "talker: fake (unused)  <- thinker via passthrough_tokens  prefix_caching=off" in capsys.readouterr().out
    assert cli.main(["validate", str(chain_yaml), "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["name"] for s in data["stages"]] == ["thinker", "talker"]


@pytest.mark.parametrize("overrides,msg", [
    ('{"talkr": {"dtype": "float16"}}', "error: stage_overrides: unknown stage 'talkr'"),
    ('{"talker": {"cache": {"block_size": 0}}}', "error: stage 'talker': cache.block_size: Input should be"),
    ("{nope", "error: stage_overrides: not valid JSON"),
])
def test_validate_errors_exit_2(chain_yaml, capsys, overrides, msg):
    assert cli.main(["validate", str(chain_yaml), "--stage-overrides", overrides]) == 2
    assert msg in capsys.readouterr().err


def test_validate_invalid_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"stages": [{"name": "a", "model": "fake", "model_path": "x"}]}))
    assert cli.main(["validate", str(bad)]) == 2
    assert "error: stages: no final output" in capsys.readouterr().err
    assert cli.main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_console_entry_point_validates_a_shipped_config():
    r = subprocess.run([sys.executable, "-m", "omni.cli", "validate", "stage_configs/fan_out.yaml"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "judge: causal_lm (builtin:tiny-llama)  <- critic_a, critic_b" in r.stdout


def test_run_json_and_output_dir(chain_yaml, tmp_path, capsys, fake_engines):
    out_dir = tmp_path / "out"
    rc = cli.main(["run", str(chain_yaml), "--backend", "local", "--prompt", "hi", "--prompt", "__error__",
                   "--max-tokens", "2", "--json", "--output-dir", str(out_dir)])
    assert rc == 1  # one request failed
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ok, bad = data["results"]
    assert ok["error"] is None and bad["error"] == "stage 'thinker' failed: fake stage error"
    assert ok["outputs"]["thinker"]["token_ids"] == expected_tokens("thinker", text_ids("hi"), 2)
    assert len(ok["outputs"]["talker"]["token_ids"]) == 2  # --max-tokens applies to every stage
    assert "thinker" in data["stats"]["stages"]
    lines = (out_dir / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["request_id"] == ok["request_id"]
    assert (out_dir / "0000_thinker.txt").read_text().startswith("thinker:")


def test_run_human_output_and_prompts_file(chain_yaml, tmp_path, capsys, fake_engines):
    plain = tmp_path / "prompts.txt"
    plain.write_text("first\n\nsecond\n")
    assert cli.main(["run", str(chain_yaml), "--prompts-file", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "[0] 'first'" in out and "[1] 'second'" in out
    assert "  thinker (text): thinker:" in out and "  talker (tokens): [" in out
    assert "stage thinker: prefix cache hit rate 0.00" in out
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('"a"\n{"prompt_token_ids": [1, 2]}\n')
    assert cli.main(["run", str(chain_yaml), "--prompts-file", str(jsonl), "--json"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert results[1]["outputs"]["thinker"]["num_prompt_tokens"] == 2


@pytest.mark.parametrize("args,msg", [
    ([], "error: no prompts: pass --prompt"),
    (["--prompts-file", "/nonexistent/p.txt"], "--prompts-file: no such file"),
    (["--prompt", "x", "--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_run_usage_errors(chain_yaml, capsys, args, msg):
    assert cli.main(["run", str(chain_yaml), *args]) == 2
    assert msg in capsys.readouterr().err


def test_run_bad_jsonl(chain_yaml, tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text("{oops\n")
    assert cli.main(["run", str(chain_yaml), "--prompts-file", str(p)]) == 2
    assert "p.jsonl:1: invalid JSON" in capsys.readouterr().err


def test_bench_dispatch_prints_json_last(monkeypatch, capsys):
    mod = types.ModuleType("omni.bench.kv")
    mod.add_arguments = lambda p: p.add_argument("--n", type=int, default=1)

    def run(args):
        print("a human-readable line")
        return {"n": args.n, "ratio": 1.5}

    mod.run = run
    monkeypatch.setitem(sys.modules, "omni.bench.kv", mod)
    assert cli.main(["bench", "kv", "--n", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "a human-readable line"
    assert json.loads(lines[-1]) == {"n": 3, "ratio": 1.5}


def test_bench_names_map_to_modules():
    assert BENCHES == {"kv": "kv", "kernels": "kernels", "throughput": "throughput", "prefix": "prefix",
                           "tensor-cache": "tensor_cache", "pipeline": "pipeline", "omni": "omni_bench",
                           "token2wav": "token2wav", "streaming": "streaming", "routing": "routing", "serve": "serve",
                           "capacity": "capacity", "plan": "plan",
                           "realtime": "realtime", "tts": "tts", "qwen3-vs-hf": "qwen3_vs_hf", "head": "head",
                           "cuda-graphs": "cuda_graphs"}


def test_bench_errors(monkeypatch, capsys):
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    monkeypatch.setitem(BENCHES, "ghost", "definitely_missing_module")
    assert cli.main(["bench", "ghost"]) == 2
    assert "benchmark 'ghost' is not available" in capsys.readouterr().err
    assert cli.main(["bench"]) == 2
    assert "benchmarks:\n  kv " in capsys.readouterr().out


def test_bench_with_a_bad_stage_override_says_so_without_a_traceback(capsys):
    """The stage name is checked when the pipeline is configured, before any stage starts."""
    assert cli.main(["bench", "capacity", "--config", "stage_configs/qwen2_5_omni_tiny.yaml",
                     "--stage-overrides", '{"tokn2wav": {"replicas": 2}}']) == 2
    err = capsys.readouterr().err
    assert "unknown stage 'tokn2wav' (stages: thinker, talker, token2wav)" in err and "Traceback" not in err
    assert cli.main(["bench", "capacity", "--stage-overrides", "{bad"]) == 2
    assert "stage_overrides: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_lists_every_benchmark_with_one_line(flag, capsys):
    assert cli.main(["bench", flag]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("benchmarks:\n", 1)[1].strip().splitlines()]
    assert listed == list(BENCHES)
    assert "  kv            micro-benchmarks of the prefix-cached KV cache manager." in out
    assert "(not available)" not in out


@pytest.mark.parametrize("argv", [[], ["run"], ["validate"], ["serve"], ["bench", "kv"]])
def test_help_works_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's help exits 0
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    assert "usage: omni" in capsys.readouterr().out


def test_json_encoder_handles_numpy():
    import numpy as np

    assert json.loads(dumps({"a": np.float32(1.5), "b": np.arange(2), "c": {1, 2}})) == \
        {"a": 1.5, "b": [0, 1], "c": [1, 2]}
