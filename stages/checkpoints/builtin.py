"""Local model checkpoints for tests, demos and benchmarks — no downloads: the table of builtin recipes.

`builtin:NAME` names one recipe below: a "module:function" string (with its arguments) that builds the
checkpoint into the cache (stages/checkpoints/cache.py) on first use and returns its path. A family's recipes
live in its own folder (stages/<family>/checkpoint.py); the table names them as strings, so nothing here imports
a family and checking a name imports no torch.

    builtin:tiny-llama, builtin:tiny-qwen2    stages/checkpoints/tiny_lm.py
    builtin:smollm2                           stages/checkpoints/smollm2.py
    builtin:*-qwen2_5-omni*                   stages/qwen2_5_omni/checkpoint.py
    builtin:*-qwen3-omni*                     stages/qwen3_omni/checkpoint.py
    builtin:*-higgs-audio-v2*                 stages/higgs_audio_v2/checkpoint.py
    builtin:*-qwen3-asr                       stages/qwen3_asr/checkpoint.py

    python -m stages.checkpoints.builtin --all          # warm the cache (used by `make`)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omni.registry import import_target

from stages.checkpoints.cache import CACHE_ENV


@dataclass(frozen=True, slots=True)
class Recipe:
    target: str  # "package.module:function", called as function(*args, cache_dir) -> Path
    args: tuple = ()


RECIPES: dict[str, Recipe] = {
    "tiny-llama": Recipe("stages.checkpoints.tiny_lm:tiny_checkpoint", ("llama",)),
    "tiny-qwen2": Recipe("stages.checkpoints.tiny_lm:tiny_checkpoint", ("qwen2",)),
    "smollm2": Recipe("stages.checkpoints.smollm2:smollm2_path"),
    "tiny-qwen2_5-omni": Recipe("stages.qwen2_5_omni.checkpoint:tiny_omni_checkpoint"),
    "small-qwen2_5-omni": Recipe("stages.qwen2_5_omni.checkpoint:small_omni_checkpoint"),
    "tiny-qwen3-omni": Recipe("stages.qwen3_omni.checkpoint:tiny_qwen3_omni_checkpoint", ("tiny",)),
    "tiny-qwen3-omni-k1g2": Recipe("stages.qwen3_omni.checkpoint:tiny_qwen3_omni_checkpoint", ("k1g2",)),
    "small-qwen3-omni": Recipe("stages.qwen3_omni.checkpoint:tiny_qwen3_omni_checkpoint", ("small",)),
    "tiny-higgs-audio-v2": Recipe("stages.higgs_audio_v2.checkpoint:higgs_checkpoint", ("tiny",)),
    "tiny-higgs-audio-v2-k8": Recipe("stages.higgs_audio_v2.checkpoint:higgs_checkpoint", ("k8",)),
    "small-higgs-audio-v2": Recipe("stages.higgs_audio_v2.checkpoint:higgs_checkpoint", ("small",)),
    "tiny-qwen3-asr": Recipe("stages.qwen3_asr.checkpoint:qwen3_asr_checkpoint", ("tiny",)),
    "small-qwen3-asr": Recipe("stages.qwen3_asr.checkpoint:qwen3_asr_checkpoint", ("small",)),
    "qwen2_5-omni-7b-shapes": Recipe("stages.qwen2_5_omni.checkpoint:shapes_omni_checkpoint"),
}
BUILTIN_MODELS = tuple(RECIPES)


def check_builtin(name: str) -> None:
    """ValueError for a NAME that `builtin:NAME` does not know (builds nothing: for config checks)."""
    if name not in RECIPES:
        raise ValueError(f"unknown builtin model {name!r}; known: " + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS))


def builtin_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached checkpoint `builtin:NAME` (built on first use); omni resolves `builtin:` paths here."""
    check_builtin(name)
    recipe = RECIPES[name]
    return Path(import_target(recipe.target)(*recipe.args, cache_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stages.checkpoints.builtin", description="Build the builtin model checkpoints into the cache."
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"one of {', '.join(BUILTIN_MODELS)}")
    parser.add_argument("--all", action="store_true", help="build every builtin checkpoint")
    parser.add_argument("--cache-dir", default=None, help=f"cache folder (default ${CACHE_ENV} or ~/.cache/omni)")
    args = parser.parse_args(argv)
    names = list(BUILTIN_MODELS) if args.all else [n.removeprefix("builtin:") for n in args.names]
    if not names:
        parser.error("give NAME... or --all")
    for name in names:
        if name not in BUILTIN_MODELS:
            parser.error(f"unknown NAME {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    for name in names:
        start = time.perf_counter()
        path = builtin_path(name, args.cache_dir)
        print(f"builtin:{name}: {path} ({time.perf_counter() - start:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
