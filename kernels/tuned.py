"""Launch configurations tuned on real GPUs, read from ``kernels/configs/``.

``omni bench kernels --sweep --write-config`` times a grid of tile/warp/stage
choices per workload class on the GPU it runs on and merges the fastest into
``kernels/configs/paged_attention.json``::

    {"NVIDIA H100 80GB HBM3": {"bf16/d128": {"decode":  {"block_m": 16, "tile": 64, ...},
                                             "prefill": {"block_m": 128, ...}}}}

At launch time the paged-attention heuristic asks ``lookup`` first and falls
back to its own defaults for GPUs, dtypes or head sizes nobody has tuned
(so a new GPU still runs, just untuned). The file is read once per process.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ATTENTION_FILE = CONFIG_DIR / "paged_attention.json"
KINDS = ("decode", "prefill")
FIELDS = ("block_m", "tile", "num_warps", "num_stages")


def shape_key(dtype_name: str, head_dim_pad: int) -> str:
    return f"{dtype_name}/d{head_dim_pad}"


@lru_cache(maxsize=None)
def _load(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        return {}
    return json.loads(p.read_text())


def lookup(gpu_name: str, dtype_name: str, head_dim_pad: int, kind: str,
           path: Path = ATTENTION_FILE) -> tuple[int, int, int, int] | None:
    """(block_m, tile, num_warps, num_stages) tuned for this GPU and shape, or None."""
    entry = _load(str(path)).get(gpu_name, {}).get(shape_key(dtype_name, head_dim_pad), {}).get(kind)
    if not entry:
        return None
    return tuple(int(entry[f]) for f in FIELDS)  # type: ignore[return-value]


def merge(gpu_name: str, dtype_name: str, head_dim_pad: int, best: dict[str, dict],
          path: Path = ATTENTION_FILE) -> dict:
    """Write ``best`` ({kind: config dict}) for this GPU and shape into the file; returns the file's content."""
    for kind, cfg in best.items():
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        missing = [f for f in FIELDS if cfg.get(f) is None]
        if missing:
            raise ValueError(f"{kind} config lacks {missing}: {cfg}")
    data = json.loads(path.read_text()) if path.is_file() else {}
    slot = data.setdefault(gpu_name, {}).setdefault(shape_key(dtype_name, head_dim_pad), {})
    for kind, cfg in best.items():
        slot[kind] = {f: int(cfg[f]) for f in FIELDS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    _load.cache_clear()
    return data
