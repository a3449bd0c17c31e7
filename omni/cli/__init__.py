"""The `omni` command: one module per subcommand, each adding its parser and running it.

    omni run CONFIG [--prompt P ...] [--prompts-file F] [--output-dir D]
                    [--stage-overrides JSON] [--max-tokens N] [--backend ray|local] [--json] [--stream]
    omni validate CONFIG [--stage-overrides JSON] [--json]
    omni plan CONFIG [--memory-gb N] [--json] [--no-profile]   (one memory budget per device for every stage)
    omni serve CONFIG [--host 127.0.0.1] [--port 8000] [--stage-overrides JSON] [--api-key KEY] ...
    omni bench NAME [ARGS ...]      (`omni bench --help` lists the benchmarks)

Exit status: 0 success, 1 some request (or a stage) failed, 2 invalid config, prompts file or
usage, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM); the last three print one line.
`omni bench` prints the benchmark's own lines, then its result as ONE JSON object on
the last line.

`main` (entry.py) is the console script (`omni = "omni.cli:main"`) and what tests call.
"""
from omni.cli.entry import main

__all__ = ["main"]
