"""`omni validate CONFIG`: the config checked (schema, graph, paths, memory plan) and its graph printed,
nothing loaded."""
from __future__ import annotations

import argparse
from typing import Any

from omni.cli.jsonable import dumps
from omni.cli.options import config_arguments
from omni.commands import error
from omni.config.checked import load_checked


def add_parser(sub: Any) -> None:
    val = sub.add_parser("validate", help="validate a pipeline config and print its graph")
    config_arguments(val)
    val.add_argument("--json", action="store_true", help="print the validated config as JSON")
    val.set_defaults(command_fn=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from omni.errors import ConfigError
    from omni.pipeline.graph import StageGraph

    try:
        cfg, cluster = load_checked(args.config, args.stage_overrides, args.memory_gb)
        memory_plan = validate_plan(cfg)
    except ConfigError as e:
        return error(str(e))
    if args.json:
        print(dumps(cfg.model_dump(mode="json")))
        return 0
    graph = StageGraph.of(cfg)
    rt = cfg.runtime
    print(f"pipeline {cfg.name!r}: {len(graph)} stage(s), backend={rt.backend}"
          + (f", ray_address={rt.ray_address}" if rt.ray_address else ""))
    print(graph.summary())
    print(f"entry: {', '.join(graph.entry_stages)}; final outputs: "
          + ", ".join(f"{n} ({graph.stages[n].final_output})" for n in graph.final_stages))
    if cluster is not None:
        print(f"model paths: not checked here (the stages run on the Ray cluster at {cluster})")
    if memory_plan is not None:
        print(memory_plan)
    print("OK")
    return 0


def validate_plan(cfg: Any) -> str | None:
    """The arithmetic memory plan of a config that declares a budget or a workload (nothing is loaded;
    no torch is imported for a config that declares neither). Raises MemoryPlanError when it does not fit."""
    from omni.planning.needs import uses_plan

    if not uses_plan(cfg):
        return None
    from omni.planning.plan import plan_memory
    from omni.planning.report import render

    plan = plan_memory(cfg)
    plan.raise_if_refused()
    return render(plan)
