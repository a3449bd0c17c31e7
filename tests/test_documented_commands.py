"""Every command the docs show runs in the suite (issue 21): README.md, the stage configs' header
comments, the examples' usage lines. tests/documented.py collects them from the docs; RULES below say
how each one runs here (first match wins):

    run      here, on the tiny configs: in this process (`omni.cli.main`, the example run as __main__) with
             tiny configs and small sizes substituted for large ones; `omni serve` as a subprocess (its
             stdout line is the documented behaviour); asserting the documented output. A README Python
             snippet runs as printed (its own imports, its own `asyncio.run`), against a test server
             when it names one. A command that needs a GPU or real weights runs to its error, and
             the error must say what is missing (`fails`).
    covered  by an existing test, named by node id (asserted to exist, so the mapping cannot rot)
    mention  names a command without its arguments (`omni run --stream` in prose): its flags are checked
    skip     cannot run here at all, with why (the suite itself, a shell builtin, `ray stop`)

A documented command no rule matches fails `test_every_documented_command_has_a_rule`, naming it and
where it was found. Whatever its rule, every `omni ...` command (the one inside `ray job submit ... --`
included) is parsed by omni's own argument parser (a bench's arguments by that bench's parser), in every
variant its optional `[...]` parts allow, and every repository path it names must exist.
"""
from __future__ import annotations

import argparse
import ast
import base64
import importlib
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from omni import cli
from omni.cli.bench import BENCHES
from omni.cli.entry import build_parser
from tests.documented import REPO, Doc, collect, split_env
from tests.procs import free_ports, stop_tree, tail
from tests.test_cli_streamed_audio import streaming_edges

DOCS = collect()
# Placeholders the docs use, and what the parse check puts in their place.
PLACEHOLDERS = {"CONFIG": "stage_configs/tiny_chain.yaml", "JSON": "{}", "KEY": "secret", "NAME": "name",
                "PATH": "/nonexistent/vllm", "PNG": "plot.png", "FILE": "prompts.txt"}
# A documented config too large (or too slow) for the suite -> the tiny one run instead, with overrides
# that keep what the documented one is about.
#   smollm2_chain: the same graph (a thinker whose hidden states feed a talker) on tiny random LMs;
#   qwen2_5_omni_small: the tiny checkpoint with the small config's streaming edges (its audio streams).
SUBSTITUTES: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "stage_configs/smollm2_chain.yaml": ("stage_configs/tiny_chain.yaml", dict),
    "stage_configs/qwen2_5_omni_small.yaml": ("stage_configs/qwen2_5_omni_tiny.yaml",
                                              lambda: streaming_edges(REPO / "stage_configs/qwen2_5_omni_small.yaml")),
    "stage_configs/qwen3_omni_small.yaml": ("stage_configs/qwen3_omni_tiny.yaml",
                                            lambda: streaming_edges(REPO / "stage_configs/qwen3_omni_small.yaml")),
}
SMALL_MAX_TOKENS = "4"
# The config the client examples' usage lines serve (`omni serve stage_configs/... &`), as README's quick start.
EXAMPLE_SERVER = "stage_configs/qwen2_5_omni_small.yaml"
SERVE_START_TIMEOUT_S = 240


# ------------------------------------------------------------ the doc syntax
def _alternatives(text: str) -> list[str]:
    """`omni bench kv | throughput | prefix` -> one command per alternative (words after the first)."""
    parts = [p.strip() for p in _split_top(text, "|")]
    if len(parts) > 1 and all(len(p.split()) == 1 for p in parts[1:]):
        head = parts[0].rsplit(" ", 1)[0]
        return [parts[0]] + [f"{head} {p}" for p in parts[1:]]
    return [text]


def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside quotes and brackets."""
    out, cur, depth, quote = [], "", 0, None
    for c in text:
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == sep and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += c
    return out + [cur]


def variants(text: str) -> dict[str, list[str]]:
    """The argument vectors a usage line stands for: "full" (every optional `[...]` part, its first
    alternative, a `ray|local` value as its first choice) and "base" (none of them)."""
    full, base, quote, depth, group = "", "", None, 0, ""
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "[" and (i == 0 or text[i - 1] == " " or depth):
            depth += 1
            if depth == 1:
                group = ""
                continue
        elif c == "]" and depth:
            depth -= 1
            if depth == 0:
                full += " " + _split_top(group, "|")[0].strip() + " "
                continue
        if depth:
            group += c
        else:
            full += c
            base += c
    argvs = {}
    for name, t in (("full", full), ("base", base)):
        words = shlex.split(t)
        words = [w.split("|")[0] if re.fullmatch(r"[\w-]+(\|[\w-]+)+", w) else w for w in words]
        argvs[name] = [w for w in words if w != "&"]  # `omni serve ... &`: in the background
    return argvs


def omni_argv(words: list[str]) -> list[str] | None:
    """The arguments of `omni` in a command's words (`omni ...`, `python -m omni.cli ...`, after `--`)."""
    if "--" in words:
        words = words[words.index("--") + 1:]
    if words and words[0].rsplit("/", 1)[-1] == "omni":
        return words[1:]
    if len(words) > 2 and words[0].rsplit("/", 1)[-1] == "python" and words[1:3] == ["-m", "omni.cli"]:
        return words[3:]
    return None


def words_of(doc: Doc, variant: str = "full") -> list[str]:
    _, rest = split_env(doc.text)
    return variants(rest)[variant]


