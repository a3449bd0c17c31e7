"""What the `omni` commands share (the CLI and serve/launch.py both import it, neither imports the other): the
exit-status convention of an error. Loading a config checked against this machine is omni/config/checked.py's."""
from __future__ import annotations

import sys


def error(msg: str, code: int = 2) -> int:
    """Print one `error: ...` line on stderr; the exit status (2: bad config, prompts or usage; 1: failed)."""
    print(f"error: {msg}", file=sys.stderr)
    return code
