"""The cache folder of the builtin checkpoints, and building an entry in it exactly once.

Everything lands in a cache folder (`$OMNI_CACHE_DIR`, default ~/.cache/omni). Each entry is built in a
temporary directory and renamed into place, so a reader never sees a half-written checkpoint, and a file lock
keeps concurrent processes (pytest-xdist workers, Ray actors) from doing the work twice. Directory names carry
a recipe version: change the recipe, bump the version.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CACHE_ENV = "OMNI_CACHE_DIR"
MARKER = "omni_checkpoint.json"  # written last: its presence means "complete"
RECIPE_VERSION = 2  # v2: tokenizer_config.json lists the added tokens (save_tokenizer)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "omni"
    return Path(os.path.expanduser(os.fspath(cache_dir)))


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_once(final: Path, build: Callable[[Path], dict]) -> Path:
    """Return `final`, building it with `build(tmp_dir) -> info` first if it is not complete."""
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _is_complete(final):  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            start = time.perf_counter()
            info = build(tmp)
            info = {"name": final.name, "recipe_version": RECIPE_VERSION,
                    "build_seconds": round(time.perf_counter() - start, 2), **info}
            (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
            _make_readable(tmp)
            if final.exists():  # incomplete leftover from a tool that did not rename atomically
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_tokenizer(tok, directory: Path) -> None:
    """`tok.save_pretrained(directory)`, plus the added tokens in tokenizer_config.json
    (`added_tokens_decoder`), as the hub's checkpoints (Qwen2.5-Omni's, Qwen3-Omni's, SmolLM2's) carry them.
    transformers 5.23 writes them only into tokenizer.json; a config without them sends its loader down a
    legacy path that parses the whole tokenizer.json (18 MB for Qwen2's vocabulary) once more in Python, on
    every load, in every process that loads one (each stage actor, server, CLI)."""
    tok.save_pretrained(directory)
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in sorted(tok.added_tokens_decoder.items())}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _make_readable(tree: Path) -> None:
    # mkdtemp (and some writers) create owner-only entries; the cache may be shared with other users.
    tree.chmod(0o755)
    for path in tree.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
