"""`omni bench token2wav`: Qwen2.5-Omni's token2wav stage vs transformers' own, side by side.

For each reply length (codec tokens; 50 per second of audio) the same codes, speaker and noise seed
go through transformers' `Qwen2_5OmniToken2WavModel.forward` (DiT sampler + BigVGAN) and through our
stage's `generate` (the same DiT with the request's constants computed once per request instead of
at each of the 36 ODE evaluations, and attention block by block over each block's window of the
DiT's block mask instead of over every frame pair), alternating, best of --repeats. Reports per
length: seconds each, `speedup` (transformers / ours), `rtf` (ours: seconds per second of audio),
and how the two waveforms agree: `bitwise_equal` (a request of up to two DiT blocks: every layer runs the
full attention, the same ops), else `snr_db` (null when bitwise; the same math with its fp32 sums in another order);
`outputs_agree` is every length bitwise or at >= 100 dB SNR, as `omni bench capacity` judges.

Streamed, a newcomer's first audio (`newcomer`): the stage's engine streams a 250-code reply (the
chunks of stage_configs/qwen2_5_omni_small.yaml: 8, then 50 doubling to 100) and a second request
arrives once the first one's second window is in flight; its time to first audio beside the time of
the same request alone, `newcomer_wait_ratio` = behind / alone. Windows advance one Runge-Kutta step
per engine step with the newcomer's first window ahead (omni/engine/in_flight.py), so the ratio is
about 1 plus one step of the window in flight, where a newcomer used to wait for that whole window.

    omni bench token2wav [--model builtin:small-qwen2_5-omni] [--codes 32 250] [--threads 1]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from omni.bench import engine_loop

# The chunks of stage_configs/qwen2_5_omni_small.yaml's token2wav: 8 codes, then 50 doubling to 100.
CHUNKS = {"first_chunk_codes": 8, "chunk_codes": 50, "max_chunk_codes": 100}

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small-qwen2_5-omni", help="Qwen2.5-Omni checkpoint")
    p.add_argument("--codes", type=int, nargs="+", default=[32, 250], help="reply lengths in codec tokens")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: what a stage actor with num_cpus: 1 gets)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)


def _timed(fn) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from omni.registry import resolve_model_path, resolve_stage_model

    from omni.bench.measures import AGREE_SNR_DB, snr_db

    for name in ("codes", "threads", "repeats"):
        values = getattr(args, name) if isinstance(getattr(args, name), list) else [getattr(args, name)]
        if any(v < 1 for v in values):
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    # The stage class through the registry (omni never imports the model code itself).
    stage = resolve_stage_model("qwen2_5_omni_token2wav").load(
        resolve_model_path(args.model), dtype=torch.float32, device=torch.device("cpu"),
        model_kwargs=CHUNKS)
    if max(args.codes) > stage.max_codes:
        raise ValueError(f"--codes: at most {stage.max_codes} codec tokens, got {max(args.codes)}")
    cond, ref = stage.speaker_inputs(None)

    def transformers_wav(codes: list[int]) -> np.ndarray:
        with torch.inference_mode(), torch.random.fork_rng():
            torch.manual_seed(args.seed)
            wav = stage.token2wav(torch.tensor([codes]), conditioning=cond, reference_mel=ref, **stage.kwargs)
        return wav.reshape(-1).float().numpy()

    rows = []
    for n in args.codes:
        codes = np.random.default_rng(args.seed + n).integers(0, stage.num_codes, n).tolist()
        transformers_wav(codes), stage.generate(codes, None, args.seed)  # warm-up: allocator, kernels
        t_hf, t_ours = float("inf"), float("inf")
        for _ in range(args.repeats):  # alternating: both see the same machine state
            t, hf = _timed(lambda: transformers_wav(codes))
            t_hf = min(t_hf, t)
            t, ours = _timed(lambda: stage.generate(codes, None, args.seed))
            t_ours = min(t_ours, t)
        audio_s = len(ours) / stage.sampling_rate
        bitwise = hf.shape == ours.shape and bool(np.array_equal(hf, ours))
        snr = None if bitwise else snr_db(hf, ours)  # None: no difference at all (JSON has no Infinity)
        rows.append({"codes": n, "audio_s": audio_s, "transformers_s": t_hf, "ours_s": t_ours,
                     "speedup": t_hf / t_ours, "rtf": t_ours / audio_s, "bitwise_equal": bitwise,
                     "max_abs_diff": float(np.abs(hf - ours).max()) if hf.shape == ours.shape else None,
                     "snr_db": snr, "agrees": bitwise or snr >= AGREE_SNR_DB})
        print(f"token2wav {n} codes ({audio_s:.2f} s of audio): transformers {t_hf:.3f} s, ours {t_ours:.3f} s "
              f"= {t_hf / t_ours:.2f}x, " + ("bitwise equal" if bitwise else f"SNR {snr:.1f} dB"), flush=True)
    newcomer = _newcomer(args.model, stage, args.seed, args.repeats)
    print(f"newcomer's first audio: alone {newcomer['alone_ms']:.0f} ms, behind a stream "
          f"{newcomer['behind_a_stream_ms']:.0f} ms (x{newcomer['newcomer_wait_ratio']:.2f})", flush=True)
    return {"benchmark": "token2wav", "model": args.model, "threads": args.threads, "lengths": rows,
            "newcomer": newcomer, "newcomer_wait_ratio": newcomer["newcomer_wait_ratio"],
            "speedup": {str(r["codes"]): r["speedup"] for r in rows},
            "bitwise_equal": all(r["bitwise_equal"] for r in rows),
            "outputs_agree": all(r["agrees"] for r in rows)}


def _newcomer(model: str, stage: Any, seed: int, repeats: int, codes: int = 250) -> dict[str, Any]:
    """A streamed request's time to first audio alone, and behind a stream whose second window is in
    flight (engine steps, as the stage's actor runs them, on the stage as engine_factory builds it from
    `model`; `stage`: the loaded model, for its codebook size); best of `repeats`."""
    from omni.messages import StageInput

    rng = np.random.default_rng(seed)
    old, new = (rng.integers(0, stage.num_codes, codes).tolist() for _ in range(2))
    engine = engine_loop.engine("token2wav", "qwen2_5_omni_token2wav", model, device="cpu", dtype="float32",
                                scheduler={"max_num_seqs": 4}, model_kwargs=CHUNKS)

    def add(rid: str, c: list[int]) -> None:
        engine.add_request(StageInput(rid, prompt_token_ids=c[:1], input_complete=False))
        engine.extend_request(rid, c[1:], last=True)

    def first_audio(rid: str) -> float:
        t = time.perf_counter()
        for step, _ in engine_loop.steps(engine):
            if any(d.request_id == rid for d in step.deltas):
                break
        return (time.perf_counter() - t) * 1000

    def drain() -> None:
        engine_loop.run(engine)

    add("warm", new)  # allocator, kernels
    drain()
    alone = behind = float("inf")
    for k in range(repeats):  # best of: as the lengths above
        add(f"alone{k}", new)
        alone = min(alone, first_audio(f"alone{k}"))
        drain()
        add(f"old{k}", old)
        first_audio(f"old{k}")
        # The newcomer arrives just after the step that takes the old stream's second window began (the
        # worst case: an actor admits what arrived at its next step), so it is timed from that step's start.
        t = time.perf_counter()
        engine.step()
        add(f"new{k}", new)
        first_audio(f"new{k}")
        behind = min(behind, (time.perf_counter() - t) * 1000)
        drain()
    engine.close()
    return {"alone_ms": alone, "behind_a_stream_ms": behind, "newcomer_wait_ratio": behind / alone}
