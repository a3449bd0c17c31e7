"""`omni run CONFIG`: prompts through a pipeline, each stage's final output printed (or one JSON object),
audio written as WAV files whose paths are printed."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from omni.cli.jsonable import dumps
from omni.cli.options import config_arguments
from omni.cli.run_outputs import DEFAULT_AUDIO_DIR, stage_record, write_outputs, write_wavs
from omni.cli.run_prompts import read_prompts
from omni.cli.run_stream import run_streaming
from omni.commands import error
from omni.config.checked import load_checked


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run prompts through a pipeline")
    config_arguments(run)
    run.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    run.add_argument("--prompts-file", type=Path,
                     help="one prompt per line, or .jsonl: a JSON string or object per line, as the Python API "
                          'takes it: {"prompt": "What is said here?", "multi_modal_data": {"audio": "clip.wav"}}; '
                          "under multi_modal_data, image (PNG, JPEG, WEBP, GIF, BMP) and audio (WAV, FLAC, OGG, "
                          "MP3: read at its own sampling rate) name files, relative to the prompts file's folder, "
                          'one or a list ({"image": ["a.png", "b.png"]}); every line and file is checked before '
                          "anything loads")
    run.add_argument("--output-dir", type=Path,
                     help="write results.jsonl and per-stage text/audio/hidden files, {prompt:04d}_{stage}.txt/"
                          f".wav/.npy (without it, audio still goes to ./{DEFAULT_AUDIO_DIR}/ as "
                          "{prompt:04d}_{stage}.wav; each file's path is printed)")
    run.add_argument("--max-tokens", type=int, help="max_tokens for every stage (overrides the config)")
    run.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend")
    run.add_argument("--json", action="store_true", help="print the results as one JSON object (an audio "
                                                         "output's file is its audio_file)")
    run.add_argument("--stream", action="store_true",
                     help="print each stage's text as it is generated (stderr when --json) and write audio "
                          "to a WAV file as its chunks arrive, or once when it comes whole, "
                          f"{{prompt:04d}}_{{stage}}.stream.wav (in --output-dir, default ./{DEFAULT_AUDIO_DIR}/)")
    run.set_defaults(command_fn=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from omni.api import Omni
    from omni.errors import ConfigError, OmniError

    try:
        prompts = read_prompts(args)
        cfg, _ = load_checked(args.config, args.stage_overrides, args.memory_gb)
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    except (ConfigError, ValueError) as e:
        return error(str(e))
    sampling = None
    if args.max_tokens is not None:
        sampling = {s.name: {"max_tokens": args.max_tokens} for s in cfg.stages}
    audio_dir = args.output_dir or DEFAULT_AUDIO_DIR
    audio_files: dict[tuple[int, str], Path] = {}
    try:
        with Omni(cfg, backend=args.backend) as omni:
            if args.stream:
                outputs, audio_files = run_streaming(omni, prompts, sampling,
                                                     sys.stderr if args.json else sys.stdout, audio_dir)
            else:
                outputs = omni.generate(prompts, sampling, use_tqdm=not args.json)
            stats = omni.stats()
    except ConfigError as e:
        return error(str(e))
    except OmniError as e:
        return error(str(e), 1)

    if args.output_dir or not args.stream:  # the final waveforms (--stream wrote them as they came)
        audio_files.update(write_wavs(audio_dir, outputs))
    results = [{"request_id": o.request_id, "prompt": o.prompt, "error": None if o.error is None else str(o.error),
                "outputs": {s: stage_record(so, audio_files.get((i, s))) for s, so in o.outputs.items()}}
               for i, o in enumerate(outputs)]
    if args.output_dir:
        write_outputs(args.output_dir, results, outputs)
    if args.json:
        print(dumps({"pipeline": cfg.name, "results": results, "stats": stats}))
    else:
        _print_results(cfg, outputs, audio_files, stats)
        if args.output_dir:
            print(f"wrote {args.output_dir}")
        elif audio_files:
            print(f"audio written to ./{DEFAULT_AUDIO_DIR}/ (--output-dir DIR to choose where)")
    return 1 if any(o.error for o in outputs) else 0


def _print_results(cfg: Any, outputs: list[Any], audio_files: dict[tuple[int, str], Path],
                   stats: dict[str, Any]) -> None:
    for i, o in enumerate(outputs):
        print(f"[{i}] {o.prompt!r}")
        if o.error:
            print(f"  error: {o.error}")
        for stage, so in o.outputs.items():
            kind = cfg.stage(stage).final_output
            if kind == "text" and so.text is not None:
                print(f"  {stage} (text): {so.text}")
            elif kind == "audio" and so.audio is not None:
                where = audio_files.get((i, stage))
                print(f"  {stage} (audio): {np.asarray(so.audio).size} samples"
                      + (f" -> {where}" if where is not None else ""))
            elif kind == "hidden" and so.hidden_states is not None:
                print(f"  {stage} (hidden): shape {list(np.asarray(so.hidden_states).shape)}")
            else:
                print(f"  {stage} (tokens): {so.token_ids}")
    for name, s in stats["stages"].items():
        hit, ttft = s.get("prefix_cache_hit_rate"), s.get("ttft_mean_s")
        print(f"stage {name}: prefix cache hit rate "
              f"{hit if hit is None else format(hit, '.2f')}, mean TTFT "
              f"{'-' if ttft is None else format(ttft * 1000, '.1f') + ' ms'}")
