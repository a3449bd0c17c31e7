"""The `omni` command.

    omni run CONFIG [--prompt P ...] [--prompts-file F] [--output-dir D]
                    [--stage-overrides JSON] [--max-tokens N] [--backend ray|local] [--json] [--stream]
    omni validate CONFIG [--stage-overrides JSON] [--json]
    omni plan CONFIG [--memory-gb N] [--json] [--no-profile]   (one memory budget per device for every stage)
    omni serve CONFIG [--host 127.0.0.1] [--port 8000] [--stage-overrides JSON] [--api-key KEY] ...
    omni bench NAME [ARGS ...]      (kv, kernels, throughput, prefix, tensor-cache, pipeline, omni, token2wav,
                                     streaming, routing, serve, capacity, plan,
                                     realtime, qwen3-vs-hf, head)

Exit status: 0 success, 1 some request (or a stage) failed, 2 invalid config, prompts file or
usage, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM); the last three print one line.
`omni bench` prints the benchmark's own lines, then its result as ONE JSON object on
the last line.
"""
from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading
import wave
from pathlib import Path
from typing import Any

import numpy as np

from omni.commands import error
from omni.config.checked import load_checked
from omni.serve.launch import add_arguments as serve_options
from omni.serve.launch import main as serve_main

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
    "qwen3-vs-hf": "qwen3_vs_hf",
    "head": "head",
    "cuda-graphs": "cuda_graphs",
}
_DEFAULT_SAMPLE_RATE = 24000  # Qwen2.5-Omni's token2wav rate, when a stage does not say


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    if hasattr(o, "model_dump"):
        return o.model_dump()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=_jsonable, separators=(",", ":"))


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="pipeline YAML (see stage_configs/)")
    p.add_argument("--stage-overrides", metavar="JSON",
                   help='per-stage overrides, e.g. \'{"talker": {"enable_prefix_caching": false}}\'')
    p.add_argument("--memory-gb", type=float, metavar="N",
                   help="the memory budget of each device the stages use, in GiB (runtime.memory.budget_gb): "
                        "the stages are planned to fit it (omni plan), and a plan that does not fit is refused")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni", description="Multi-stage omni model pipelines on Ray.")
    parser.add_argument("--version", action="version", version="omni 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,validate,plan,serve,bench}")

    run = sub.add_parser("run", help="run prompts through a pipeline")
    _config_args(run)
    run.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    run.add_argument("--prompts-file", type=Path,
                     help="one prompt per line, or .jsonl: a JSON string or object per line, as the Python API "
                          'takes it: {"prompt": "What is said here?", "multi_modal_data": {"audio": "clip.wav"}}; '
                          "under multi_modal_data, image (PNG, JPEG, WEBP, GIF, BMP) and audio (WAV, FLAC, OGG, "
                          "MP3: read at its own sampling rate) name files, relative to the prompts file's folder, "
                          'one or a list ({"image": ["a.png", "b.png"]}); every line and file is checked before '
                          "anything loads")
    run.add_argument("--output-dir", type=Path, help="write results.jsonl and per-stage text/audio/hidden files")
    run.add_argument("--max-tokens", type=int, help="max_tokens for every stage (overrides the config)")
    run.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend")
    run.add_argument("--json", action="store_true", help="print the results as one JSON object")
    run.add_argument("--stream", action="store_true",
                     help="print each stage's text as it is generated (stderr when --json) and write audio "
                          "to a WAV file as its chunks arrive, or once when it comes whole (in --output-dir, default the "
                          "current directory)")

    val = sub.add_parser("validate", help="validate a pipeline config and print its graph")
    _config_args(val)
    val.add_argument("--json", action="store_true", help="print the validated config as JSON")

    plan = sub.add_parser("plan", help="plan the stages' memory: one budget per device (weights, activations, "
                          "KV blocks, tensor cache), and whether it fits")
    _config_args(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument("--no-profile", action="store_true",
                      help="arithmetic only: load no model (activations as measured by an earlier omni plan, "
                           "else estimated)")

    serve = sub.add_parser("serve", help="serve a pipeline over HTTP with the OpenAI API")
    _config_args(serve)
    serve_options(serve)

    # The bench's own options follow its name (`omni bench kv --help` is the kv bench's help), so this
    # parser takes only -h/--help itself: `omni bench --help` lists the benchmarks (cmd_bench).
    bench = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHES), add_help=False)
    bench.add_argument("-h", "--help", action="store_true", dest="bench_help", help="list the benchmarks")
    bench.add_argument("name", nargs="?", help=", ".join(BENCHES))
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def cmd_validate(args: argparse.Namespace) -> int:
    from omni.errors import ConfigError
    from omni.pipeline.graph import StageGraph

    try:
        cfg, cluster = load_checked(args.config, args.stage_overrides, args.memory_gb)
        memory_plan = validate_plan(cfg)
    except ConfigError as e:
        return error(str(e))
    if args.json:
        print(dumps(cfg.model_dump(mode="json")))
        return 0
    graph = StageGraph.of(cfg)
    rt = cfg.runtime
    print(f"pipeline {cfg.name!r}: {len(graph)} stage(s), backend={rt.backend}"
          + (f", ray_address={rt.ray_address}" if rt.ray_address else ""))
    print(graph.summary())
    print(f"entry: {', '.join(graph.entry_stages)}; final outputs: "
          + ", ".join(f"{n} ({graph.stages[n].final_output})" for n in graph.final_stages))
    if cluster is not None:
        print(f"model paths: not checked here (the stages run on the Ray cluster at {cluster})")
    if memory_plan is not None:
        print(memory_plan)
    print("OK")
    return 0


