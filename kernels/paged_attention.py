"""Triton kernel: unified causal varlen attention over a paged KV cache.

One launch covers a whole mixed batch: prefill on top of a cached prefix,
chunked prefill and decode. Layouts match kernels/reference.py.

Work split
----------
Grid = (query blocks, kv heads, kv segments). A program owns BLOCK_Q query
tokens of one sequence times the G = Hq / Hkv query heads that share one KV
head, so K/V are loaded once per group (GQA/MQA) and the rows of the tile are
(token, group member) pairs::

    row m  ->  token  q_block * BLOCK_Q + m // G,  head  kv_head * G + m % G

Query blocks never straddle sequences. Their number is not known on the host
without a sync, so the grid uses the bound ``T // BLOCK_Q + S`` (sequence s owns
q-blocks ``qsl[s] // BLOCK_Q + s ..``) and each program finds its sequence by
binary search; surplus programs exit at once.

Each program walks the KV positions its tokens can see (causal: up to the
last token's position) in TILE-sized tiles, translating positions through the
block table per element (so any block_size works), with an fp32 online
softmax (exp2, scale folded with log2(e)).

Split-KV: with NUM_SEGMENTS > 1 the tiles are cut into segments, each program
writes an unnormalised partial (acc, max, sum) and ``_reduce_segments_kernel``
merges them. Used for decode batches too small to fill the GPU.

Under TRITON_INTERPRET=1 loads are upcast to fp32 (the interpreter's bf16
arithmetic is wrong) and fp32 dots use "ieee" precision everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.reference import check_attention_args
from kernels.store_kv import check_triton_device, interpreting
from kernels.tuned import lookup

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # Largest s with qsl[s] // BLOCK_Q + s <= q_block.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, qk_scale, k_head, v_head, bt_row, tile_lo, tile_hi, num_keys, pos,
                  block_size, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_bt_blk,
                  offs_d, d_mask,
                  TILE: tl.constexpr, MASKED: tl.constexpr, MAY_BE_EMPTY: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax accumulation over KV tiles [tile_lo, tile_hi).

    MASKED=False: every key of these tiles is visible to every row (tiles left
    of the causal diagonal), so no position masks are built at all.
    qk_scale = softmax scale * log2(e), applied to the fp32 scores (scaling q
    in bf16 instead would add a rounding to every score).
    """
    for t in range(tile_lo, tile_hi):
        offs_n = t * TILE + tl.arange(0, TILE)
        if MASKED:
            n_valid = offs_n < num_keys
            phys = tl.load(bt_row + (offs_n // block_size) * stride_bt_blk, mask=n_valid, other=0).to(tl.int64)
        else:
            phys = tl.load(bt_row + (offs_n // block_size) * stride_bt_blk).to(tl.int64)
        in_blk = (offs_n % block_size).to(tl.int64)
        k_ptrs = k_head + phys[:, None] * stride_kb + in_blk[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = v_head + phys[:, None] * stride_vb + in_blk[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if MASKED:
            kv_mask = n_valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [TILE, D]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            visible = (offs_n[None, :] <= pos[:, None]) & n_valid[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MAY_BE_EMPTY:
            # A row that has seen no visible key yet keeps m = -inf (only
            # possible in a split-KV segment): shift by 0 to avoid inf - inf.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, qsl_ptr, seq_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, num_seqs, block_size, num_q_heads,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt_seq, stride_bt_blk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Heaviest query blocks first: under causal masking the last blocks of a
    # long prefill walk the most tiles, and launching them last leaves a tail
    # of a few long programs on an otherwise idle GPU.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    if seq < 0:  # only when query_start_loc[0] > 0
        return
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    tok = q_block_local * BLOCK_Q + offs_m // GROUP  # token index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    pos = context_len + tok  # absolute position of each row's token

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Causal: the block's last token sees positions < num_keys; every row of
    # the block sees positions <= first_pos, so tiles ending there need no mask.
    num_keys = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len)
    first_pos = context_len + q_block_local * BLOCK_Q
    num_tiles = tl.cdiv(num_keys, TILE)
    num_full = (first_pos + 1) // TILE
    if NUM_SEGMENTS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    split = tl.maximum(tl.minimum(num_full, tile_hi), tile_lo)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, qk_scale, k_head, v_head, bt_row, tile_lo, split, num_keys, pos,
        block_size, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_bt_blk,
        offs_d, d_mask, TILE=TILE, MASKED=False, MAY_BE_EMPTY=False, UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, qk_scale, k_head, v_head, bt_row, split, tile_hi, num_keys, pos,
        block_size, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_bt_blk,
        offs_d, d_mask, TILE=TILE, MASKED=True, MAY_BE_EMPTY=NUM_SEGMENTS > 1, UPCAST=UPCAST,
        DOT_PRECISION=DOT_PRECISION)

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])
    else:
        # Partials laid out [T, Hq, NUM_SEGMENTS, (HEAD_DIM_PAD)], contiguous fp32.
        part = (q_rows * num_q_heads + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, qsl_ptr,
    num_seqs, num_q_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Padding tokens past the last sequence have no partials: leave out alone.
    if tok >= tl.load(qsl_ptr + num_seqs):
        return
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = (tok * num_q_heads + head) * NUM_SEGMENTS + offs_s
    m = tl.load(part_max_ptr + part)
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # empty segments: exp2(-inf) = 0
    l_all = tl.sum(tl.load(part_sum_ptr + part) * w, axis=0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(l_all == 0.0, 1.0, l_all)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------- launcher


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile sizes and launch options (None fields = heuristic)."""

    block_m: int | None = None  # query rows per program (tokens x group members), power of 2 >= 16
    tile: int | None = None  # KV positions per inner iteration, power of 2 >= 16
    num_segments: int | None = None  # split-KV segments, power of 2 (1 = off)
    num_warps: int | None = None
    num_stages: int | None = None


_DEVICE_PROPS: dict[int, tuple[int, str]] = {}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _device_props(device: torch.device) -> tuple[int, str]:
    """(SM count, GPU name), cached: launches must not query the driver every step."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_PROPS:
        props = torch.cuda.get_device_properties(idx)
        _DEVICE_PROPS[idx] = (props.multi_processor_count, props.name)
    return _DEVICE_PROPS[idx]


def _sm_count(device: torch.device) -> int:
    return _device_props(device)[0]


def _pow2(name: str, value: int, minimum: int) -> int:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def _heuristic(avg_q_len: float, head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(block_m, tile, num_warps, num_stages) for a GPU launch.

    The only host-known hint without a sync is the average query length T / S.
    Decode wants few rows per program (rows past G are wasted MMA work but the
    loop is bandwidth bound); prefill wants 128 rows for K/V reuse. Mixed
    batches take the middle so their decodes do not pay 8x wasted rows.
    Register/shared-memory fit checked with ptxas for sm_90 (no spills).
    """
    if dtype == torch.float32:  # debug/test path ("ieee" FMA dots): larger tiles spill
        return 16, 32, 8, 2
    if head_dim_pad > 128:
        return (16, 32, 4, 3) if avg_q_len <= 1 else (64, 32, 4, 2)
    if avg_q_len <= 1:
        return 16, 64, 4, 3
    if avg_q_len < 64:
        return 64, 64, 4, 2
    return 128, 64, 8, 3


def _choose(cfg: AttentionConfig, num_tokens: int, num_seqs: int, num_kv_heads: int, group: int,
            head_dim_pad: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int, int]:
    avg_q_len = num_tokens / num_seqs
    decode_shaped = avg_q_len <= 1
    interp = interpreting()
    if interp:
        # Python-level cost per program and per tile: few programs, large tiles.
        block_m, tile, num_warps, num_stages = (16 if decode_shaped else 64), 64, 4, 1
    else:
        tuned = None
        if device.type == "cuda" and (decode_shaped or avg_q_len >= 64):
            tuned = lookup(_device_props(device)[1], _DTYPE_NAMES[dtype], head_dim_pad,
                           "decode" if decode_shaped else "prefill")
        block_m, tile, num_warps, num_stages = tuned or _heuristic(avg_q_len, head_dim_pad, dtype)
    block_m = max(_pow2("block_m", cfg.block_m or block_m, 16), triton.next_power_of_2(group))
    tile = _pow2("tile", cfg.tile or tile, 16)

    segments = cfg.num_segments
    if segments is None:
        segments = 1
        if decode_shaped and not interp and device.type == "cuda":
            # Too few (sequence, kv head) programs to fill the GPU: split the
            # context so that about two programs run per SM.
            programs = num_seqs * num_kv_heads
            sms = _sm_count(device)
            if programs < sms:
                segments = min(16, triton.next_power_of_2(math.ceil(2 * sms / max(programs, 1))))
    _pow2("num_segments", segments, 1)
    return block_m, tile, segments, cfg.num_warps or num_warps, cfg.num_stages or num_stages


def paged_attention_triton(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                           out=None, config: AttentionConfig | None = None):
    """Launcher with the reference's contract (see kernels/reference.py).

    ``config`` overrides tile sizes / split-KV (tests and the benchmark use it).
    """
    check_attention_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out)
    check_triton_device(query, key_cache)
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype must be float32, float16 or bfloat16 for the Triton backend, got {query.dtype}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        # Zeros so padding rows past query_start_loc[-1] match the reference.
        out = torch.zeros_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, tile, segments, num_warps, num_stages = _choose(
        config or AttentionConfig(), num_tokens, num_seqs, num_kv_heads, group, head_dim_pad, query.dtype, query.device)
    block_q = block_m // group
    interp = interpreting()
    upcast = interp
    precision = "ieee" if (interp or query.dtype == torch.float32) else "tf32"

    if segments > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, segments, head_dim_pad, dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty(num_tokens, num_q_heads, segments, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, segments)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        part_acc, part_max, part_sum,
        float(scale) * _LOG2E, num_seqs, block_size, num_q_heads,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=tile, NUM_SEGMENTS=segments,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    if segments > 1:
        _reduce_segments_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum, query_start_loc,
            num_seqs, num_q_heads, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SEGMENTS=segments,
            num_warps=1 if head_dim_pad <= 64 else 2,
        )
    return out
