"""The options every subcommand that takes a pipeline config shares (run, validate, plan, serve)."""
from __future__ import annotations

import argparse


def config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="pipeline YAML (see stage_configs/)")
    p.add_argument("--stage-overrides", metavar="JSON",
                   help='per-stage overrides, e.g. \'{"talker": {"enable_prefix_caching": false}}\'')
    p.add_argument("--memory-gb", type=float, metavar="N",
                   help="the memory budget of each device the stages use, in GiB (runtime.memory.budget_gb): "
                        "the stages are planned to fit it (omni plan), and a plan that does not fit is refused")