def validate_plan(cfg: Any) -> str | None:
    """The arithmetic memory plan of a config that declares a budget or a workload (nothing is loaded;
    no torch is imported for a config that declares neither). Raises MemoryPlanError when it does not fit."""
    from omni.planning.needs import uses_plan

    if not uses_plan(cfg):
        return None
    from omni.planning.plan import plan_memory
    from omni.planning.report import render

    plan = plan_memory(cfg)
    plan.raise_if_refused()
    return render(plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from omni.errors import ConfigError

    try:
        cfg, _ = load_checked(args.config, args.stage_overrides, args.memory_gb)
        from omni.planning.plan import plan_memory
        from omni.planning.profile import profile_pipeline
        from omni.planning.profile_store import ProfileStore
        from omni.planning.report import as_dict, render

        store = ProfileStore()
        failed = []
        if not args.no_profile:
            failed = [r for r in profile_pipeline(cfg, store) if r.error]
        plan = plan_memory(cfg, memory_gb=args.memory_gb, store=store)
    except ConfigError as e:
        return error(str(e))
    if args.json:
        out = as_dict(plan)
        out["profile_errors"] = {r.stage: r.error for r in failed}
        print(dumps(out))
    else:
        print(render(plan))
        for r in failed:
            print(f"stage {r.stage}: could not be profiled ({r.error}); its activations are estimated")
    return 0 if plan.fits else error(str(plan.errors[0]))


# ------------------------------------------------------------------------ run
def _read_prompts(args: argparse.Namespace) -> list[Any]:
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


def _stage_record(out: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
        "num_prompt_tokens": len(out.prompt_token_ids), "num_cached_tokens": out.num_cached_tokens,
        "metrics": out.metrics,
    }
    if out.audio is not None:
        rec["audio_samples"] = int(np.asarray(out.audio).size)
    if out.hidden_states is not None:
        rec["hidden_states_shape"] = list(np.asarray(out.hidden_states).shape)
    return rec


def _write_wav(path: Path, audio: np.ndarray, rate: int) -> None:
    from omni.serve.audio.codecs import encode_wav

    path.write_bytes(encode_wav(audio, rate))


def _write_outputs(out_dir: Path, results: list[dict[str, Any]], outputs: list[Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as f:
        for rec in results:
            f.write(dumps(rec) + "\n")
    for i, ro in enumerate(outputs):
        for stage, so in ro.outputs.items():
            stem = out_dir / f"{i:04d}_{stage}"
            if so.text is not None:
                stem.with_suffix(".txt").write_text(so.text)
            if so.audio is not None:
                rate = int(so.passthrough.get("sampling_rate", _DEFAULT_SAMPLE_RATE))
                _write_wav(stem.with_suffix(".wav"), so.audio, rate)
            if so.hidden_states is not None:
                np.save(stem.with_suffix(".npy"), np.asarray(so.hidden_states))


def _run_streaming(omni: Any, prompts: list[Any], sampling: Any, out: Any, audio_dir: Path) -> list[Any]:
    """Stream every prompt, printing text deltas as they arrive and appending audio chunks to WAV
    files (`{i:04d}_{stage}.stream.wav`); the RequestOutputs, in prompt order.

    One prompt: each stage's text is written as it grows. Several: one line per delta,
    prefixed "[i stage]" (they interleave as the requests run concurrently)."""
    from omni.messages import RequestOutput, StageDelta

    order: list[str] = []
    results: dict[str, RequestOutput] = {}
    current: tuple[str, str] | None = None
    wavs: dict[tuple[str, str], Any] = {}
    try:
        for ev in omni.stream(prompts, sampling):
            current = _on_stream_event(ev, prompts, order, results, current, wavs, out, audio_dir)
    finally:
        for w in wavs.values():
            w.close()
    if current:
        out.write("\n")
    return [results[r] for r in order]


def _append_audio(wavs: dict[tuple[str, str], Any], key: tuple[str, str], path: Path, audio: Any,
                  rate: int | None) -> None:
    if key not in wavs:  # opened on the first chunk; the header is completed on close
        path.parent.mkdir(parents=True, exist_ok=True)
        w = wave.open(str(path), "wb")
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate or _DEFAULT_SAMPLE_RATE))
        wavs[key] = w
    pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767).astype("<i2")
    wavs[key].writeframes(pcm.tobytes())


