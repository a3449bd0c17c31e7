"""`omni plan CONFIG`: the stages' memory planned against one budget per device (profiling each stage
unless --no-profile), printed as a table or one JSON object."""
from __future__ import annotations

import argparse
from typing import Any

from omni.cli.jsonable import dumps
from omni.cli.options import config_arguments
from omni.commands import error
from omni.config.checked import load_checked


def add_parser(sub: Any) -> None:
    plan = sub.add_parser("plan", help="plan the stages' memory: one budget per device (weights, activations, "
                          "KV blocks, tensor cache), and whether it fits")
    config_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument("--no-profile", action="store_true",
                      help="arithmetic only: load no model (activations as measured by an earlier omni plan, "
                           "else estimated)")
    plan.set_defaults(command_fn=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from omni.errors import ConfigError

    try:
        cfg, _ = load_checked(args.config, args.stage_overrides, args.memory_gb)
        from omni.planning.plan import plan_memory
        from omni.planning.profile import profile_pipeline
        from omni.planning.profile_store import ProfileStore
        from omni.planning.report import as_dict, render

        store = ProfileStore()
        failed = []
        if not args.no_profile:
            failed = [r for r in profile_pipeline(cfg, store, progress=True) if r.error]
        plan = plan_memory(cfg, memory_gb=args.memory_gb, store=store)
    except ConfigError as e:
        return error(str(e))
    if args.json:
        out = as_dict(plan)
        out["profile_errors"] = {r.stage: r.error for r in failed}
        print(dumps(out))
    else:
        print(render(plan))
        for r in failed:
            print(f"stage {r.stage}: could not be profiled ({r.error}); its activations are estimated")
    return 0 if plan.fits else error(str(plan.errors[0]))
