"""InputBatch: persistent step buffers, and the padding contract CUDA graphs rely on.

A decode batch is padded to a captured size with one-token sequences that
write no K/V (slot -1) and see one key. The real rows must come out exactly as
without padding, and the paged cache must not change anywhere but the real
slots, on both attention backends (Triton under the interpreter here).
"""
from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.store_kv import interpreting
from omni.engine.runner.input_batch import InputBatch
from tests.kernels.test_reference import make_batch
from tests.tolerances import attention_atol

# Real Triton kernels need CUDA tensors; under the interpreter everything stays on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_sequences_change_nothing(backend):
    bs, hq, hkv, d = 4, 4, 2, 16
    seq_lens = [5, 9, 1]
    ref = {k: v.to(DEVICE) for k, v in make_batch([1, 1, 1], seq_lens, hq, hkv, d, block_size=bs, seed=3).items()}
    k_new, v_new = torch.randn(2, 3, hkv, d, device=DEVICE).unbind(0)
    batch = InputBatch(max_num_tokens=16, max_num_seqs=8, max_blocks_per_seq=8, block_size=bs, device=DEVICE)
    n = batch.np
    tables = ref["block_tables"].clamp_min(0).cpu()
    n["block_tables"][:3, : tables.shape[1]] = tables.numpy()
    n["query_start_loc"][:4] = [0, 1, 2, 3]
    n["seq_lens"][:3] = seq_lens
    pos = torch.tensor(seq_lens) - 1
    n["slot_mapping"][:3] = (tables[torch.arange(3), pos // bs] * bs + pos % bs).numpy()
    batch.fill_padding(num_tokens=3, num_seqs=3, padded_seqs=8)
    batch.upload(8, 8)
    assert n["slot_mapping"][3:8].tolist() == [-1] * 5
    assert n["query_start_loc"][:9].tolist() == list(range(9))
    assert n["seq_lens"][3:8].tolist() == [1] * 5

    def run(num_seqs, padded):
        kc, vc = ref["key_cache"].clone(), ref["value_cache"].clone()
        extra = padded - num_seqs
        q = torch.cat([ref["query"], torch.randn(extra, hq, d, device=DEVICE)])
        k = torch.cat([k_new, torch.randn(extra, hkv, d, device=DEVICE)])
        v = torch.cat([v_new, torch.randn(extra, hkv, d, device=DEVICE)])
        dev = batch.dev
        dispatch.store_kv(k, v, kc, vc, dev["slot_mapping"][:padded], backend=backend)
        out = dispatch.paged_attention(q, kc, vc, dev["block_tables"][:padded], dev["query_start_loc"][: padded + 1],
                                      dev["seq_lens"][:padded], d**-0.5, backend=backend)
        return out[:num_seqs], kc, vc

    plain_out, plain_k, plain_v = run(3, 3)
    pad_out, pad_k, pad_v = run(3, 8)
    # The padded call batches the real sequences with five more (the torch backend groups them into
    # padded SDPA calls by length), so its sums may be blocked differently: the attention bound.
    torch.testing.assert_close(pad_out, plain_out, rtol=0, atol=attention_atol(ref, d**-0.5))
    assert torch.equal(pad_k, plain_k) and torch.equal(pad_v, plain_v), "padding wrote into the KV cache"


def test_step_larger_than_buffers_is_a_clear_error():
    batch = InputBatch(max_num_tokens=8, max_num_seqs=2, max_blocks_per_seq=4, block_size=4,
                       device=torch.device("cpu"))
    batch.check_fits(8, 2, 4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        batch.check_fits(9, 1, 1)
    with pytest.raises(ValueError, match="exceeds"):
        batch.check_fits(2, 3, 1)
