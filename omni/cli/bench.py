"""`omni bench NAME [ARGS ...]`: one benchmark of omni/bench/, its own options after its name; its result
printed as ONE JSON object on the last line."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from omni.cli.jsonable import dumps
from omni.commands import error

# bench name -> module in omni/bench/ (imported only when that bench runs)
BENCHES = {
    "kv": "kv",
    "kernels": "kernels",
    "throughput": "throughput",
    "prefix": "prefix",
    "tensor-cache": "tensor_cache",
    "pipeline": "pipeline",
    "omni": "omni_bench",
    "token2wav": "token2wav",
    "streaming": "streaming",
    "routing": "routing",
    "serve": "serve",
    "capacity": "capacity",
    "plan": "plan",
    "realtime": "realtime",
    "tts": "tts",
    "qwen3-vs-hf": "qwen3_vs_hf",
    "head": "head",
    "cuda-graphs": "cuda_graphs",
}


def add_parser(sub: Any) -> None:
    # The bench's own options follow its name (`omni bench kv --help` is the kv bench's help), so this
    # parser takes only -h/--help itself: `omni bench --help` lists the benchmarks (cmd_bench).
    bench = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHES), add_help=False)
    bench.add_argument("-h", "--help", action="store_true", dest="bench_help", help="list the benchmarks")
    bench.add_argument("name", nargs="?", help=", ".join(BENCHES))
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(command_fn=cmd_bench)


def bench_summary(name: str) -> str:
    """The first line of a benchmark module's docstring, read from its source (nothing is imported: the
    list must not wait for torch)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(f"omni.bench.{BENCHES[name]}")
    if spec is None or spec.origin is None:
        return "(not available)"
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
    line = doc.strip().splitlines()[0] if doc.strip() else ""
    return line.split(": ", 1)[1] if line.startswith("`omni bench") and ": " in line else line


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_help or not args.name:
        width = max(map(len, BENCHES))
        print("usage: omni bench NAME [ARGS ...]   (omni bench NAME --help: that benchmark's options)\n\n"
              "benchmarks:\n" + "\n".join(f"  {n:<{width}}  {bench_summary(n)}" for n in BENCHES))
        return 0 if args.bench_help else 2
    if args.name not in BENCHES:
        return error(f"unknown benchmark {args.name!r} (choose from: {', '.join(BENCHES)})")
    module_name = f"omni.bench.{BENCHES[args.name]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return error(f"benchmark {args.name!r} is not available ({module_name} not found)")
        raise
    parser = argparse.ArgumentParser(prog=f"omni bench {args.name}", description=module.__doc__)
    module.add_arguments(parser)
    bench_args = parser.parse_args(args.args)
    from omni.errors import ConfigError

    try:
        result = module.run(bench_args)
    except ConfigError as e:  # the config or --stage-overrides given: an error message, not a traceback
        return error(str(e))
    sys.stdout.flush()
    print(dumps(result), flush=True)
    return 0
