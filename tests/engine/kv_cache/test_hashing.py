import os
import subprocess
import sys

import pytest

from omni.engine.core.kv_cache import BlockHasher, KVCacheManager, hash_block_tokens, root_hash
from omni.engine.core.request import MultiModalFeature, Request

BS = 4


def hashes(tokens, hasher=None, **kw):
    return Request("r", list(tokens), block_hasher=hasher or BlockHasher(BS), **kw).block_hashes


def first_diff(a, b):
    """Index of the first differing block hash; asserts everything after it differs too."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            assert all(p != q for p, q in zip(a[i:], b[i:])), "the chain must carry a difference forward"
            return i
    return None


def test_chain_matches_hash_block_tokens():
    tokens = list(range(100, 114))
    hs = hashes(tokens, BlockHasher(BS, seed=7))
    assert len(hs) == 3 and all(len(h) == 16 for h in hs)
    parent = None
    for i, h in enumerate(hs):
        parent = hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS], None, 7)
        assert parent == h
    # None parent is the seed's root, empty extras are no extras.
    assert hash_block_tokens(None, [1, 2], (), 7) == hash_block_tokens(root_hash(7), [1, 2], None, 7)


def test_prefix_dependence_and_seed():
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert first_diff(a, b) == 0  # same block-1 tokens, different prefix -> different hash
    assert hashes([1, 2, 3, 4, 5, 6, 7, 9])[0] == a[0]
    assert first_diff(a, hashes([1, 2, 3, 4, 5, 6, 7, 8], BlockHasher(BS, seed=1))) == 0


def test_reproducible_across_processes():
    code = ("from omni.engine.core.kv_cache import hash_block_tokens as h; "
            "print(h(h(None, [1, 2, 3, 4], ('salt', 's'), 5), [70000, 6, 7, 8], None, 5).hex())")
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    local = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4], ("salt", "s"), 5), [70000, 6, 7, 8], None, 5)
    assert outs == {local.hex()}


def test_extra_keys_are_unambiguous():
    p = root_hash(0)
    assert hash_block_tokens(p, [1], ("ab",), 0) != hash_block_tokens(p, [1], ("a", "b"), 0)
    assert hash_block_tokens(p, [1], (1,), 0) != hash_block_tokens(p, [1], ("1",), 0)
    assert hash_block_tokens(p, [1], (b"x",), 0) != hash_block_tokens(p, [1], ("x",), 0)
    assert hash_block_tokens(p, [1], (True,), 0) != hash_block_tokens(p, [1], (1,), 0)
    # A block with extras never equals a plain block, whatever the tokens.
    assert hash_block_tokens(p, [1, 2], (None,), 0) != hash_block_tokens(p, [1, 2], None, 0)
    with pytest.raises(TypeError):
        hash_block_tokens(p, [1], (object(),), 0)


def test_invalid_inputs():
    with pytest.raises(ValueError, match="hash_seed"):
        BlockHasher(4, seed=-1)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(None, [-1, 2], None, 0)
    with pytest.raises(ValueError, match="token ids"):
        hashes([2**32, 1, 2, 3])


def test_multimodal_keys_change_exactly_the_overlapping_blocks():
    tokens = [5] * 16  # identical placeholder tokens everywhere
    img_a = [MultiModalFeature("aaaa", offset=5, length=6)]  # tokens 5..10: blocks 1 and 2
    img_b = [MultiModalFeature("bbbb", offset=5, length=6)]
    plain = hashes(tokens)
    a = hashes(tokens, mm_features=img_a)
    b = hashes(tokens, mm_features=img_b)
    assert first_diff(plain, a) == 1 and first_diff(a, b) == 1  # block 0 has no image
    h = BlockHasher(BS)
    req = Request("r", tokens, mm_features=img_a)
    assert [h.block_extra_keys(req, i) for i in range(4)] == [
        None, (("mm", "aaaa", 1),), (("mm", "aaaa", -3),), None]
    # Same image, shifted by one token inside the block: a different block.
    shifted = hashes(tokens, mm_features=[MultiModalFeature("aaaa", offset=6, length=6)])
    assert first_diff(a, shifted) == 1
    # Blocks after the image differ from the plain request only through the chain.
    assert hash_block_tokens(a[2], tokens[12:16], None, 0) == a[3]


def test_salt_and_adapter_key_the_first_block_only():
    tokens = list(range(12))
    plain = hashes(tokens)
    salted = hashes(tokens, cache_salt="user-1")
    assert first_diff(plain, salted) == 0
    assert first_diff(salted, hashes(tokens, cache_salt="user-2")) == 0
    assert first_diff(plain, hashes(tokens, adapter_id="lora-a")) == 0
    h = BlockHasher(BS)
    req = Request("r", tokens, cache_salt="user-1", adapter_id="lora-a")
    assert h.block_extra_keys(req, 0) == (("salt", "user-1"), ("adapter", "lora-a"))
    assert h.block_extra_keys(req, 1) is None  # carried by the chain
    assert hash_block_tokens(salted[0], tokens[4:8], None, 0) == salted[1]


def test_prompt_embeds_digests_key_each_prompt_block():
    tokens = [0] * 10  # placeholders: 3 prompt blocks (2 full + 1 partial)
    d1 = [b"e0", b"e1", b"e2"]
    d2 = [b"e0", b"XX", b"e2"]
    a = hashes(tokens, prompt_embeds_digests=d1)
    b = hashes(tokens, prompt_embeds_digests=d2)
    assert first_diff(hashes(tokens), a) == 0
    assert first_diff(a, b) == 1
    # The partial third prompt block is keyed by its digest once it fills up.
    r1 = Request("r1", tokens, prompt_embeds_digests=d1, block_hasher=BlockHasher(BS))
    r2 = Request("r2", tokens, prompt_embeds_digests=[b"e0", b"e1", b"YY"], block_hasher=BlockHasher(BS))
    assert r1.block_hashes == r2.block_hashes
    for r in (r1, r2):
        r.append_output_token_ids([1, 2, 3, 4, 5, 6])
    assert len(r1.block_hashes) == 4
    assert first_diff(r1.block_hashes, r2.block_hashes) == 2
    with pytest.raises(ValueError, match="prompt_embeds_digests"):
        hashes(tokens, prompt_embeds_digests=[b"only-one"])
    with pytest.raises(ValueError, match="prompt_embeds_digests"):  # even before any block is full
        hashes([0, 0], prompt_embeds_digests=[b"a", b"b"])


def test_incremental_equals_one_shot_with_extras():
    h = BlockHasher(BS, seed=11)
    kw = dict(mm_features=[MultiModalFeature("img", 3, 7)], cache_salt="s", adapter_id="a",
              prompt_embeds_digests=[b"0", b"1", b"2"])
    r = Request("r", list(range(10)), block_hasher=h, **kw)
    for t in range(9):
        r.append_output_token_ids(t)
    once = Request("o", list(range(10)), block_hasher=h, **kw)
    once.append_output_token_ids(list(range(9)))
    assert r.block_hashes == once.block_hashes and len(r.block_hashes) == 4
    # ... and both equal the block-by-block definition.
    parent = None
    for i in range(4):
        parent = hash_block_tokens(parent, r.all_token_ids[i * BS:(i + 1) * BS], h.block_extra_keys(r, i), 11)
        assert parent == r.block_hashes[i]


@pytest.mark.parametrize("field", ["image", "salt", "embeddings", "adapter"])
def test_requests_differing_only_in_extra_input_never_share_a_block(field):
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = [3] * 17

    def make(rid, variant):
        kw = {
            "image": dict(mm_features=[MultiModalFeature(f"img{variant}", 0, 17)]),
            "salt": dict(cache_salt=f"salt{variant}"),
            "embeddings": dict(prompt_embeds_digests=[bytes([variant, i]) for i in range(5)]),
            "adapter": dict(adapter_id=f"lora{variant}"),
        }[field]
        return Request(rid, list(tokens), block_hasher=kv.block_hasher, **kw)

    a = make("a", 1)
    blocks, n = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 17 - n, n, blocks) is not None
    twin = make("twin", 1)
    assert kv.get_computed_blocks(twin)[1] == 16  # same inputs: full hit
    other = make("b", 2)
    assert kv.get_computed_blocks(other) == ([], 0)
    assert not set(a.block_hashes) & set(other.block_hashes)