def _prompt_of(prompt: Any) -> Any:
    """What a RequestOutput shows of a prompt, as Omni.generate's do: its text (or chat messages, or token
    ids), not the media read from its files (a waveform would fill the --json output)."""
    if isinstance(prompt, dict):
        return prompt.get("prompt") if prompt.get("prompt") is not None else prompt.get("prompt_token_ids")
    return prompt


def _on_stream_event(ev: Any, prompts: list[Any], order: list[str], results: dict[str, Any],
                     current: tuple[str, str] | None, wavs: dict[tuple[str, str], Any], out: Any,
                     audio_dir: Path) -> tuple[str, str] | None:
    """Handle one streamed item; returns the (request, stage) whose text is being written inline."""
    from omni.messages import RequestOutput, StageDelta

    rid = ev.request_id
    if rid not in results:
        order.append(rid)
        results[rid] = RequestOutput(rid, _prompt_of(prompts[len(order) - 1]) if len(order) <= len(prompts) else None)
    i = order.index(rid)
    if not isinstance(ev, StageDelta):
        if ev.error:
            results[rid].error = ev.error
        else:
            results[rid].outputs[ev.stage] = ev
            if ev.audio is not None and len(ev.audio) and (rid, ev.stage) not in wavs:
                # audio that came whole, not in chunks (a stage behind a plain edge, a reply shorter than
                # one chunk): the same file, written once
                rate = ev.passthrough.get("sampling_rate", _DEFAULT_SAMPLE_RATE)
                _append_audio(wavs, (rid, ev.stage), audio_dir / f"{i:04d}_{ev.stage}.stream.wav", ev.audio, rate)
        return current
    if ev.audio is not None and len(ev.audio):
        _append_audio(wavs, (rid, ev.stage), audio_dir / f"{i:04d}_{ev.stage}.stream.wav", ev.audio,
                      ev.sampling_rate)
    if not ev.text:
        return current
    if len(prompts) == 1:
        if current != (rid, ev.stage):
            out.write(("\n" if current else "") + f"{ev.stage}: ")
            current = (rid, ev.stage)
        out.write(ev.text)
    else:
        out.write(f"[{i} {ev.stage}] {ev.text!r}\n")
    out.flush()
    return current


def cmd_run(args: argparse.Namespace) -> int:
    from omni.api import Omni
    from omni.errors import ConfigError, OmniError

    try:
        prompts = _read_prompts(args)
        cfg, _ = load_checked(args.config, args.stage_overrides, args.memory_gb)
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    except (ConfigError, ValueError) as e:
        return error(str(e))
    sampling = None
    if args.max_tokens is not None:
        sampling = {s.name: {"max_tokens": args.max_tokens} for s in cfg.stages}
    try:
        with Omni(cfg, backend=args.backend) as omni:
            if args.stream:
                outputs = _run_streaming(omni, prompts, sampling, sys.stderr if args.json else sys.stdout,
                                         args.output_dir or Path("."))
            else:
                outputs = omni.generate(prompts, sampling, use_tqdm=not args.json)
            stats = omni.stats()
    except ConfigError as e:
        return error(str(e))
    except OmniError as e:
        return error(str(e), 1)

    results = [{"request_id": o.request_id, "prompt": o.prompt, "error": None if o.error is None else str(o.error),
                "outputs": {s: _stage_record(so) for s, so in o.outputs.items()}} for o in outputs]
    if args.output_dir:
        _write_outputs(args.output_dir, results, outputs)
    if args.json:
        print(dumps({"pipeline": cfg.name, "results": results, "stats": stats}))
    else:
        for i, o in enumerate(outputs):
            print(f"[{i}] {o.prompt!r}")
            if o.error:
                print(f"  error: {o.error}")
            for stage, so in o.outputs.items():
                kind = cfg.stage(stage).final_output
                if kind == "text" and so.text is not None:
                    print(f"  {stage} (text): {so.text}")
                elif kind == "audio" and so.audio is not None:
                    print(f"  {stage} (audio): {np.asarray(so.audio).size} samples")
                elif kind == "hidden" and so.hidden_states is not None:
                    print(f"  {stage} (hidden): shape {list(np.asarray(so.hidden_states).shape)}")
                else:
                    print(f"  {stage} (tokens): {so.token_ids}")
        for name, s in stats["stages"].items():
            hit, ttft = s.get("prefix_cache_hit_rate"), s.get("ttft_mean_s")
            print(f"stage {name}: prefix cache hit rate "
                  f"{hit if hit is None else format(hit, '.2f')}, mean TTFT "
                  f"{'-' if ttft is None else format(ttft * 1000, '.1f') + ' ms'}")
        if args.output_dir:
            print(f"wrote {args.output_dir}")
    return 1 if any(o.error for o in outputs) else 0


# ---------------------------------------------------------------------- bench
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
    commands = {"validate": cmd_validate, "plan": cmd_plan, "run": cmd_run, "serve": serve_main, "bench": cmd_bench}
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        if _sigterm_received.is_set():
            print("omni: terminated (SIGTERM)", file=sys.stderr)
            return 143
        print("omni: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