# ------------------------------------------------------------------ plans
@dataclass(frozen=True)
class Plan:
    kind: str                              # run | covered | mention | skip
    why: str = ""                          # skip: why; covered: the node id; run: what runs
    run: Callable[..., None] | None = None
    key: tuple = ()                        # runs with equal keys run once
    marks: tuple = ()


def covered(node: str) -> Callable[[Doc], Plan]:
    return lambda doc: Plan("covered", node)


def skip(why: str) -> Callable[[Doc], Plan]:
    return lambda doc: Plan("skip", why)


def mention(doc: Doc) -> Plan:
    return Plan("mention", "names a command without its arguments; its flags are checked")


def _abs_config(path: str) -> str:
    return str(REPO / path) if not os.path.isabs(path) else path


def _substitute(config: str) -> tuple[str, dict[str, Any]]:
    tiny, overrides = SUBSTITUTES.get(config, (config, dict))
    return tiny, overrides()


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value`, unless the documented command sets that flag itself."""
    return argv if flag in argv else argv + [flag, value]


def plan_omni_run(doc: Doc) -> Plan:
    argv = omni_argv(words_of(doc))
    config, overrides = _substitute(argv[1])
    if "--stage-overrides" in argv:
        i = argv.index("--stage-overrides")
        overrides = _merge(json.loads(argv[i + 1]), overrides)
        argv = argv[:i] + argv[i + 2:]
    argv = ["run", _abs_config(config)] + argv[2:]
    if overrides:
        argv += ["--stage-overrides", json.dumps(overrides, sort_keys=True)]
    argv = _set_flag(argv, "--backend", "local")
    argv = _set_flag(argv, "--max-tokens", SMALL_MAX_TOKENS)
    return Plan("run", "omni " + " ".join(argv), run=run_omni_run, key=("omni", *argv))


def plan_validate(doc: Doc) -> Plan:
    argv = omni_argv(words_of(doc))
    argv = [argv[0], _abs_config(argv[1]), *argv[2:]]
    return Plan("run", "omni " + " ".join(argv), run=run_validate, key=("omni", *argv))


def plan_serve(doc: Doc) -> Plan:
    argv = omni_argv(words_of(doc, "base"))  # its options are parse-checked; the server runs as it starts
    config, _ = _substitute(argv[1])  # the server gets the substitute's overrides when it starts
    return Plan("run", f"omni serve {config} --backend local", run=run_serve, key=("serve", argv[1]),
                marks=(pytest.mark.subprocess,))


def plan_bench(small: list[str], check: Callable[[dict[str, Any]], None]) -> Callable[[Doc], Plan]:
    def plan(doc: Doc) -> Plan:
        argv = omni_argv(words_of(doc)) + small
        return Plan("run", "omni " + " ".join(argv), run=lambda *a: run_bench(argv, check, *a),
                    key=("omni", *argv), marks=(pytest.mark.slow, pytest.mark.timeout(600)))
    return plan


def plan_example(script: str, small: Callable[[list[str], Path], list[str]],
                 check: Callable[[str, list[str]], None], needs_server: bool = False) -> Callable[[Doc], Plan]:
    def plan(doc: Doc) -> Plan:
        words = words_of(doc)
        args = words[words.index(script) + 1:]
        return Plan("run", f"python {script} {' '.join(args)}",
                    run=lambda *a: run_example(script, args, small, check, *a),
                    key=(script, *small(args, Path("/TMP"))),
                    # a pipeline's load and a conversation: ~4 s on 2 cores, `make test` only
                    marks=(pytest.mark.slow,) + ((pytest.mark.subprocess,) if needs_server else ()))
    return plan


def plan_curl(doc: Doc) -> Plan:
    return Plan("run", doc.text, run=run_curl, key=("curl", doc.text), marks=(pytest.mark.subprocess,))


def plan_build_app(doc: Doc) -> Plan:
    args = dict(w.split("=", 1) for w in words_of(doc)[3:])
    return Plan("run", f"build_app({args})", run=lambda *a: run_build_app(args), key=("build_app", *sorted(args)))


def plan_snippet(doc: Doc) -> Plan:
    server = "127.0.0.1:8000" in doc.text
    # The voice agent's three stages (recognizer, LLM, TTS with its codec) load for ~20 s on 2 cores: `make test` only.
    slow = "stage_configs/voice_agent" in doc.text
    return Plan("run", "a README snippet", run=run_snippet, key=("snippet", doc.text),
                marks=((pytest.mark.subprocess,) if server else ()) + ((pytest.mark.slow,) if slow else ()))


def fails(message: str) -> Callable[[Doc], Plan]:
    """A command that needs what this machine lacks (a GPU, real weights): run here, in this process, it must
    fail with `message` (a regex; the environment the command sets applies), not hang or succeed."""
    def plan(doc: Doc) -> Plan:
        argv = omni_argv(words_of(doc))
        return Plan("run", f"omni {' '.join(argv)} fails: {message}",
                    run=lambda *a: run_fails(argv, message, *a), key=("fails", *argv, *doc.env))
    return plan


def plan_bench_help(doc: Doc) -> Plan:
    return Plan("run", "omni bench NAME --help, for every NAME", run=run_bench_help, key=("bench-help",),
                marks=(pytest.mark.slow,))


# ---- small sizes for the examples
def _multi_turn_small(args: list[str], tmp: Path) -> list[str]:
    """The SmolLM2 chain (the script's default) -> the tiny chain with room for the example's first
    message (~450 tokens: tiny_chain.yaml's max_model_len 256 is what the suite's limit tests rely on).
    Always with `--compare` (the same conversation again, caching off): one run covers both forms."""
    args = [a for a in args if a != "--compare"] + ["--compare"]
    if "--config" not in args or args[args.index("--config") + 1].endswith("smollm2_chain.yaml"):
        if "--config" in args:
            i = args.index("--config")
            del args[i:i + 2]
        args = ["--config", str(tmp / "tiny_chain_1k.yaml"), *args]
    return _set_flag(args, "--backend", "local")


def _offline_small(args: list[str], tmp: Path) -> list[str]:
    args = list(args)
    if "--config" in args and args[args.index("--config") + 1] in SUBSTITUTES:
        i = args.index("--config")
        args[i + 1] = _substitute(args[i + 1])[0]
    return _set_flag(_set_flag(args, "--backend", "local"), "--max-tokens", SMALL_MAX_TOKENS)


def _chat_client_small(args: list[str], tmp: Path) -> list[str]:
    out = []
    for a in args:
        out.append(a.replace("http://127.0.0.1:8000/v1", "{BASE_URL}").replace("replies/", str(tmp / "replies"))
                   .replace("question.wav", str(tmp / "question.wav")))
    return _set_flag(out, "--max-tokens", SMALL_MAX_TOKENS)


def _realtime_client_small(args: list[str], tmp: Path) -> list[str]:
    """The test server's address; question.wav: the first 3 s of a real recorded voice (never speech the
    model made), written by run_example."""
    return [a.replace("http://127.0.0.1:8000/v1", "{BASE_URL}").replace("replies/", str(tmp / "replies"))
            .replace("question.wav", str(tmp / "question.wav")) for a in args]


def _realtime_client_check(out: str, args: list[str]) -> None:
    turns = args.count("--speak") + args.count("--say")
    assert out.count("] assistant: ") == turns, out
    for n in range(1, turns + 1):
        m = re.search(rf"\[turn {n}\] audio: (\d+) samples -> (\S+)", out)
        assert m, out
        with wave.open(m.group(2), "rb") as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
            assert w.getnframes() == int(m.group(1)) > 0
    assert re.search(rf"\[turn {turns}\] input_tokens=\d+ cached_tokens=[1-9]\d*", out), out  # turn 2 hits


def _bench_json_has(*keys: str) -> Callable[[dict[str, Any]], None]:
    def check(res: dict[str, Any]) -> None:
        missing = [k for k in keys if k not in res]
        assert not missing, f"the bench's JSON lacks {missing}: {sorted(res)}"
        for k in keys:
            assert res[k] is not None and res[k] > 0, (k, res[k])
    return check


def _multi_turn_check(out: str, args: list[str]) -> None:
    assert out.count("[turn 3] thinker:") == 2, out[-3000:]  # caching on, then off
    assert "Summary (prefix caching on):" in out
    assert "TTFT per turn (ms): caching on / off" in out
    # turn 2 resends turn 1: the thinker finds it in its prefix cache
    hit = re.search(r"\[turn 2\] thinker:.*?\n\s+thinker: prompt\s+(\d+) tokens,\s+(\d+) from the prefix cache", out, re.S)
    assert hit and int(hit.group(2)) > 0, out[-3000:]


def _offline_check(out: str, args: list[str]) -> None:
    for rid in ("[haiku]", "stage thinker: prefix cache hit rate", "stage talker: prefix cache hit rate"):
        assert rid in out, out[-3000:]
    assert "error:" not in out, out[-3000:]


def _chat_client_check(out: str, args: list[str]) -> None:
    turns = args.count("--turn")
    assert out.count("] assistant: ") == turns, out
    if "--text-only" not in args:
        for n in range(1, turns + 1):
            m = re.search(rf"\[turn {n}\] audio: (\d+) samples -> (\S+)", out)
            assert m, out
            with wave.open(m.group(2), "rb") as w:
                assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
                assert w.getnframes() == int(m.group(1)) > 0
    assert re.search(rf"\[turn {turns}\] prompt_tokens=\d+ cached_tokens=[1-9]\d*", out), out  # turn 2 hits


# What a command that needs real weights or a GPU says on this machine (the tests run without either).
NO_WEIGHTS = r"(model path|QWEN2_5_OMNI_PATH|QWEN3_OMNI_PATH|HIGGS_AUDIO_PATH|QWEN3_ASR_PATH).*(does not exist|no such|not found)"
NO_CUDA = r"no CUDA device|torch sees no CUDA device"
RULES: list[tuple[str, Callable[[Doc], Plan]]] = [
    # not runnable here, each with why
    (r"^make test(-fast)?( PYTEST_ARGS=.*)?$", skip("the test suite itself (or its fast tier): this test runs inside it")),
    (r"^ray stop$", skip("stops every Ray node of the user on this machine, the suite's own shared cluster "
                         "(and other users' test clusters) included; the clusters the tests start are stopped "
                         "by killing their own process groups")),
    (r"^source \.venv/bin/activate$", skip("changes the calling shell's PATH, nothing of its own to check "
                                           "(`make` creates .venv)")),
    # needs real weights or a GPU: runs to its error, which must say what is missing
    (r"qwen2_5_omni_7b\.yaml|qwen3_omni_30b_a3b\.yaml|higgs_audio_v2\.yaml|qwen3_asr\.yaml|voice_agent\.yaml",
     fails(NO_WEIGHTS)),
    (r"qwen2_5_omni_7b_shapes\.yaml|--device cuda", fails(NO_CUDA)),
    # mentions: a command named in prose, no arguments
    (r"^omni (run|validate|serve|plan)( --[\w-]+)*$", mention),
    (r"^omni bench (NAME|\.\.\.)$", mention),
    (r"^omni bench NAME --help$", plan_bench_help),
    (r"^ray start( --address)?$", mention),
    (r"^ray job submit$", mention),
    # Ray: a cluster of its own, started by existing tests
    (r"^ray start --head$", covered("tests/pipeline/test_ray_job.py::test_ray_job_submit_omni_run")),
    (r"^ray start --address HEAD:6379$",
     covered("tests/pipeline/test_ray_replicas.py::test_replicas_spread_over_both_nodes_and_conversations_keep_their_hit_rate")),
    (r"^ray job submit --address http://127\.0\.0\.1:8265 .* -- python -m omni\.cli run stage_configs/tiny_chain\.yaml",
     covered("tests/pipeline/test_ray_job.py::test_ray_job_submit_omni_run")),
    (r"^examples/ray_job\.sh\b", covered("tests/pipeline/test_ray_job.py::test_example_ray_job_script")),
    (r"^omni serve \S+ --ray-serve\b", covered("tests/serve/test_ray_serve.py::test_ray_serve_ingress")),
    (r"^omni serve \.\.\. --enable-auto-tool-choice --tool-call-parser hermes$",
     covered("tests/serve/test_auto_tools_server.py::test_a_call_in_the_reply_comes_back_as_tool_calls")),
    (r"^omni serve stage_configs/higgs_audio_v2_tiny\.yaml --voice-dir voices/$",
     covered("tests/serve/test_tts_server.py::test_the_voice_dir_voices_are_listed_and_spoken")),
    (r"^omni serve \.\.\. --default-modalities text,audio$",
     covered("tests/serve/test_vllm_omni_defaults.py::test_no_modalities_is_text_and_audio_on_a_server_that_says_so")),
    # benches with smoke tests of their own
    (r"^omni bench kv$", covered("tests/bench/test_bench_kv.py::test_bench_kv_reports_every_key")),
    (r"^omni bench cuda-graphs$", covered("tests/bench/test_bench_cuda_graphs.py::test_without_cuda_it_is_a_clean_skip")),
    (r"^omni bench kernels$", covered("tests/bench/test_bench_kernels.py::test_run_without_cuda_is_a_clean_skip")),
    (r"^omni bench kernels --cpu$",
     covered("tests/bench/test_bench_kernels.py::test_cpu_mode_times_both_decode_paths_on_smollm2_shapes")),
    (r"^omni bench pipeline$", covered("tests/bench/test_bench_pipeline.py::test_bench_pipeline_ttft_part")),
    (r"^omni bench omni$", covered("tests/bench/test_bench_omni.py::test_omni_bench_reports_speedups_and_hits")),
    (r"^omni bench omni --config stage_configs/qwen3_omni_small\.yaml$",
     covered("tests/bench/test_bench_omni.py::test_omni_bench_on_qwen3_omni_finds_code2wav")),
    (r"^omni bench streaming --pipeline qwen3-omni$",
     covered("tests/bench/test_bench_streaming.py::test_streaming_bench_on_the_qwen3_omni_pipeline")),
    (r"^omni bench qwen3-vs-hf( --backend local)?$", covered("tests/bench/test_bench_qwen3_vs_hf.py::test_qwen3_vs_hf_on_the_tiny_pipeline")),
    (r"^omni bench head$", covered("tests/bench/test_bench_head.py::test_bench_head_times_both_sides_for_every_row_count")),
    (r"^omni bench token2wav$",
     covered("tests/bench/test_bench_token2wav.py::test_token2wav_bench_compares_with_transformers_and_agrees")),
    (r"^omni bench streaming( --plot \S+| --pipeline omni)?$",
     covered("tests/bench/test_bench_streaming.py::test_streaming_bench_on_the_omni_pipeline")),
    (r"^omni bench capacity( --plot \S+| --concurrency( \d+)+| --rates( [\d.]+)+)*$",
     covered("tests/bench/test_bench_capacity.py::test_capacity_bench_on_the_tiny_omni_pipeline")),
    (r"^omni bench routing$", covered("tests/bench/test_bench_routing.py::test_bench_routing_reports_the_issue_keys")),
    (r"^omni bench serve$", covered("tests/bench/test_bench_serve.py::test_bench_serve_reports_both_modes")),
    (r"^omni bench plan$", covered("tests/bench/test_bench_plan.py::test_bench_plan_reports_the_issue_keys")),
    # omni plan loads and profiles every stage: its own tests run it on the tiny chain
    (r"^omni plan \S+", covered("tests/planning/test_plan_cli.py::test_plan_profiles_then_prints_the_table")),
    (r"^omni bench tts( --config stage_configs/higgs_audio_v2_small\.yaml)?$",
     covered("tests/bench/test_bench_tts.py::test_bench_tts_reports_the_issue_keys_on_the_tiny_pipeline")),
    (r"^omni bench realtime$",
     covered("tests/bench/test_bench_realtime.py::test_bench_realtime_reports_per_turn_latency_on_and_off")),
    (r"^omni bench realtime --config stage_configs/qwen3_omni_small\.yaml$",
     covered("tests/bench/test_bench_realtime.py::test_bench_realtime_on_qwen3_omni")),
    (r"^omni bench realtime --config stage_configs/voice_agent_small\.yaml --turns 8$",
     covered("tests/bench/test_bench_realtime.py::test_bench_realtime_on_the_voice_agent")),
    # run here
    (r"^omni bench throughput$", plan_bench(["--model", "builtin:tiny-qwen2", "--num-requests", "1"],
                                            _bench_json_has("omni_tokens_per_s", "hf_generate_tokens_per_s",
                                                            "mfu_vs_sgemm"))),
    (r"^omni bench prefix$", plan_bench(["--model", "builtin:tiny-qwen2", "--doc-tokens", "64", "--num-questions", "2",
                                         "--miss-requests", "2"],
                                        _bench_json_has("ttft_cached_ms", "ttft_uncached_ms", "ttft_question_alone_ms",
                                                        "cached_over_question_alone",
                                                        "flops_cached_over_question_alone"))),
    (r"^omni bench tensor-cache( --dtype bfloat16)?$", plan_bench(["--model", "builtin:tiny-qwen2", "--doc-tokens", "64",
                                               "--num-questions", "2", "--decode-tokens", "2"],
                                              _bench_json_has("cache_overhead_fraction"))),
    (r"^omni validate \S+", plan_validate),
    (r"^omni run \S+", plan_omni_run),
    (r"^omni serve \S+\.yaml", plan_serve),
    (r"^curl .*http://127\.0\.0\.1:8000/", plan_curl),
    (r"^serve run omni\.serve\.ray_serve:build_app ", plan_build_app),
    # README's Python snippets, run as printed (a server's address replaced by the test server's)
    (r"(?s)^(import|from) \w", plan_snippet),
    (r"^python examples/multi_turn\.py\b", plan_example("examples/multi_turn.py", _multi_turn_small, _multi_turn_check)),
    (r"^python examples/offline_pipeline\.py\b",
     plan_example("examples/offline_pipeline.py", _offline_small, _offline_check)),
    (r"^python examples/realtime_client\.py\b",
     plan_example("examples/realtime_client.py", _realtime_client_small, _realtime_client_check, needs_server=True)),
    (r"^python examples/chat_client\.py\b",
     plan_example("examples/chat_client.py", _chat_client_small, _chat_client_check, needs_server=True)),
]


def normalized(doc: Doc) -> list[str]:
    """What the rules match: the command without its environment, one per `a | b` alternative, the
    venv's programs by their names, `python -m omni.cli` as `omni` (a Python snippet as it is)."""
    if doc.lang == "python":
        return [doc.text]
    _, rest = split_env(doc.text)
    rest = re.sub(r"^(\S*/)?\.venv/bin/", "", rest)
    rest = re.sub(r"^python -m omni\.cli ", "omni ", rest)
    return [" ".join(a.split()) for a in _alternatives(rest)]


def expand() -> list[tuple[Doc, str]]:
    return [(Doc(text, d.where, d.env, d.lang), text) for d in DOCS for text in normalized(d)]


def plan_for(doc: Doc) -> Plan | None:
    for pattern, make in RULES:
        if re.search(pattern, doc.text):
            return make(doc)
    return None


def _runs() -> list[Any]:
    """One test per distinct run (equal keys run once), named after the first place that shows it."""
    seen: dict[tuple, Any] = {}
    for doc, _ in expand():
        plan = plan_for(doc)
        if plan is not None and plan.kind == "run" and plan.key not in seen:
            seen[plan.key] = pytest.param(doc, plan, id=doc.id, marks=list(plan.marks))
    return list(seen.values())


# ------------------------------------------------------------------ the mapping
def test_docs_show_commands():
    """The collector finds what the docs show (a broken collector must not pass on nothing)."""
    where = {d.where.split(":")[0] for d in DOCS}
    assert {"README.md", "examples/multi_turn.py", "examples/chat_client.py", "examples/ray_job.sh",
            "stage_configs/qwen2_5_omni_small.yaml"} <= where
    texts = [t for _, t in expand()]
    for expected in ("omni bench serve", "omni validate stage_configs/smollm2_chain.yaml",
                     'omni run stage_configs/qwen2_5_omni_small.yaml --prompt "Hello" --stream'):
        assert expected in texts, expected


def test_every_documented_command_has_a_rule():
    missing = [f"{d.where}: {d.text}" for d, _ in expand() if plan_for(d) is None]
    assert not missing, ("documented commands that no rule in tests/test_documented_commands.py runs, maps to "
                         "an existing test or skips (add one):\n  " + "\n  ".join(missing))


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_covered_commands_name_existing_tests():
    wrong = []
    for doc, _ in expand():
        plan = plan_for(doc)
        if plan is not None and plan.kind == "covered":
            path, name = plan.why.split("::")
            if not (REPO / path).is_file() or name not in _test_functions(REPO / path):
                wrong.append(f"{doc.where}: {doc.text} -> {plan.why}")
    assert not wrong, "commands mapped to tests that do not exist:\n  " + "\n  ".join(wrong)


def _placeholders(words: list[str], tmp: Path) -> list[str]:
    return [PLACEHOLDERS.get(w, w) for w in words]


class _ParseError(Exception):
    pass


def _parse(argv: list[str]) -> None:
    """omni's parser, and for `bench NAME` the bench's own (every one raises instead of exiting)."""
    def error(self: argparse.ArgumentParser, message: str) -> None:
        raise _ParseError(f"{self.prog}: {message}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "error", error)
        args = build_parser().parse_args(argv)
        if args.command == "bench":
            if args.name not in BENCHES:
                raise _ParseError(f"unknown benchmark {args.name!r}")
            module = importlib.import_module(f"omni.bench.{BENCHES[args.name]}")
            parser = argparse.ArgumentParser(prog=f"omni bench {args.name}")
            module.add_arguments(parser)
            parser.parse_args(args.args)


_REPO_PATH = re.compile(r"^(?:\w+=)?((?:stage_configs|examples|omni|stages|kernels|tests)/[\w./-]+)$")


def test_documented_omni_commands_parse_and_name_existing_paths(tmp_path):
    bad = []
    for doc, _ in expand():
        if doc.lang != "sh":
            continue
        plan = plan_for(doc) or Plan("no rule")  # a command without a rule is still parsed
        for variant in ("full", "base"):
            words = _placeholders(words_of(doc, variant), tmp_path)
            for w in words:
                m = _REPO_PATH.match(w)
                if m and not (REPO / m.group(1).rstrip("/")).exists():
                    bad.append(f"{doc.where}: {doc.text}: no such path {m.group(1)}")
            argv = omni_argv(words)
            if argv is None:
                continue
            if plan.kind == "mention" and argv[0] in ("run", "validate", "serve", "plan"):
                argv = [argv[0], PLACEHOLDERS["CONFIG"], *argv[1:]]  # named without its config
            if plan.kind == "mention" and argv[0] == "bench":
                continue
            if argv[:2] == ["bench", PLACEHOLDERS["NAME"]]:  # `omni bench NAME --help`: run for every NAME
                continue
            try:
                _parse(argv)
            except _ParseError as e:
                bad.append(f"{doc.where}: {doc.text}: {e}")
    assert not bad, "documented commands that omni would refuse:\n  " + "\n  ".join(sorted(set(bad)))


def test_the_machinery_catches_what_it_is_for(tmp_path):
    """A command in a fenced block or an inline span is found; one no rule knows has no plan; a flag omni
    does not have is refused (the three ways a doc goes wrong without anyone running it)."""
    from tests.documented import from_readme

    readme = tmp_path / "README.md"
    readme.write_text("Run `omni frobnicate x` or\n\n```\nomni validate stage_configs/tiny_chain.yaml  # ok\n"
                      "omni run stage_configs/tiny_chain.yaml \\\n    --prompt 'a b'\n```\n")
    docs = from_readme(readme)
    assert [(d.where, d.text) for d in docs] == [
        ("README.md:4", "omni validate stage_configs/tiny_chain.yaml"),
        ("README.md:5", "omni run stage_configs/tiny_chain.yaml --prompt 'a b'"),
        ("README.md:1", "omni frobnicate x")]
    assert [plan_for(d).kind if plan_for(d) else None for d in docs] == ["run", "run", None]
    with pytest.raises(_ParseError, match="ambiguous option: --omni"):
        _parse(["bench", "streaming", "--omni"])
    with pytest.raises(_ParseError, match="unrecognized arguments: --fast"):
        _parse(["run", "stage_configs/tiny_chain.yaml", "--fast"])
    assert variants("omni serve C [--port 8000] [--api-key KEY | $K] [--backend ray|local]") == {
        "full": ["omni", "serve", "C", "--port", "8000", "--api-key", "KEY", "--backend", "ray"],
        "base": ["omni", "serve", "C"]}


