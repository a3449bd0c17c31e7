"""`omni plan`, `omni validate` and `omni run` with a memory budget."""
import json

import pytest
import yaml

from omni import cli
from omni.cli.entry import build_parser


def _write(tmp_path, budget_gb=None, auto=True, **runtime):
    cfg = yaml.safe_load(open("stage_configs/tiny_chain.yaml"))
    cfg["runtime"].update(runtime)
    if budget_gb is not None:
        cfg["runtime"]["memory"] = {"budget_gb": budget_gb}
    if auto:
        for s in cfg["stages"]:
            s["cache"] = {"block_size": 4, "memory_budget_mb": "auto"}
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_plan_json_without_profiling(tmp_path, store, capsys):
    rc = cli.main(["plan", _write(tmp_path), "--memory-gb", "0.5", "--no-profile", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["fits"] and out["devices"]["cpu"]["budget_bytes"] == 2**29
    th = out["stages"]["thinker"]
    assert th["auto"] and th["kv_blocks"] > 0 and th["kv_bytes"] == th["kv_blocks"] * th["kv_bytes_per_block"]
    assert th["activations_source"] == "estimated" and th["weights_source"] == "safetensors headers"
    assert out["devices"]["cpu"]["used_bytes"] <= out["devices"]["cpu"]["budget_bytes"]


@pytest.mark.slow
def test_plan_profiles_then_prints_the_table(tmp_path, store, capsys):
    rc = cli.main(["plan", _write(tmp_path), "--memory-gb", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "device cpu: budget 0.50 GiB (--memory-gb 0.5)" in out and "OK: the plan fits" in out
    assert "est" not in out.split("device cpu")[1].split("OK")[0]  # both stages measured
    # the measurement is kept: an arithmetic plan (validate) now uses it
    assert cli.main(["validate", _write(tmp_path, budget_gb=0.5)]) == 0
    assert "not measured yet" not in capsys.readouterr().out


def test_refused_plan_exits_2_naming_the_stage(tmp_path, store, capsys):
    assert cli.main(["plan", _write(tmp_path), "--memory-gb", "0.1", "--no-profile"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "error: stage 'thinker' does not fit on cpu" in captured.err
    assert cli.main(["validate", _write(tmp_path, budget_gb=0.1)]) == 2
    assert "does not fit on cpu" in capsys.readouterr().err
    assert cli.main(["run", _write(tmp_path), "--memory-gb", "0.1", "--prompt", "hi", "--backend", "local"]) == 2
    assert "error: stage 'thinker' does not fit on cpu" in capsys.readouterr().err


def test_run_with_a_budget_and_a_workload(tmp_path, store, capsys):
    path = _write(tmp_path, budget_gb=0.5, plan={"concurrent_conversations": 2, "context_tokens": 32})
    rc = cli.main(["run", path, "--prompt", "Hello", "--backend", "local", "--json", "--max-tokens", "4"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["results"][0]["error"] is None
    from omni.config.checked import load_checked
    from omni.planning.plan import plan_memory

    plan = plan_memory(load_checked(path, None)[0])  # the same arithmetic: the same block counts
    for name in ("thinker", "talker"):
        assert out["stats"]["stages"][name]["num_blocks"] == plan.stages[name].num_blocks > 0


def test_validate_without_a_budget_plans_nothing(tmp_path, capsys):
    assert cli.main(["validate", "stage_configs/tiny_chain.yaml"]) == 0
    assert "memory plan" not in capsys.readouterr().out


def test_memory_gb_is_an_option_of_every_config_command():
    parser = build_parser()
    for cmd in ("run", "validate", "plan", "serve"):
        assert parser.parse_args([cmd, "x.yaml", "--memory-gb", "1.5"]).memory_gb == 1.5


def test_an_unplanned_auto_stage_is_refused_by_the_engine_factory():
    from omni.config.loader import load_config
    from omni.errors import ConfigError
    from omni.pipeline.engine_factory import build_engine

    cfg = load_config("stage_configs/tiny_chain.yaml", {"thinker": {"cache": {"num_blocks": None,
                                                                             "memory_budget_mb": "auto"}}})
    with pytest.raises(ConfigError, match="'auto' takes the memory plan's number"):
        build_engine(cfg.stage("thinker"))


def test_plan_shows_progress_while_it_profiles(tmp_path, store, capsys, monkeypatch):
    """Profiling a real model takes minutes: a bar on stderr says which stage is being profiled (stdout keeps
    the plan alone)."""
    import omni.planning.profile as profile

    seen = []

    def profile_stage(config, name, meter=None):
        seen.append(name)
        raise RuntimeError("not measured in this test")

    monkeypatch.setattr(profile, "profile_stage", profile_stage)
    rc = cli.main(["plan", _write(tmp_path), "--memory-gb", "0.5", "--json"])
    captured = capsys.readouterr()
    assert rc == 0 and seen == ["thinker", "talker"]
    json.loads(captured.out.strip().splitlines()[-1])
    assert "Profiling stages" in captured.err and "2/2" in captured.err, captured.err
    assert "thinker: loading" in captured.err and "talker: loading" in captured.err, captured.err
