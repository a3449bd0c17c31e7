"""Pure-torch paged KV store and paged attention.

This is the production path on CPU (every CPU forward pass of every model goes
through it) and the oracle the Triton kernels are tested against, so it is
written for speed first:

- K/V are gathered block-wise with one ``index_select`` on the flattened cache
  (advanced indexing on the 4-D cache is ~10x slower on CPU).
- Sequences with few query tokens (decode, speculative verification) are
  batched: one padded SDPA call per (query length, context-length bucket).
  Buckets halve in length, so padding never costs more than 2x and usually
  much less.
- Longer queries (prefill, chunked prefill) run one SDPA call per sequence:
  ``is_causal`` when there is no cached prefix, otherwise an explicit
  bottom-right aligned mask (the query tokens are the LAST positions).
- GQA never materialises repeated K/V: the query heads sharing a KV head are
  folded into the query-row dimension ([Hkv, G * q_len, D] against [Hkv, L, D]).

Reduced precision (fp16/bf16) goes to SDPA's CPU kernels, which accumulate in
fp32.

Layouts (DESIGN.md "Attention and kernels"):
query [T, Hq, D] packed over S sequences, caches [num_blocks, block_size, Hkv, D],
block_tables [S, max_blocks], query_start_loc [S + 1], seq_lens [S]
(tokens in the cache including this step's new ones).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

# Sequences with at most this many query tokens are batched into padded SDPA
# calls; longer ones (prefill) get one call each.
MAX_BATCHED_QUERY_LEN = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- checks
# Shared by the reference and the Triton launchers so both backends reject the
# same inputs with the same messages. Only shapes/dtypes/devices: no host syncs.


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_store_kv_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    _need(key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    _need(value.shape == key.shape, f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    _need(
        key_cache.dim() == 4,
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(key_cache.shape)}",
    )
    _need(
        value_cache.shape == key_cache.shape,
        f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape {tuple(key_cache.shape)}",
    )
    _need(
        tuple(key.shape[1:]) == tuple(key_cache.shape[2:]),
        f"key [.., num_kv_heads, head_dim] = {tuple(key.shape[1:])} does not match "
        f"key_cache [.., num_kv_heads, head_dim] = {tuple(key_cache.shape[2:])}",
    )
    _need(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
        f"slot_mapping must be 1-D with num_tokens={key.shape[0]} entries, got shape {tuple(slot_mapping.shape)}",
    )
    _need(slot_mapping.dtype in INDEX_DTYPES, f"slot_mapping dtype must be int32 or int64, got {slot_mapping.dtype}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        _need(t.dtype in FLOAT_DTYPES, f"{name} dtype must be float32, float16 or bfloat16 (or float64), got {t.dtype}")
    _need(
        key_cache.dtype == value_cache.dtype,
        f"key_cache dtype {key_cache.dtype} must equal value_cache dtype {value_cache.dtype}",
    )
    _same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)


def check_attention_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out) -> None:
    _need(query.dim() == 3, f"query must be [num_tokens, num_q_heads, head_dim], got shape {tuple(query.shape)}")
    _need(
        key_cache.dim() == 4,
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(key_cache.shape)}",
    )
    _need(
        value_cache.shape == key_cache.shape,
        f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape {tuple(key_cache.shape)}",
    )
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    _need(
        key_cache.shape[3] == head_dim,
        f"head_dim mismatch: query has {head_dim}, key_cache has {key_cache.shape[3]}",
    )
    _need(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})",
    )
    _need(query.dtype in FLOAT_DTYPES, f"query dtype must be float32, float16 or bfloat16 (or float64), got {query.dtype}")
    _need(
        key_cache.dtype == query.dtype and value_cache.dtype == query.dtype,
        f"cache dtypes ({key_cache.dtype}, {value_cache.dtype}) must equal query dtype {query.dtype}",
    )
    _need(block_tables.dim() == 2, f"block_tables must be [num_seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    _need(
        query_start_loc.dim() == 1 and query_start_loc.shape[0] == num_seqs + 1,
        f"query_start_loc must be 1-D with num_seqs + 1 = {num_seqs + 1} entries, "
        f"got shape {tuple(query_start_loc.shape)}",
    )
    _need(
        seq_lens.dim() == 1 and seq_lens.shape[0] == num_seqs,
        f"seq_lens must be 1-D with num_seqs = {num_seqs} entries, got shape {tuple(seq_lens.shape)}",
    )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        _need(t.dtype in INDEX_DTYPES, f"{name} dtype must be int32 or int64, got {t.dtype}")
    if out is not None:
        _need(
            out.shape == query.shape and out.dtype == query.dtype,
            f"out must match query (shape {tuple(query.shape)}, dtype {query.dtype}), "
            f"got shape {tuple(out.shape)}, dtype {out.dtype}",
        )
    _same_device(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        query_start_loc=query_start_loc, seq_lens=seq_lens, out=out,
    )


def _same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {', '.join(f'{n}={d}' for n, d in devices.items())}")


def _plan(starts: list[int], lens: list[int], num_tokens: int, capacity: int):
    """Validate the lengths and group the sequences (plain Python: for the batch
    sizes a CPU serves, list work beats a dozen tiny-tensor torch ops).

    Returns ({q_len: [[seq, ...] per length bucket]}, [long-query seqs]).
    Bucket: sorted by context length, a new bucket starts below half the
    bucket's longest, so padding never doubles the work.
    """
    if starts and not 0 <= starts[0] <= starts[-1] <= num_tokens:
        raise ValueError(f"query_start_loc must lie in [0, num_tokens={num_tokens}], got [{starts[0]}, {starts[-1]}]")
    small: dict[int, list[int]] = {}
    big: list[int] = []
    for s, n in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len < 0:
            raise ValueError("query_start_loc must be non-decreasing")
        if n < q_len:
            raise ValueError(f"seq_lens must be >= the query length of every sequence (seq {s}: {n} < {q_len})")
        if n > capacity:
            raise ValueError(f"seq_lens exceed block_tables capacity ({capacity} tokens; seq {s} has {n})")
        if q_len == 0:
            continue
        if q_len <= MAX_BATCHED_QUERY_LEN:
            small.setdefault(q_len, []).append(s)
        else:
            big.append(s)
    grouped: dict[int, list[list[int]]] = {}
    for q_len, seqs in small.items():
        seqs.sort(key=lens.__getitem__, reverse=True)
        buckets = [[seqs[0]]]
        top = lens[seqs[0]]
        for s in seqs[1:]:
            if 2 * lens[s] < top:
                buckets.append([])
                top = lens[s]
            buckets[-1].append(s)
        grouped[q_len] = buckets
    return grouped, big


# --------------------------------------------------------------------------- store


def store_kv_ref(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write K/V rows [T, Hkv, D] into the paged caches at ``slot_mapping``.

    slot = block_id * block_size + offset; negative slots are padding and skipped.
    Rows are cast to the cache dtype.
    """
    check_store_kv_args(key, value, key_cache, value_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        keep = valid.nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    num_blocks, block_size = key_cache.shape[:2]
    for rows, cache in ((key, key_cache), (value, value_cache)):
        rows = rows.to(cache.dtype)
        if cache.stride(0) == cache.stride(1) * block_size:
            # (block, offset) merge into one slot dimension: a single index_copy_.
            cache.view(num_blocks * block_size, *cache.shape[2:]).index_copy_(0, slots, rows)
        else:
            cache[slots // block_size, slots % block_size] = rows


# --------------------------------------------------------------------------- attention


class _Workspace(threading.local):
    """Reusable gather buffers (one pair per thread).

    Gathered K/V are tens of MB per layer; a fresh allocation each call goes to
    mmap and page-faults on every touch, which made the gather ~4x slower
    than the copy itself on CPU.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (slot, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            # A normal tensor even when first needed under inference_mode, so it
            # stays writable from code that runs outside it (and vice versa).
            with torch.inference_mode(False):
                buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_workspace = _Workspace()


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
    """cache[blocks] for a 1-D block list -> [len(blocks) * block_size, Hkv, D].

    The result lives in a per-thread workspace (``slot`` 0 for K, 1 for V): it
    is only valid until the next gather into the same slot.
    """
    num_blocks, block_size, hkv, d = cache.shape
    n = blocks.shape[0]
    if cache.device.type != "cpu":
        # On accelerators the caching allocator already reuses memory.
        return cache.index_select(0, blocks).view(n * block_size, hkv, d)
    dst = _workspace.get(slot, n * block_size * hkv * d, cache.dtype, cache.device).view(n, block_size, hkv, d)
    if cache.is_contiguous():
        torch.index_select(cache.view(num_blocks, -1), 0, blocks, out=dst.view(n, -1))
    else:
        torch.index_select(cache, 0, blocks, out=dst)
    return dst.view(n * block_size, hkv, d)


def _attend_group(query, key_cache, value_cache, block_tables, out, seq_idx, starts, lens, q_len, scale, max_len):
    """Batched attention for sequences that all have ``q_len`` query tokens.

    seq_idx/starts/lens: int64 tensors [n]; max_len = max(lens). One padded
    SDPA call; the query heads of each KV head are folded into the query rows
    (no K/V repeat).
    """
    n = seq_idx.shape[0]
    num_blocks, block_size, hkv, d = key_cache.shape
    hq = query.shape[1]
    g = hq // hkv
    nblk = _cdiv(max_len, block_size)
    # Table entries past a sequence's last block may be stale or padding (-1):
    # clamp them into range (those rows are masked out anyway).
    bt = block_tables.index_select(0, seq_idx)[:, :nblk].clamp(0, num_blocks - 1).reshape(-1)
    k = _gather_kv(key_cache, bt, 0).view(n, nblk * block_size, hkv, d)[:, :max_len].transpose(1, 2)
    v = _gather_kv(value_cache, bt, 1).view(n, nblk * block_size, hkv, d)[:, :max_len].transpose(1, 2)

    key_pos = torch.arange(max_len, device=lens.device)
    if q_len == 1:
        tok = starts
        q = query.index_select(0, tok).view(n, hkv, g, d)
        mask = (key_pos[None, :] < lens[:, None]).view(n, 1, 1, max_len)
    else:
        steps = torch.arange(q_len, device=starts.device)
        tok = (starts[:, None] + steps[None, :]).reshape(-1)
        # rows ordered (kv_head, group member, token): [n, Hkv, G * q_len, D]
        q = query.index_select(0, tok).view(n, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * q_len, d)
        last = lens[:, None] - q_len + steps[None, :]  # position of each query token
        mask = key_pos[None, None, :] <= last[:, :, None]  # [n, q_len, L], bottom-right causal
        mask = mask[:, None].expand(n, g, q_len, max_len).reshape(n, 1, g * q_len, max_len)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if q_len == 1:
        o = o.reshape(n, hq, d)
    else:
        o = o.view(n, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(n * q_len, hq, d)
    out.index_copy_(0, tok, o)


def _attend_one(query, key_cache, value_cache, block_tables, out, seq, start, end, seq_len, scale):
    """Attention for one sequence with many query tokens (prefill / chunked prefill)."""
    num_blocks, block_size, hkv, d = key_cache.shape
    hq = query.shape[1]
    g = hq // hkv
    q_len = end - start
    nblk = _cdiv(seq_len, block_size)
    blocks = block_tables[seq, :nblk].long()
    k = _gather_kv(key_cache, blocks, 0)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    v = _gather_kv(value_cache, blocks, 1)[:seq_len].transpose(0, 1)
    q = query[start:end]
    # SDPA gets 4-D tensors ([1, heads, L, D]): on a CPU, 3-D ones take its math path (the whole score
    # matrix, softmax apart), 4-D ones its flash kernel: `omni bench prefix`'s uncached TTFT on a
    # 2,237-token document 9.6 s -> 3.8 s, `omni bench throughput` +14% (README).
    if q_len == seq_len:
        # No cached prefix: plain causal attention (top-left == bottom-right).
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=scale,
                                           enable_gqa=g > 1)[0]
        out[start:end] = o.transpose(0, 1)
        return
    # Cached prefix: query i sits at position (seq_len - q_len + i). Folding the
    # group into the rows beats enable_gqa with a mask on CPU (~1.5x).
    pos = torch.arange(q_len, device=q.device) + (seq_len - q_len)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]  # [q_len, L]
    if g > 1:
        mask = mask.repeat(g, 1)
    qf = q.view(q_len, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * q_len, d)
    o = F.scaled_dot_product_attention(qf[None], k[None], v[None], attn_mask=mask[None, None], scale=scale)[0]
    out[start:end] = o.view(hkv, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, hq, d)


def paged_attention_ref(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out=None,
                        short_queries=None):
    """Causal varlen attention over a paged KV cache -> [T, Hq, D].

    The query tokens of sequence s are rows query_start_loc[s]:query_start_loc[s+1]
    of ``query`` and are the LAST positions of its seq_lens[s]-token context, whose
    K/V (this step's included) are already in the cache. Padding rows outside
    [query_start_loc[0], query_start_loc[-1]) are zero in a returned new tensor and
    left untouched in a caller's ``out``. ``short_queries``: a kernel that computes every
    sequence of at most MAX_BATCHED_QUERY_LEN query tokens in one call
    (cpu_attention.short_query_attention's signature) instead of the padded SDPA groups.
    """
    check_attention_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out)
    num_tokens = query.shape[0]
    fresh = out is None
    if fresh:
        out = torch.empty_like(query)
    # One host read of the (small) length tensors; a sync when they live on a GPU.
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    block_size = key_cache.shape[1]
    groups, big = _plan(starts, lens, num_tokens, block_tables.shape[1] * block_size)
    if fresh:  # a caller's ``out`` keeps its padding rows, as with the Triton backend
        first, last = (starts[0], starts[-1]) if lens else (0, 0)
        out[:first].zero_()
        out[last:].zero_()
    dev = query.device
    if short_queries is not None and groups:
        # Every short-query sequence in one call of the given kernel (cpu_attention.py), not the padded SDPA groups.
        seqs = [seq for buckets in groups.values() for bucket in buckets for seq in bucket]
        short_queries(query, key_cache, value_cache, block_tables, out, seqs, [starts[s] for s in seqs],
                      [starts[s + 1] - starts[s] for s in seqs], [lens[s] for s in seqs], scale)
        groups = {}
    for q_len, buckets in groups.items():
        for seqs in buckets:
            _attend_group(
                query, key_cache, value_cache, block_tables, out,
                torch.tensor(seqs, device=dev), torch.tensor([starts[s] for s in seqs], device=dev),
                torch.tensor([lens[s] for s in seqs], device=dev), q_len, scale, max_len=lens[seqs[0]],
            )
    for s in big:
        _attend_one(query, key_cache, value_cache, block_tables, out, s, starts[s], starts[s + 1], lens[s], scale)
    return out