def test_ray_job_script_without_a_cluster_says_so_in_one_line():
    """examples/ray_job.sh where no job server answers (RAY_JOB_ADDRESS on a free port): one line naming the
    address and RAY_JOB_ADDRESS, exit 1, within seconds, nothing submitted (no traceback)."""
    address = f"http://127.0.0.1:{free_ports(1)[0]}"
    env = {**os.environ, "RAY_JOB_ADDRESS": address, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "examples" / "ray_job.sh")], capture_output=True, text=True,
                       timeout=60, env=env, cwd=REPO)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and address in lines[0] and "RAY_JOB_ADDRESS" in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


# ------------------------------------------------------------------ running them
def _last_json(out: str) -> dict[str, Any]:
    lines = out.strip().splitlines()
    assert lines, "nothing on stdout"
    return json.loads(lines[-1])


def _read_wav(path: Path) -> tuple[Any, bytes]:
    with wave.open(str(path), "rb") as w:
        return w.getparams(), w.readframes(w.getnframes())


def run_omni_run(doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    plan = plan_for(doc)
    argv = list(plan.key[1:])
    if "--output-dir" in argv:
        argv[argv.index("--output-dir") + 1] = str(tmp / "out")
    rc = cli.main(argv)
    cap = capsys.readouterr()
    assert rc == 0, f"{plan.why}\n{cap.err[-3000:]}"
    config = yaml.safe_load(Path(argv[1]).read_text())
    overrides = json.loads(argv[argv.index("--stage-overrides") + 1]) if "--stage-overrides" in argv else {}
    stages = {s["name"]: _merge(s, overrides.get(s["name"], {})) for s in config["stages"]}
    finals = {n: s["final_output"] for n, s in stages.items() if s.get("final_output")}
    if "--json" in argv:
        data = _last_json(cap.out)
        assert data["pipeline"] == config["name"]
        results = data["results"]
        assert len(results) == argv.count("--prompt")
        for r in results:
            assert r["error"] is None and set(r["outputs"]) == set(finals), r
    else:
        assert re.search(r"^\[0\] '", cap.out, re.M), cap.out
        for name, kind in finals.items():
            assert f"  {name} ({kind}): " in cap.out, cap.out
        for name in stages:
            assert f"stage {name}: prefix cache hit rate" in cap.out
        results = None
    out_dir = tmp / "out" if "--output-dir" in argv else None
    if out_dir is not None:
        lines = (out_dir / "results.jsonl").read_text().splitlines()
        assert len(lines) == argv.count("--prompt")
        rec = json.loads(lines[0])
        for name, kind in finals.items():
            if kind == "text":
                assert (out_dir / f"0000_{name}.txt").read_text() == rec["outputs"][name]["text"]
            if kind == "audio":
                params, _ = _read_wav(out_dir / f"0000_{name}.wav")
                assert params.nframes == rec["outputs"][name]["audio_samples"] > 0
    if "--stream" in argv:
        text_stage = next(n for n, k in finals.items() if k == "text")
        assert f"{text_stage}: " in (cap.err if "--json" in argv else cap.out)
        # audio goes to a WAV as it comes (in chunks behind a streaming edge, else whole)
        for name, kind in finals.items():
            if kind == "audio":
                wav = (out_dir or tmp / "omni_outputs") / f"0000_{name}.stream.wav"
                params, frames = _read_wav(wav)
                assert (params.nchannels, params.sampwidth) == (1, 2) and params.nframes > 0
                if results is not None:
                    assert params.nframes == results[0]["outputs"][name]["audio_samples"]
                if out_dir is not None:  # the chunks are the final waveform
                    assert _read_wav(out_dir / f"0000_{name}.wav")[1] == frames


def run_validate(doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    argv = list(plan_for(doc).key[1:])
    rc = cli.main(argv)
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    name = yaml.safe_load(Path(argv[1]).read_text())["name"]
    if "--json" in argv:
        assert _last_json(cap.out)["name"] == name
    else:
        assert cap.out.startswith(f"pipeline {name!r}: ") and cap.out.strip().splitlines()[-1] == "OK", cap.out


def run_bench(argv: list[str], check: Callable[[dict[str, Any]], None], doc: Doc, tmp: Path, capsys,
              monkeypatch, request) -> None:
    rc = cli.main(argv)
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-3000:]
    check(_last_json(cap.out))  # `omni bench`: the result is one JSON object on the last line


def run_fails(argv: list[str], message: str, doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    """The command, in this process, must fail (an exit status or an exception) with `message` in what it says,
    and name the path the documented environment gives (`QWEN2_5_OMNI_PATH=/models/...`)."""
    monkeypatch.chdir(REPO)  # the documented invocations run from the repository root
    try:
        rc = cli.main(argv)
        said = ""
    except Exception as e:  # noqa: BLE001 - a bench raises what stopped it; its message is what the user sees
        rc, said = 1, f"{type(e).__name__}: {e}"
    cap = capsys.readouterr()
    said = f"{cap.err}\n{cap.out}\n{said}"
    assert rc not in (0, None), f"omni {' '.join(argv)} succeeded on a machine without a GPU or real weights:\n{said[-3000:]}"
    assert re.search(message, said), f"omni {' '.join(argv)} failed without saying /{message}/:\n{said[-3000:]}"
    for k, v in doc.env:
        if k.endswith("_PATH"):
            assert v in said, f"the error does not name {k}'s {v}:\n{said[-3000:]}"


def run_bench_help(doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    """`omni bench NAME --help` says how NAME measures, for every benchmark `omni bench --help` lists."""
    for name in sorted(BENCHES):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith(f"usage: omni bench {name}") and len(out.splitlines()) > 3, (name, out)


def _write_tiny_chain_1k(tmp: Path) -> None:
    cfg = yaml.safe_load((REPO / "stage_configs/tiny_chain.yaml").read_text())
    for s in cfg["stages"]:
        s["scheduler"]["max_model_len"] = 1024
    (tmp / "tiny_chain_1k.yaml").write_text(yaml.safe_dump(cfg))


def _write_question_wav(path: Path) -> None:
    t = np.arange(16000) / 16000
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())


def run_example(script: str, args: list[str], small: Callable[[list[str], Path], list[str]],
                check: Callable[[str, list[str]], None], doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    monkeypatch.chdir(REPO)  # the documented invocations run from the repository root
    argv = small(args, tmp)
    if any("tiny_chain_1k.yaml" in a for a in argv):
        _write_tiny_chain_1k(tmp)
    if any("question.wav" in a for a in argv):
        if script == "examples/realtime_client.py":  # spoken: real recorded speech
            from tests.serve.realtime_utils import pcm16, speech_24k

            with wave.open(str(tmp / "question.wav"), "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(24000)
                w.writeframes(pcm16(speech_24k(3.0)))
        else:
            _write_question_wav(tmp / "question.wav")
    if any("{BASE_URL}" in a for a in argv):  # the server the example's usage starts (`omni serve CONFIG &`)
        server = request.getfixturevalue("servers").get(EXAMPLE_SERVER)
        argv = [a.replace("{BASE_URL}", server.url + "/v1") for a in argv]
    monkeypatch.setattr(sys, "argv", [str(REPO / script), *argv])
    rc = 0
    try:
        runpy.run_path(str(REPO / script), run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    cap = capsys.readouterr()
    assert rc == 0, f"python {script} {' '.join(argv)} exited {rc}:\n{cap.err[-3000:]}"
    check(cap.out, argv)


def run_build_app(args: dict[str, str]) -> None:
    """`serve run MODULE:build_app k=v ...` imports the builder and calls it with the arguments: the bound
    application must come back (running it is Ray Serve's part, tested through `omni serve --ray-serve`,
    which deploys the same `deployment()`)."""
    from ray.serve import Application

    from omni.serve.ray_serve import build_app

    args = {k: PLACEHOLDERS.get(v, v) for k, v in args.items()}
    args["config"] = _abs_config(args["config"])
    assert isinstance(build_app(args), Application)


def run_snippet(doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    """A README Python snippet as printed, as a script of its own (`__main__`, nothing given to it), in a
    folder where the repository's stage_configs/ are at hand as from its root. A model named in the snippet is
    served by the test server (a documented config too large for the suite: its SUBSTITUTES entry, served
    under the documented name). Every WAV file it writes must exist afterwards and open with `wave`."""
    (tmp / "stage_configs").symlink_to(REPO / "stage_configs")
    code = doc.text
    if "127.0.0.1:8000" in code:
        model = re.search(r'model="(\w+)"', code).group(1)
        server = request.getfixturevalue("servers").get(f"stage_configs/{model}.yaml")
        code = code.replace("http://127.0.0.1:8000", server.url)
    exec(compile(code, doc.where, "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip(), "the snippet printed nothing"
    for name in re.findall(r'(?:open|write_to_file|write)\(\s*"([\w./-]+\.wav)"', code):  # the WAVs it writes
        with wave.open(str(tmp / name), "rb") as w:
            assert (w.getnchannels(), w.getsampwidth()) == (1, 2) and w.getnframes() > 0, name


# ---- the server and its clients
@dataclass
class Served:
    url: str
    line: str
    proc: subprocess.Popen


@pytest.fixture(scope="module")
def servers():
    """`omni serve CONFIG --backend local` subprocesses, started on first use (one per config), stopped
    (SIGTERM to the process) when the module is done."""
    started: dict[str, Served] = {}

    class Lazy(dict):
        def get(self, documented: str) -> Served:  # type: ignore[override]
            """The server of a documented config (a substitute's: the tiny one with its overrides)."""
            if documented not in started:
                started[documented] = _start_server(documented)
            return started[documented]

    try:
        yield Lazy()
    finally:
        for s in started.values():
            stop_tree(s.proc, grace_s=20, group=False)


def _config_name(config: str) -> str:
    return yaml.safe_load((REPO / config).read_text())["name"]


def _start_server(documented: str) -> Served:
    """`omni serve` on the documented config, or on its substitute under the documented config's name (what
    the docs' clients send as `model`)."""
    config, overrides = _substitute(documented)
    port = free_ports(1)[0]
    log = Path(tempfile.mkstemp(prefix="omni-serve-doc-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    extra = ["--stage-overrides", json.dumps(overrides)] if overrides else []
    if config != documented:
        extra += ["--served-model-name", _config_name(documented)]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omni.cli", "serve", str(REPO / config), "--port", str(port),
                                 "--backend", "local", *extra], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env, start_new_session=True)
    deadline = time.monotonic() + SERVE_START_TIMEOUT_S
    while True:
        m = re.search(r"^omni serve: .*$", tail(log, 100_000), re.M)
        if m:
            return Served(f"http://127.0.0.1:{port}", m.group(0), proc)
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_tree(proc, grace_s=5, group=False)
            pytest.fail(f"omni serve {config} did not print its address:\n{tail(log)}")
        time.sleep(0.2)


def _get(url: str) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, json.loads(r.read() or b"null")


def run_serve(doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    documented = plan_for(doc).key[1]
    name = _config_name(documented)
    server = request.getfixturevalue("servers").get(documented)
    # README: "the server prints `omni serve: NAME on http://HOST:PORT`"; the model name is the pipeline's
    assert re.fullmatch(rf"omni serve: {name} on {re.escape(server.url)}( \(.*\))?", server.line), server.line
    assert _get(server.url + "/health")[0] == 200
    assert [m["id"] for m in _get(server.url + "/v1/models")[1]["data"]] == [name]


def run_curl(doc: Doc, tmp: Path, capsys, monkeypatch, request) -> None:
    if shutil.which("curl") is None:
        pytest.fail("curl is not installed: README's curl example cannot be checked")
    words = shlex.split(doc.text)
    body = json.loads(words[words.index("-d") + 1])
    server = request.getfixturevalue("servers").get(f"stage_configs/{body['model']}.yaml")
    body["max_tokens"] = int(SMALL_MAX_TOKENS)  # small: the documented body otherwise as it is
    words[words.index("-d") + 1] = json.dumps(body)
    words = [w.replace("http://127.0.0.1:8000", server.url) for w in words]
    r = subprocess.run(words + ["--max-time", "120"], capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr
    events = [ln[len("data: "):] for ln in r.stdout.splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.stdout[-2000:]
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    audio = b"".join(base64.b64decode(c["choices"][0]["delta"]["audio"]["data"]) for c in chunks
                     if c["choices"] and (c["choices"][0]["delta"].get("audio") or {}).get("data"))
    assert text, "no text in the stream"
    if "audio" in body.get("modalities", []):
        assert len(audio) > 0 and len(audio) % 2 == 0, "no pcm16 audio in the stream"
    if body.get("stream_options", {}).get("include_usage"):
        assert chunks[-1]["usage"]["completion_tokens"] > 0


# Last: the runners above must exist when the parameters are built.
@pytest.mark.parametrize("doc,plan", _runs())
def test_documented_command(doc, plan, tmp_path, capsys, monkeypatch, request):
    monkeypatch.chdir(tmp_path)  # whatever a command writes into the current directory lands here
    for k, v in doc.env:
        monkeypatch.setenv(k, v)
    plan.run(doc, tmp_path, capsys, monkeypatch, request)
