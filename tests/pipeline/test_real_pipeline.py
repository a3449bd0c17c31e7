"""The real StageEngine through the pipeline (stage_configs/tiny_chain.yaml: tiny random Qwen2 thinker ->
talker fed with the thinker's hidden states).

- per-stage prefix caching on/off (all four combinations) changes the stats, never the outputs, on a
  multi-turn workload where each turn extends the previous one, so both stages hit (the talker's prompt
  embeddings share their leading rows with the previous turn's);
- hidden states come back on request, with one row per computed token;
- the Ray backend (one actor per stage) gives the same outputs and the same cache hits as the local one.

Most cases run on the local backend. Loaded models are shared between the local pipelines of this module
(`shared_causal_lm`), the Ray actors load their own, on the session's shared Ray cluster (`ray_cluster`).
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni import Omni
from stages.checkpoints.tiny_lm import TINY_ARCHS
from tests.tolerances import assert_rows_close, decoder_atol

CONFIG = str(Path(__file__).resolve().parents[2] / "stage_configs" / "tiny_chain.yaml")
BLOCK = 4  # cache.block_size of both stages in tiny_chain.yaml
HIDDEN = 64  # hidden size of builtin:tiny-qwen2
MAX_TOKENS = 8  # sampling.max_tokens of both stages
# Decoder layers behind each stage's hidden states: the talker's prompt embeddings are the thinker's
# hidden states, so the thinker's rounding reaches the talker's output through both models.
LAYERS = {"thinker": TINY_ARCHS["qwen2"], "talker": 2 * TINY_ARCHS["qwen2"]}


def hidden_atol(ref, stage: str = "thinker") -> float:
    """Recomputed vs cached rows differ only in how fp32 sums are blocked: the decoder bound (tiny
    Qwen2: hidden 64, intermediate 128; the longest sum is 128 terms or the rows attended)."""
    return decoder_atol(ref, layers=LAYERS[stage], widest_sum=max(128, len(ref)))

# Several concurrent requests; two share a long prefix (hits inside one batch).
PROMPTS = [
    "Hello, my name is",
    "The capital of France is Paris, and the capital of Italy is",
    "The capital of France is Paris, and the capital of Spain is",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    {"prompt_token_ids": [11, 22, 33, 44, 55]},
]
FIRST_TURN = "You are a helpful assistant. What is the capital of France?"
# New user tokens appended after each turn's reply (token ids of the tiny Qwen2 vocabulary).
FOLLOW_UPS = [[3555, 374, 432, 11245, 369, 30], [60424, 825, 23680, 13]]


def multi_turn(o: Omni) -> list[Any]:
    """Each turn resends the conversation so far (prompt + reply) plus new tokens."""
    outs, prompt = [], {"prompt": FIRST_TURN}
    for turn in range(len(FOLLOW_UPS) + 1):
        [r] = o.generate([prompt], use_tqdm=False, return_hidden_states=True)
        assert r.error is None, r.error
        outs.append(r)
        if turn < len(FOLLOW_UPS):
            th = r.outputs["thinker"]
            prompt = {"prompt_token_ids": th.prompt_token_ids + th.token_ids + FOLLOW_UPS[turn]}
    return outs


def run_workload(o: Omni) -> dict[str, Any]:
    turns = multi_turn(o)
    stats = o.stats()["stages"]
    batch = o.generate(PROMPTS, use_tqdm=False, return_hidden_states=True)
    plain = o.generate(PROMPTS[:2], use_tqdm=False)
    return {"turns": turns, "turn_stats": stats, "batch": batch, "plain": plain}


def computed_rows(out) -> int:
    """Rows of per-token outputs: every token fed through the model (the last sampled one never is)."""
    return len(out.prompt_token_ids) + len(out.token_ids) - 1


def assert_same_outputs(got, want, exact_hidden: tuple[str, ...] = ()) -> None:
    """Same tokens and text; hidden states bit-identical for the stages in `exact_hidden`, else close."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.error is None and w.error is None, (g.error, w.error)
        assert set(g.outputs) == set(w.outputs) == {"thinker", "talker"}
        for stage in ("thinker", "talker"):
            a, b = g.outputs[stage], w.outputs[stage]
            assert a.token_ids == b.token_ids, stage
            assert a.text == b.text, stage
            assert a.prompt_token_ids == b.prompt_token_ids, stage
            assert a.finish_reason == b.finish_reason, stage
            if b.hidden_states is None:
                assert a.hidden_states is None
            elif stage in exact_hidden:
                np.testing.assert_array_equal(a.hidden_states, b.hidden_states)
            else:
                assert_rows_close(a.hidden_states, b.hidden_states, hidden_atol(b.hidden_states, stage), stage)


