"""The `omni` command's parser and entry: each subcommand's module adds its parser (which names the function
that runs it); `main` runs one, turning Ctrl-C and SIGTERM into one line and an exit status."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from omni.cli import bench, plan, run, serve, validate

SUBCOMMANDS = (run, validate, plan, serve, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni", description="Multi-stage omni model pipelines on Ray.")
    parser.add_argument("--version", action="version", version="omni 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,validate,plan,serve,bench}")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


_sigterm_received = threading.Event()


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM takes Ctrl-C's way out, so that the pipeline closes on the way out. A KeyboardInterrupt,
    because that is what Ray's blocking calls let through (any other exception raised in a signal
    handler inside ray.wait surfaces as a SystemError)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not interrupt the cleanup
    _sigterm_received.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return args.command_fn(args)
    except KeyboardInterrupt:
        if _sigterm_received.is_set():
            print("omni: terminated (SIGTERM)", file=sys.stderr)
            return 143
        print("omni: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
