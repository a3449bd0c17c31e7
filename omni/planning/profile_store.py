"""Measurements `omni plan` took, kept for the plans made without loading anything.

A profile step (profile.py) loads the stage's model and runs one step at its batch limits; that
takes seconds to minutes, so `omni validate`, `omni run` and `omni serve` do not repeat it: they read
what the last `omni plan` measured for the same stage. The key is everything the measurement depends
on (the model, its checkpoint files' sizes and times, dtype, device kind, batch limits, model kwargs),
so a changed checkpoint or config is measured again rather than read stale.

One JSON file per key under `$OMNI_PROFILE_DIR`, else `$OMNI_CACHE_DIR/profiles/` (default ~/.cache/omni),
written atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omni.config.schema import StageConfig

_VERSION = 1


@dataclass(frozen=True, slots=True)
class ProfileRecord:
    activations: int  # AR stages: the profile step's peak above what was allocated before it; one-shot: working memory
    rows_per_token: dict[str, int] = field(default_factory=dict)  # per-token outputs the step emitted
    weights_loaded: int = 0  # the loaded model's parameters and buffers
    meter: str = ""  # how the peak was read ("peak RSS (VmHWM)", "torch.cuda.max_memory_allocated")
    seconds: float = 0.0


def _files_fingerprint(path: Path) -> list[Any]:
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in (".json", ".safetensors"))
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def profile_key(stage: StageConfig, model_path: Path, device: str) -> str:
    s = stage.scheduler
    parts = {
        "v": _VERSION, "model": stage.model, "path": str(model_path), "files": _files_fingerprint(Path(model_path)),
        "dtype": stage.dtype, "device": device, "tokens": s.max_num_batched_tokens, "seqs": s.max_num_seqs,
        "max_model_len": s.max_model_len, "block_size": stage.cache.block_size,
        "model_kwargs": json.dumps(stage.model_kwargs, sort_keys=True, default=str),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def default_dir() -> Path:
    """$OMNI_PROFILE_DIR, else profiles/ in $OMNI_CACHE_DIR (default ~/.cache/omni)."""
    if os.environ.get("OMNI_PROFILE_DIR"):
        return Path(os.path.expanduser(os.environ["OMNI_PROFILE_DIR"]))
    root = os.environ.get("OMNI_CACHE_DIR") or Path.home() / ".cache" / "omni"
    return Path(os.path.expanduser(os.fspath(root))) / "profiles"


class ProfileStore:
    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = Path(directory) if directory is not None else default_dir()

    def get(self, key: str) -> ProfileRecord | None:
        try:
            data = json.loads((self.directory / f"{key}.json").read_text())
            return ProfileRecord(**data)
        except (OSError, ValueError, TypeError):
            return None  # absent or unreadable: measured again by the next omni plan

    def put(self, key: str, record: ProfileRecord) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self.directory / f"{key}.json")