# ----------------------------------------------------------------- fixtures
def local_omni(thinker: bool = True, talker: bool = True) -> Omni:
    overrides = {"thinker": {"enable_prefix_caching": thinker}, "talker": {"enable_prefix_caching": talker}}
    return Omni(CONFIG, stage_overrides=overrides, backend="local")


@pytest.fixture(scope="module")
def reference(shared_causal_lm):
    """Local backend, caching on in both stages (the config's defaults)."""
    with local_omni() as o:
        assert o.backend == "local"
        return run_workload(o)


# ------------------------------------------------------------------- local
def test_hidden_states_on_request_have_one_row_per_computed_token(reference):
    for r in reference["batch"]:
        assert r.error is None, r.error
        th, tk = r.outputs["thinker"], r.outputs["talker"]
        assert isinstance(th.text, str) and 1 <= len(th.token_ids) <= MAX_TOKENS
        assert len(tk.token_ids) == MAX_TOKENS  # ignore_eos
        assert th.hidden_states.shape == (computed_rows(th), HIDDEN)
        assert th.hidden_states.dtype == np.float32 and np.isfinite(th.hidden_states).all()
        # The talker's prompt is one row per thinker row (hidden_to_embeds).
        assert len(tk.prompt_token_ids) == computed_rows(th)
        assert tk.hidden_states.shape == (computed_rows(tk), HIDDEN)
    # Not asked for: no per-token rows come back, the rest is the same.
    for plain, full in zip(reference["plain"], reference["batch"]):
        for stage in ("thinker", "talker"):
            assert plain.outputs[stage].hidden_states is None
            assert plain.outputs[stage].mm_outputs == {}
            assert plain.outputs[stage].token_ids == full.outputs[stage].token_ids


def test_batched_requests_sharing_a_prefix(reference):
    a, b = (reference["batch"][i].outputs["thinker"] for i in (1, 2))
    shared = next(i for i, (x, y) in enumerate(zip(a.prompt_token_ids, b.prompt_token_ids)) if x != y)
    assert shared >= 2 * BLOCK
    # Equal leading tokens -> equal leading hidden rows, whether computed or served from the cache.
    assert_rows_close(a.hidden_states[:shared], b.hidden_states[:shared], hidden_atol(b.hidden_states[:shared]))


def test_multi_turn_hits_in_both_stages(reference):
    turns = reference["turns"]
    for prev, cur in zip(turns, turns[1:]):
        p_th, c_th = prev.outputs["thinker"], cur.outputs["thinker"]
        rows = computed_rows(p_th)
        full = rows // BLOCK * BLOCK
        # This turn's prompt extends the previous turn's conversation...
        assert c_th.prompt_token_ids[: rows + 1] == p_th.prompt_token_ids + p_th.token_ids
        # ...so the thinker hits every full block the previous turn computed,
        assert c_th.num_cached_tokens == full > 0
        # hands the cached rows (bit-identical) downstream, followed by the recomputed ones,
        np.testing.assert_array_equal(c_th.hidden_states[:full], p_th.hidden_states[:full])
        assert_rows_close(c_th.hidden_states[:rows], p_th.hidden_states[:rows], hidden_atol(p_th.hidden_states[:rows]))
        # and the talker, whose prompt embeddings share those leading rows, hits them too.
        assert cur.outputs["talker"].num_cached_tokens == full
    st = reference["turn_stats"]
    for stage in ("thinker", "talker"):
        assert st[stage]["prefix_caching"] is True
        assert st[stage]["prefix_cache_hits"] > 0
        assert st[stage]["tensor_cache_rows_served"] == st[stage]["prefix_cache_hits"]
        assert st[stage]["ttft_mean_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("thinker_on, talker_on", [c for c in itertools.product([True, False], repeat=2)
                                                   if c != (True, True)],
                         ids=lambda v: "on" if v else "off")
