"""A table-driven battery of bad inputs: bad configs, bad requests, bad media (issue 11).

Every row asserts the error type, that the message names the field, a bound on the time to
fail, and that a good request on a shared, already loaded pipeline afterwards succeeds with no
KV block in use (`check_integrity()` holds, every block is free, no request state is left).

A bad request either raises at the edge (`generate` raises a RequestError, a ValueError, before
anything is queued) or fails alone in its stage at admission (its `RequestOutput.error` is the
typed RequestError, naming the stage and the field; a good request in the same batch is unaffected).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml

from omni import Omni, SamplingParams
from omni.errors import ConfigError, RequestError, StageStartError
from omni.messages import StageInput, StageOutput
from tests.engine_utils import assert_no_leak

REPO = Path(__file__).resolve().parents[1]
CHAIN = REPO / "stage_configs" / "tiny_chain.yaml"
OMNI = REPO / "stage_configs" / "qwen2_5_omni_tiny.yaml"
# Bounds on the time to fail. They only tell "refused" from "waited for a timeout" (the messages
# already name the field, which a timeout's would not), so they sit far from both: orders of magnitude
# above the expected time on any machine, well below the timeouts of tiny_chain.yaml (request 120 s,
# stage start 300 s). A hand-tight bound (it was 1-3 s) failed on a loaded 2-core machine.
EDGE_S = 30.0  # checked before anything runs (expected: milliseconds)
LOAD_S = 30.0  # refused by the first stage before it loads its model (expected: well under 1 s)
ADMIT_S = 30.0  # refused by a loaded stage at admission (expected: one step, milliseconds)
START_S = 100.0  # a config refused once an earlier stage has loaded its model (expected: a few s)
GOOD = SamplingParams(temperature=0, max_tokens=3)


def stage_engines(o: Omni) -> dict[str, Any]:
    """The engines of a local-backend pipeline."""
    return {name: worker.engine for name, worker in o._backend.workers.items()}


def assert_serves_and_holds_nothing(o: Omni, good: Any, sampling: Any = GOOD) -> None:
    [out] = o.generate([good], sampling, use_tqdm=False)
    assert out.error is None, out.error
    assert set(out.outputs) == set(o.graph.final_stages)
    for name, engine in stage_engines(o).items():
        if hasattr(engine, "kv"):
            assert_no_leak(engine)
        assert not engine.has_unfinished(), name
    stats = o.stats()
    assert stats["requests"]["in_flight"] == 0
    assert all(s["kv_usage"] == 0 for s in stats["stages"].values())


@pytest.fixture(scope="module")
def chain():
    with Omni(CHAIN, backend="local") as o:
        yield o


# ------------------------------------------------------------------- configs
def chain_data() -> dict[str, Any]:
    return yaml.safe_load(CHAIN.read_text())


def thinker(**kw: Any) -> Callable[[dict], None]:
    return lambda d: d["stages"][0].update(kw)


def talker(**kw: Any) -> Callable[[dict], None]:
    return lambda d: d["stages"][1].update(kw)


def runtime(**kw: Any) -> Callable[[dict], None]:
    return lambda d: d["runtime"].update(kw)


@dataclass(frozen=True)
class ConfigRow:
    id: str
    bad: Callable[[dict], None] | str  # edits the tiny chain's dict, or the text of a YAML file
    error: type[BaseException]
    names: tuple[str, ...]  # in the message: the stage and the field
    bound_s: float = EDGE_S
    overrides: Any = None


CONFIG_ROWS = [
    ConfigRow("block_size_0", thinker(cache={"block_size": 0}), ConfigError, ("stage 'thinker'", "cache.block_size")),
    ConfigRow("block_size_true", thinker(cache={"block_size": True}), ConfigError,
              ("stage 'thinker'", "cache.block_size", "got true")),
    ConfigRow("num_blocks_1", talker(cache={"num_blocks": 1}), ConfigError, ("stage 'talker'", "cache.num_blocks")),
    ConfigRow("num_blocks_billion", thinker(cache={"num_blocks": 1_000_000_000}), StageStartError,
              ("stage 'thinker'", "cache.num_blocks", "of host memory", "blocks fit"), LOAD_S),
    ConfigRow("talker_budget_too_big", talker(cache={"memory_budget_mb": 1e8}), StageStartError,
              ("stage 'talker'", "cache.memory_budget_mb", "of host memory"), START_S),
    ConfigRow("num_blocks_and_budget", thinker(cache={"num_blocks": 8, "memory_budget_mb": 1}), ConfigError,
              ("stage 'thinker'", "num_blocks or memory_budget_mb")),
    ConfigRow("unknown_key", thinker(enable_prefix_cache=False), ConfigError,
              ("stage 'thinker'", "unknown key 'enable_prefix_cache'", "enable_prefix_caching")),
    ConfigRow("temperature", thinker(sampling={"temperature": -1}), ConfigError,
              ("stage 'thinker'", "sampling.temperature")),
    ConfigRow("max_tokens_bool", talker(sampling={"max_tokens": True}), ConfigError,
              ("stage 'talker'", "sampling.max_tokens", "got true")),
    ConfigRow("max_num_seqs", thinker(scheduler={"max_num_seqs": 0}), ConfigError,
              ("stage 'thinker'", "scheduler.max_num_seqs")),
    ConfigRow("chunked_prefill_off", thinker(scheduler={"enable_chunked_prefill": False, "max_model_len": 256,
                                                        "max_num_batched_tokens": 64}), ConfigError,
              ("stage 'thinker'", "max_num_batched_tokens")),
    ConfigRow("model", thinker(model="nope"), ConfigError, ("stage 'thinker'", "model", "unknown stage model 'nope'")),
    ConfigRow("input_processor", talker(input_processor="nope"), ConfigError,
              ("stage 'talker'", "input_processor", "'nope'")),
    ConfigRow("inputs", talker(inputs=["ghost"]), ConfigError, ("stage 'talker'", "inputs", "'ghost'")),
    ConfigRow("dtype", thinker(dtype="float8"), ConfigError, ("stage 'thinker'", "dtype")),
    ConfigRow("device", thinker(device="tpu"), ConfigError, ("stage 'thinker'", "device")),
    ConfigRow("max_restarts", thinker(max_restarts=-2), ConfigError, ("stage 'thinker'", "max_restarts")),
    ConfigRow("num_gpus", thinker(resources={"num_gpus": -1}), ConfigError, ("stage 'thinker'", "resources.num_gpus")),
    ConfigRow("timeout", runtime(request_timeout_s=0), ConfigError, ("runtime.request_timeout_s",)),
    ConfigRow("model_path", thinker(model_path="/nonexistent/model"), StageStartError,
              ("stage 'thinker'", "model path '/nonexistent/model' does not exist"), LOAD_S),
    ConfigRow("builtin", thinker(model_path="builtin:tiny-gpt"), StageStartError,
              ("stage 'thinker'", "unknown builtin model 'tiny-gpt'"), LOAD_S),
    ConfigRow("tokenizer_path", thinker(tokenizer="/nonexistent/tok"), StageStartError,
              ("stage 'thinker'", "tokenizer path '/nonexistent/tok' does not exist"), LOAD_S),
    ConfigRow("override_unknown_stage", lambda d: None, ConfigError, ("stage_overrides", "'talkr'"),
              overrides={"talkr": {"dtype": "float16"}}),
    ConfigRow("override_not_json", lambda d: None, ConfigError, ("stage_overrides", "not valid JSON"),
              overrides="{nope"),
    ConfigRow("duplicate_yaml_key", CHAIN.read_text().replace("    cache: {block_size: 4, num_blocks: 256}\n",
                                                              "    cache: {block_size: 4}\n    cache: {num_blocks: 8}\n", 1),
              ConfigError, ("duplicate key 'cache'", "first on line")),
    ConfigRow("yaml_not_a_mapping", "- just\n- a list\n", ConfigError, ("top level must be a mapping",)),
]


@pytest.mark.parametrize("row", CONFIG_ROWS, ids=lambda r: r.id)
def test_bad_config(row: ConfigRow, chain, tmp_path):
    if isinstance(row.bad, str):
        source: Any = tmp_path / "bad.yaml"
        source.write_text(row.bad)
    else:
        source = chain_data()
        row.bad(source)
    t0 = time.monotonic()
    with pytest.raises(row.error) as ei:
        Omni(source, stage_overrides=row.overrides, backend="local").close()
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert all(n in msg for n in row.names), msg
    assert len(msg.splitlines()) == 1, msg
    assert took < row.bound_s, f"took {took:.1f}s"
    assert_serves_and_holds_nothing(chain, "Hello")


# ------------------------------------------------------------------ requests
@dataclass(frozen=True)
class RequestRow:
    id: str
    prompt: Any
    names: tuple[str, ...]  # in the message
    raises: bool = True  # at the edge; else the request fails alone in its stage, at admission
    sampling: Any = None  # None: the good sampling parameters


def embeds(rows: int, width: int = 64, value: float = 0.1) -> list[list[float]]:
    return (np.full((rows, width), value, dtype=np.float32)).tolist()


IMAGE = np.zeros((28, 28, 3), dtype=np.uint8)
NAN_EMBEDS = np.full((3, 64), np.nan, dtype=np.float32)

REQUEST_ROWS = [
    RequestRow("int_prompt", 5, ("prompts: expected a str, a dict",)),
    RequestRow("list_of_ints", [1, 2, 3], ("prompts: a list of ints is ambiguous",)),
    RequestRow("unknown_key", {"promt": "hi"}, ("prompts[0]: unknown key 'promt'",)),
    RequestRow("chat_at_top_level", {"role": "user", "content": "hi"}, ("unknown key 'role'", "go under 'prompt'")),
    RequestRow("nothing", {"cache_salt": "s"}, ("prompts[0]: needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'",)),
    RequestRow("prompt_int", {"prompt": 5}, ("prompts[0]: prompt: expected text",)),
    RequestRow("messages_empty", {"prompt": []}, ("prompts[0]: prompt: expected a non-empty list of chat messages",)),
    RequestRow("message_not_dict", {"prompt": ["hi"]}, ("prompts[0]: prompt.messages[0]: expected a dict",)),
    RequestRow("message_no_role", {"prompt": [{"content": "hi"}]}, ("prompt.messages[0].role",)),
    RequestRow("message_no_content", {"prompt": [{"role": "user"}]}, ("prompt.messages[0].content",)),
    RequestRow("message_content_int", {"prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": 3}]},
               ("prompt.messages[1].content: expected text or a list of content parts, got int",)),
    RequestRow("content_part_unknown", {"prompt": [{"role": "user", "content": [{"type": "hologram"}]}]},
               ("prompt.messages[0].content[0]: expected a dict with 'type' in",)),
    RequestRow("content_part_text_int", {"prompt": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
               ("prompt.messages[0].content[0].text: expected a str",)),
    RequestRow("ids_not_list", {"prompt_token_ids": "12"}, ("prompts[0]: prompt_token_ids: expected a list of ints",)),
    RequestRow("ids_floats", {"prompt_token_ids": [1.5]}, ("prompt_token_ids: expected a list of ints",)),
    RequestRow("ids_bools", {"prompt_token_ids": [True]}, ("prompt_token_ids: expected a list of ints",)),
    RequestRow("ids_negative", {"prompt_token_ids": [5, -1]}, ("prompt_token_ids: token id -1",), False),
    RequestRow("ids_out_of_vocab", {"prompt_token_ids": [10**9]}, ("prompt_token_ids: token id 1000000000",
                                                                   "out of vocabulary"), False),
    RequestRow("ids_empty", {"prompt_token_ids": []},
               ("prompts[0]: prompt_token_ids: the prompt is empty (0 tokens)",)),
    RequestRow("embeds_empty", {"prompt_embeds": np.zeros((0, 64), dtype=np.float32)},
               ("prompts[0]: prompt_embeds: the prompt is empty (0 rows)",)),
    RequestRow("text_empty", {"prompt": ""}, ("prompt: the prompt is empty",), False),
    RequestRow("too_long", {"prompt_token_ids": [5] * 300}, ("prompt: 300 tokens + max_tokens 3",
                                                              "exceed max_model_len 256 of stage 'thinker'"), False),
    RequestRow("embeds_1d", {"prompt_embeds": [0.1, 0.2]}, ("prompts[0]: prompt_embeds: expected shape",)),
    RequestRow("embeds_strings", {"prompt_embeds": [["a"]]}, ("prompts[0]: prompt_embeds: expected a [num_tokens",)),
    RequestRow("embeds_width", {"prompt_embeds": embeds(3, width=7)}, ("prompt_embeds: expected shape (3, 64)",),
               False),
    RequestRow("embeds_nan", {"prompt_embeds": NAN_EMBEDS}, ("prompt_embeds: contains NaN",), False),
    RequestRow("request_id_int", {"prompt": "hi", "request_id": 5}, ("prompts[0]: request_id: expected a str",)),
    RequestRow("cache_salt_int", {"prompt": "hi", "cache_salt": 5}, ("prompts[0]: cache_salt: expected a str",)),
    RequestRow("duplicate_running_id", [{"prompt": "a", "request_id": "dup"}, {"prompt": "b", "request_id": "dup"}],
               ("request_id 'dup' is already in use",)),
    RequestRow("mm_not_dict", {"prompt": "hi", "multi_modal_data": [IMAGE]}, ("prompts[0]: multi_modal_data: expected a dict",)),
    RequestRow("mm_unknown", {"prompt": "hi", "multi_modal_data": {"smell": IMAGE}},
               ("prompts[0]: multi_modal_data: unknown modality 'smell'",)),
    RequestRow("mm_video_3d", {"prompt": "hi", "multi_modal_data": {"video": IMAGE}},
               ("prompts[0]: multi_modal_data.video[0]: expected frames as a TxHxWxC array", "got shape (28, 28, 3)")),
    RequestRow("video_to_text_stage", {"prompt": "hi", "multi_modal_data": {"video": IMAGE[None].repeat(2, 0)}},
               ("multi_modal_data: stage 'thinker' takes no video inputs",), False),
    RequestRow("mm_processor_kwargs_type", {"prompt": "hi", "mm_processor_kwargs": ["use_audio_in_video"]},
               ("prompts[0]: mm_processor_kwargs: expected a dict",)),
    RequestRow("image_to_text_stage", {"prompt": "hi", "multi_modal_data": {"image": IMAGE}},
               ("multi_modal_data: stage 'thinker' takes no image inputs",), False),
    RequestRow("image_part_to_text_stage", {"prompt": [{"role": "user", "content": [{"type": "image"}]}]},
               ("prompt.messages[0].content: stage 'thinker' takes text only",), False),
    RequestRow("sampling_mixed", "hi", ("sampling_params: mixes stage names (thinker)", "sampling fields (temperature)"),
               sampling={"thinker": {"max_tokens": 2}, "temperature": 0}),
    RequestRow("sampling_unknown", "hi", ("sampling_params: 'nope' is neither a stage",), sampling={"nope": 1}),
    RequestRow("sampling_temperature", "hi", ("sampling_params for stage 'thinker'", "temperature"),
               sampling={"temperature": -1}),
    RequestRow("sampling_max_tokens_0", "hi", ("sampling_params for stage 'talker'", "max_tokens"),
               sampling={"talker": {"max_tokens": 0}}),
    RequestRow("sampling_max_tokens_bool", "hi", ("sampling_params for stage 'thinker'", "max_tokens",
                                                  "expected a number, got true"), sampling={"max_tokens": True}),
    RequestRow("sampling_top_p", "hi", ("top_p",), sampling={"thinker": {"top_p": 2}}),
    RequestRow("sampling_list_length", "hi", ("sampling_params: a list needs one entry per stage (2",),
               sampling=[GOOD]),
    RequestRow("sampling_type", "hi", ("sampling_params: expected a SamplingParams",), sampling=3),
]


def fail_alone(o: Omni, bad: dict[str, Any], good: Any, sampling: Any) -> tuple[Any, float]:
    """Stream `bad` (with `good` in the same batch unless None): (bad's error, seconds until it came)."""
    prompts = [{**bad, "request_id": "bad"}]
    if good is not None:
        prompts.append({**({"prompt": good} if isinstance(good, str) else good), "request_id": "good"})
    t0 = time.monotonic()
    events: dict[str, list] = {"bad": [], "good": []}
    took = float("inf")
    for ev in o.stream(prompts, sampling):
        if isinstance(ev, StageOutput):  # (stream() also yields StageDeltas while stages generate)
            events[ev.request_id].append(ev)
            if ev.request_id == "bad":
                took = min(took, time.monotonic() - t0)
    [failed] = events["bad"]  # exactly one terminal output
    if good is not None:  # served as if the bad one were not there
        assert all(ev.error is None for ev in events["good"]), [ev.error for ev in events["good"]]
        assert sorted(ev.stage for ev in events["good"]) == sorted(o.graph.final_stages)
    return failed.error, took


def check_request_row(o: Omni, row: RequestRow, good: Any, good_sampling: Any = GOOD, in_batch: bool = True) -> None:
    if row.raises:
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            o.generate(row.prompt, good_sampling if row.sampling is None else row.sampling, use_tqdm=False)
        err, took = ei.value, time.monotonic() - t0
    else:  # fails alone in its stage, at admission (with a good request in the same batch: it is served)
        err, took = fail_alone(o, row.prompt, good if in_batch else None, good_sampling)
        # Typed: the caller's fault, the stage that refused it and the field at fault (not just words).
        assert isinstance(err, RequestError), repr(err)
        assert err.stage in o.graph.stages and err.field is not None and err.request_id == "bad", repr(err)
    msg = str(err)
    assert all(n in msg for n in row.names), msg
    assert took < (EDGE_S if row.raises else ADMIT_S), f"took {took:.1f}s"
    assert_serves_and_holds_nothing(o, good, good_sampling)


@pytest.mark.parametrize("row", REQUEST_ROWS, ids=lambda r: r.id)
def test_bad_request(row: RequestRow, chain):
    check_request_row(chain, row, "Hello")


# --------------------------------------------------------------------- media
OMNI_GOOD = {"thinker": {"max_tokens": 2}, "talker": {"max_tokens": 4}}
TOKEN2WAV_FAST = {"token2wav": {"model_kwargs": {"num_steps": 2}}}  # a waveform in a fraction of the time


@pytest.fixture(scope="module")
def omni():
    with Omni(OMNI, stage_overrides=TOKEN2WAV_FAST, backend="local") as o:
        yield o


def img(*shape: int, dtype: Any = np.uint8, value: Any = 0) -> np.ndarray:
    return np.full(shape, value, dtype=dtype)


def wave(n: int = 16000, value: float = 0.01) -> np.ndarray:
    return np.full(n, value, dtype=np.float32)


def with_media(**media: Any) -> dict[str, Any]:
    return {"prompt": "What is this?", "multi_modal_data": media}


MEDIA_ROWS = [
    RequestRow("image_0x0", with_media(image=img(0, 0, 3)),
               ("multi_modal_data.image[0]: the image is empty (0x0 pixels)",), False),
    RequestRow("image_0_wide", with_media(image=img(0, 5)), ("multi_modal_data.image[0]: the image is empty",), False),
    RequestRow("image_1d", with_media(image=img(28)), ("multi_modal_data.image[0]: expected an HxW or HxWxC",), False),
    RequestRow("image_5_channels", with_media(image=img(28, 28, 5)), ("multi_modal_data.image[0]: expected an HxW",
                                                                       "got shape (28, 28, 5)"), False),
    RequestRow("image_nan", with_media(image=img(28, 28, 3, dtype=np.float32, value=np.nan)),
               ("multi_modal_data.image[0]: holds NaN or inf",), False),
    RequestRow("image_float_0_255", with_media(image=img(28, 28, 3, dtype=np.float32, value=200.0)),
               ("multi_modal_data.image[0]: float pixel values must be in [0, 1]",), False),
    RequestRow("image_int_range", with_media(image=img(28, 28, 3, dtype=np.int64, value=1000)),
               ("multi_modal_data.image[0]: integer pixel values must be in 0..255",), False),
    RequestRow("image_aspect", with_media(image=img(1, 300, 3)), ("multi_modal_data.image[0]: aspect ratio",), False),
    RequestRow("second_image_bad", with_media(image=[img(28, 28, 3), img(0, 0, 3)]),
               ("multi_modal_data.image[1]: the image is empty",), False),
    RequestRow("image_strings", with_media(image=np.array([["a"]])), ("prompts[0]: multi_modal_data.image[0]: "
                                                                       "expected an array of numbers",)),
    RequestRow("image_ragged", with_media(image=[[[1, 2], [3]]]), ("multi_modal_data.image[0]: expected an array",)),
    RequestRow("image_tuple", with_media(image=(img(28, 28, 3), 5)), ("multi_modal_data.image[0]: expected an array, "
                                                                       "got a tuple of 2",)),
    RequestRow("audio_3_tuple", with_media(audio=(wave(), 16000, "extra")),
               ("prompts[0]: multi_modal_data.audio[0]: expected (waveform, sampling_rate), got a tuple of 3",)),
    RequestRow("audio_rate_str", with_media(audio=(wave(), "16k")),
               ("multi_modal_data.audio[0].sampling_rate: expected an int > 0",)),
    RequestRow("audio_rate_wrong", with_media(audio=(wave(), 8000)),
               ("multi_modal_data.audio[0]: sampling_rate must be 16000 Hz, got 8000",), False),
    RequestRow("audio_2d", with_media(audio=np.zeros((2, 16000), dtype=np.float32)),
               ("multi_modal_data.audio[0]: expected a mono 1-D waveform",), False),
    RequestRow("audio_nan", with_media(audio=wave(value=np.nan)), ("multi_modal_data.audio[0]: holds NaN or inf",), False),
    RequestRow("audio_short", with_media(audio=wave(100)), ("multi_modal_data.audio[0]: 100 samples, at least 400",),
               False),
    RequestRow("audio_empty", with_media(audio=wave(0)), ("multi_modal_data.audio[0]: 0 samples",), False),
    RequestRow("placeholders", {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                                "multi_modal_data": {"image": img(28, 28, 3)}},
               ("prompt: more image placeholders than image mm_inputs",), False),
    RequestRow("media_without_user_turn", {"prompt": [{"role": "system", "content": "be brief"}],
                                           "multi_modal_data": {"image": img(28, 28, 3)}},
               ("multi_modal_data: the messages have no user turn",), False),
    RequestRow("message_no_role_omni", {"prompt": [{"content": [{"type": "image"}]}],
                                        "multi_modal_data": {"image": img(28, 28, 3)}},
               ("prompts[0]: prompt.messages[0].role",)),
    RequestRow("thinker_ids_out_of_vocab", {"prompt_token_ids": [10**9]}, ("prompt_token_ids: token id",),
               False),
    RequestRow("video_not_a_file", with_media(video=b"not a video"),
               ("multi_modal_data.video[0]: not a readable video file",), False),
    RequestRow("video_no_such_file", with_media(video="/nonexistent/clip.mp4"),
               ("prompts[0]: multi_modal_data.video[0]: no such file: /nonexistent/clip.mp4",)),
    RequestRow("video_fps_zero", with_media(video=(img(4, 28, 28, 3), 0)),
               ("prompts[0]: multi_modal_data.video[0].fps: expected a number > 0",)),
    RequestRow("video_float_frames", with_media(video=img(4, 28, 28, 3, dtype=np.float32)),
               ("multi_modal_data.video[0]: frames must be integers 0..255 (uint8), got float32",), False),
    RequestRow("video_one_frame_at_a_rate", with_media(video=(img(1, 28, 28, 3), 5.0)),
               ("multi_modal_data.video[0]: 1 frame(s); a video needs at least 2",), False),
    RequestRow("video_track_missing", {**with_media(video=img(4, 28, 28, 3)),
                                       "mm_processor_kwargs": {"use_audio_in_video": True}},
               ("multi_modal_data.video[0]: use_audio_in_video needs the video's audio track",), False),
    RequestRow("mm_processor_kwargs_unknown", {**with_media(video=img(4, 28, 28, 3)),
                                               "mm_processor_kwargs": {"num_frames": 8}},
               ("mm_processor_kwargs.num_frames: not a setting of this model's processor",), False),
    RequestRow("video_too_long", with_media(video=(img(4000, 28, 28, 3), 1.0)),
               ("multi_modal_data.video[0]: 4000 s of video (4000 frames at 1 fps), longer than the limit of 600 s",),
               False),
]


@pytest.mark.parametrize("row", MEDIA_ROWS, ids=lambda r: r.id)
def test_bad_media(row: RequestRow, omni):
    # The media rows share the chain rows' same-batch check (the same admission path); a whole
    # Qwen2.5-Omni request (thinker, talker, token2wav) afterwards proves the pipeline serves.
    check_request_row(omni, row, with_media(image=img(28, 28, 3), audio=(wave(), 16000)), OMNI_GOOD, in_batch=False)


QWEN3 = REPO / "stage_configs" / "qwen3_omni_tiny.yaml"
QWEN3_GOOD = {"thinker": {"max_tokens": 2}, "talker": {"max_tokens": 4}}


@pytest.fixture(scope="module")
def qwen3():
    with Omni(QWEN3, backend="local") as o:
        yield o


@pytest.mark.parametrize("pipeline,sampling", [("chain", GOOD), ("omni", OMNI_GOOD),
                                               pytest.param("qwen3", QWEN3_GOOD, marks=pytest.mark.slow)])
def test_empty_token_ids_are_the_callers_fault_on_every_entry_stage(pipeline, sampling, request):
    """No prompt tokens is refused naming the field on every entry stage model, not only on those whose own
    preprocessing happens to survive 0 tokens (Qwen2.5-Omni's thinker failed with an internal IndexError, a
    stage_failed StageError)."""
    o = request.getfixturevalue(pipeline)
    with pytest.raises(RequestError, match=r"^prompts\[0\]: prompt_token_ids: the prompt is empty \(0 tokens\)$"):
        o.generate([{"prompt_token_ids": []}], sampling, use_tqdm=False)  # the edge refuses the dict form
    # A StageInput is taken as is: the entry stage itself must refuse it, with the typed error.
    [out] = o.generate([StageInput("bad", prompt_token_ids=[])], sampling, use_tqdm=False)
    err = out.error
    assert isinstance(err, RequestError), repr(err)
    assert (err.stage, err.field, err.code, err.request_id) == ("thinker", "prompt_token_ids", "invalid_value", "bad")
    assert err.message.endswith(": prompt_token_ids: the prompt is empty (0 tokens)"), err.message
    assert_serves_and_holds_nothing(o, "Hello", sampling)


def test_out_of_vocabulary_stop_token_ids_are_refused_with_the_numbers(chain):
    """Issue 23, class 6: every token id in a request is checked against the stage's vocabulary."""
    vocab = stage_engines(chain)["thinker"].model.vocab_size
    [out] = chain.generate(["Hello"], {"thinker": {"stop_token_ids": [1, vocab], "max_tokens": 3}}, use_tqdm=False)
    err = out.error
    assert isinstance(err, RequestError), repr(err)
    assert (err.stage, err.field, err.code, err.limit, err.actual) == (
        "thinker", "sampling_params.stop_token_ids", "invalid_value", vocab, vocab)
    assert f"token id {vocab} is out of vocabulary" in err.message
    assert_serves_and_holds_nothing(chain, "Hello")
