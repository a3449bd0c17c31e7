"""`omni run`'s prompts: the --prompt values and the --prompts-file lines, every one checked (media files
read, request ids unique) before any model loads."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def read_prompts(args: argparse.Namespace) -> list[Any]:
    """--prompt values and the --prompts-file lines, every one checked before anything loads."""
    from omni.prompt_media import check_inline_media, read_media_paths
    from omni.prompts import to_stage_input

    prompts: list[Any] = list(args.prompt)
    for i, p in enumerate(prompts):
        if not p.strip():  # refused now, not once the models have loaded
            raise ValueError(f"--prompt: prompt {i + 1} is empty")
    if args.prompts_file:
        path: Path = args.prompts_file
        if not path.is_file():
            raise ValueError(f"--prompts-file: no such file: {path}")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompts-file {path}: cannot read it: {e}") from None
        lines = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
        if path.suffix == ".jsonl":
            id_lines: dict[str, int] = {}  # request_id -> the line that named it first
            for i, ln in lines:
                try:
                    prompt = json.loads(ln)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--prompts-file {path}:{i}: invalid JSON: {e}") from None
                if not isinstance(prompt, (str, dict)):
                    raise ValueError(f"--prompts-file {path}:{i}: expected a JSON string or object, "
                                     f"got {type(prompt).__name__}: {ln.strip()[:40]}")
                where = f"--prompts-file {path}:{i}"
                prompt = read_media_paths(prompt, path.parent, where)  # media files read now, not after loading
                # raises ValueError naming the field; inline arrays get the shape check no stage would make
                # until the models have loaded
                check_inline_media(to_stage_input(prompt, where, str), where)
                rid = prompt.get("request_id") if isinstance(prompt, dict) else None
                if rid is not None:
                    if rid in id_lines:  # else the pipeline refuses it only once the models have loaded
                        raise ValueError(f"{where}: request_id: {rid!r} is already used on line {id_lines[rid]}")
                    id_lines[rid] = i
                prompts.append(prompt)
        else:
            prompts.extend(ln for _, ln in lines)
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def prompt_of(prompt: Any) -> Any:
    """What a RequestOutput shows of a prompt, as Omni.generate's do: its text (or chat messages, or token
    ids), not the media read from its files (a waveform would fill the --json output)."""
    if isinstance(prompt, dict):
        return prompt.get("prompt") if prompt.get("prompt") is not None else prompt.get("prompt_token_ids")
    return prompt