def test_caching_toggle_changes_stats_never_outputs(reference, thinker_on, talker_on):
    with local_omni(thinker_on, talker_on) as o:
        got = run_workload(o)
    for key in ("turns", "batch", "plain"):
        # With its cache on in both runs, the thinker computes the same rows in the same batches.
        exact = ("thinker",) if thinker_on and key != "batch" else ()
        assert_same_outputs(got[key], reference[key], exact_hidden=exact)

    st, ref_st = got["turn_stats"], reference["turn_stats"]
    for stage, on in (("thinker", thinker_on), ("talker", talker_on)):
        assert st[stage]["prefix_caching"] is on
        assert st[stage]["finished"] == ref_st[stage]["finished"]
        cached = [r.outputs[stage].num_cached_tokens for r in got["turns"]]
        if not on:
            assert st[stage]["prefix_cache_hits"] == st[stage]["prefix_cache_queries"] == 0
            assert cached == [0] * len(cached)
            assert "tensor_cache_rows_served" not in st[stage]  # no tensor cache either
    if thinker_on:
        assert st["thinker"]["prefix_cache_hits"] == ref_st["thinker"]["prefix_cache_hits"] > 0
        assert [r.outputs["thinker"].num_cached_tokens for r in got["turns"]] == \
            [r.outputs["thinker"].num_cached_tokens for r in reference["turns"]]
    if talker_on:
        # The talker hits wherever its prompt rows are bit-identical to an earlier request's: all the
        # shared rows when the thinker serves them from its cache; recomputed rows may differ in the
        # last bit (as this machine's kernels decide), so with the thinker's cache off the exact number
        # is counted from the rows themselves: each turn's leading full blocks of thinker rows equal,
        # bit for bit, to the previous turn's (the talker cached those as its prompt).
        hits, ref_hits = st["talker"]["prefix_cache_hits"], ref_st["talker"]["prefix_cache_hits"]
        if thinker_on:
            assert hits == ref_hits
        else:
            expected = [0]  # the first turn finds nothing cached
            for prev, cur in zip(got["turns"], got["turns"][1:]):
                p_th, c_th = prev.outputs["thinker"], cur.outputs["thinker"]
                rows = computed_rows(p_th)
                differs = np.flatnonzero((c_th.hidden_states[:rows] != p_th.hidden_states[:rows]).any(axis=1))
                same = int(differs[0]) if differs.size else rows
                expected.append(same // BLOCK * BLOCK)
            assert [r.outputs["talker"].num_cached_tokens for r in got["turns"]] == expected
            assert hits == sum(expected) <= ref_hits


# --------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_run(ray_cluster, reference):
    with Omni(CONFIG, backend="ray") as o:
        assert o.backend == "ray"
        pids = {s["pid"] for s in o.stats()["stages"].values()}
        assert len(pids) == 2 and os.getpid() not in pids  # one actor process per stage
        return run_workload(o)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_and_local_give_identical_outputs(ray_run, reference):
    assert_same_outputs(ray_run["batch"], reference["batch"])
    assert_same_outputs(ray_run["plain"], reference["plain"])
    assert_same_outputs(ray_run["turns"], reference["turns"])


@pytest.mark.ray
@pytest.mark.slow
def test_ray_multi_turn_hits_like_local(ray_run, reference):
    # Hidden states cross the object store as float32 numpy, bit for bit: the talker hits as in-process.
    for got, want in zip(ray_run["turns"], reference["turns"]):
        for stage in ("thinker", "talker"):
            assert got.outputs[stage].num_cached_tokens == want.outputs[stage].num_cached_tokens
    for stage in ("thinker", "talker"):
        for key in ("prefix_cache_queries", "prefix_cache_hits", "finished"):
            assert ray_run["turn_stats"][stage][key] == reference["turn_stats"][stage][key], (stage, key)
