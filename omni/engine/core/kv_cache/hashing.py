"""Chained block hashes for the prefix cache.

A block's hash identifies the block's tokens *and everything before them*::

      block 0            block 1            block 2
    [t0 .. t15]        [t16 .. t31]       [t32 .. t47]
    h0 = H(root, b0)   h1 = H(h0, b1)     h2 = H(h1, b2)      (+ extra keys)

so equal hashes mean equal prefixes, and a lookup can stop at the first miss.

``H`` is xxh3_128 with a fixed, configurable seed (never Python's ``hash()``,
which is salted per process): the same tokens give the same hashes in every
process and every run, so stages on different Ray workers agree.

Encoding (why it is unambiguous):

* plain block:  ``xxh3_128(parent16 || uint32le(tokens), seed)``. The parent
  is always 16 bytes (a seed-derived root stands in for "no parent"), so the
  token bytes are the rest of the message.
* block with extra keys: ``xxh3_128(parent16 || u32 n_tokens || tokens ||
  encode(extra_keys), seed ^ EXTRA_SEED_XOR)``. A different seed is a different
  hash function, so a block with extra keys can never collide with a plain one,
  and ``encode`` is a tagged, length-prefixed serialisation.

Speed: the hot path packs a whole run of new tokens into one ``array('I')``
and feeds ``parent + memoryview slice`` straight to xxh3; there is no
per-token Python work (about 40 M tokens/s on one core).
"""

from __future__ import annotations

import struct
import sys
from array import array
from functools import lru_cache
from typing import Any, Protocol, Sequence

import xxhash

BlockHash = bytes  # 16-byte xxh3_128 digest


class HashedRequest(Protocol):
    """What the hasher reads of a request (omni.engine.core.request.Request is one): declared here so that
    the request module imports the hasher and not the other way round."""

    request_id: str
    mm_features: Sequence[Any]  # each with mm_hash, offset, length; sorted by offset
    cache_salt: str | None
    adapter_id: str | None
    prompt_embeds_digests: list[bytes] | None
    block_hashes: list[BlockHash]
    all_token_ids: list[int]  # prompt + output

    @property
    def num_prompt_tokens(self) -> int: ...

_MAX_SEED = 2**64 - 1
# Domain separation between plain blocks and blocks carrying extra keys.
EXTRA_SEED_XOR = 0x9E3779B97F4A7C15

_xxh3_128 = xxhash.xxh3_128_digest
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
# Hashes must not depend on the host: token bytes are little-endian uint32.
_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == 4, "omni's block hashes need a 4-byte array('I')"


def _check_seed(seed: int) -> int:
    if not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"hash_seed must be an int in [0, 2**64 - 1], got {seed!r}")
    return seed


@lru_cache(maxsize=64)
def root_hash(seed: int) -> BlockHash:
    """The stand-in parent of a request's first block, derived from the seed."""
    return _xxh3_128(b"omni.kv_cache.root", _check_seed(seed))


def _pack_tokens(token_ids: Sequence[int]) -> array:
    buf = array("I")
    try:
        buf.fromlist(token_ids if isinstance(token_ids, list) else list(token_ids))
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2**32 - 1]: {e}") from None
    if _BIG_ENDIAN:
        buf.byteswap()
    return buf


def _encode(obj: object, out: bytearray) -> None:
    """Tagged, length-prefixed serialisation of extra keys (deterministic across processes)."""
    if obj is None:
        out += b"N"
    elif isinstance(obj, bool):  # before int: bool is an int subclass
        out += b"T" if obj else b"F"
    elif isinstance(obj, int):
        if -(2**63) <= obj < 2**63:
            out += b"i"
            out += _I64.pack(obj)
        else:
            s = str(obj).encode()
            out += b"I" + _U32.pack(len(s)) + s
    elif isinstance(obj, str):
        s = obj.encode("utf-8")
        out += b"s" + _U32.pack(len(s)) + s
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        out += b"b" + _U32.pack(len(b)) + b
    elif isinstance(obj, float):
        out += b"f" + struct.pack("<d", obj)
    elif isinstance(obj, (tuple, list)):
        out += b"t" + _U32.pack(len(obj))
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(f"unsupported extra key type {type(obj).__name__}: {obj!r}")


def _hash_with_extras(parent: BlockHash, token_bytes: bytes | memoryview, n_tokens: int,
                      extra_keys: tuple, seed: int) -> BlockHash:
    msg = bytearray(parent)
    msg += _U32.pack(n_tokens)
    msg += token_bytes
    _encode(extra_keys, msg)
    return _xxh3_128(bytes(msg), seed ^ EXTRA_SEED_XOR)


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None,
                      seed: int) -> BlockHash:
    """Hash of one block given its parent's hash (``None`` for the first block).

    ``extra_keys`` (``None`` or an empty tuple for none) may hold str, bytes,
    int, float, bool, None and nested tuples. Gives exactly what
    :class:`BlockHasher` computes for the same block.
    """
    if parent is None:
        parent = root_hash(seed)
    packed = _pack_tokens(token_ids)
    if extra_keys:
        return _hash_with_extras(parent, packed.tobytes(), len(packed), tuple(extra_keys), seed)
    return _xxh3_128(parent + packed.tobytes(), seed)


class BlockHasher:
    """Computes the hashes of a request's new full blocks.

    ``Request`` (a HashedRequest) calls it at construction and whenever appended tokens
    complete a block; it returns only the hashes not yet in
    ``request.block_hashes``.

    Extra keys of block ``i`` (tokens ``[i*B, (i+1)*B)``), in this order:

    * ``("mm", mm_hash, offset - i*B)`` for every multimodal feature
      overlapping the block (offset relative to the block start, so the same
      image at a different position is a different block);
    * ``("salt", cache_salt)`` and ``("adapter", adapter_id)`` on block 0 only:
      the chain carries them into every later block at no extra cost;
    * ``("emb", prompt_embeds_digests[i])`` for the prompt blocks of a stage fed
      with embeddings (its token ids are placeholders and prove nothing).
    """

    __slots__ = ("block_size", "seed", "_root")

    def __init__(self, block_size: int, seed: int = 0) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.seed = _check_seed(seed)
        self._root = root_hash(seed)

    def block_extra_keys(self, request: HashedRequest, block_idx: int) -> tuple | None:
        """The extra keys of block ``block_idx`` of ``request`` (``None`` if none)."""
        keys: list[tuple] = []
        bs = self.block_size
        start = block_idx * bs
        end = start + bs
        for f in request.mm_features:  # sorted by offset
            if f.offset >= end:
                break
            if f.offset + f.length > start:
                keys.append(("mm", f.mm_hash, f.offset - start))
        if block_idx == 0:
            if request.cache_salt:
                keys.append(("salt", request.cache_salt))
            if request.adapter_id:
                keys.append(("adapter", request.adapter_id))
        digests = request.prompt_embeds_digests
        if digests is not None and block_idx < len(digests):
            keys.append(("emb", digests[block_idx]))
        return tuple(keys) if keys else None

    def _check_digests(self, request: HashedRequest) -> None:
        digests = request.prompt_embeds_digests
        expected = -(-request.num_prompt_tokens // self.block_size)
        if len(digests) != expected:
            raise ValueError(
                f"request {request.request_id!r}: prompt_embeds_digests needs one digest per prompt block "
                f"({expected} for {request.num_prompt_tokens} tokens at block size {self.block_size}), "
                f"got {len(digests)}"
            )

    def __call__(self, request: HashedRequest) -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        first = len(hashes)
        if first == 0 and request.prompt_embeds_digests is not None:
            self._check_digests(request)  # fail at admission, not when a block fills
        end = len(request.all_token_ids) // bs
        if end <= first:
            return []
        all_ids = request.all_token_ids
        if first == 0:
            tokens = _pack_tokens(all_ids)  # whole list, no slice copy; drop the partial tail
            if len(tokens) != end * bs:
                del tokens[end * bs:]
        else:
            tokens = _pack_tokens(all_ids[first * bs:end * bs])
        view = memoryview(tokens)
        parent = hashes[-1] if first else self._root
        seed = self.seed
        h = _xxh3_128
        out: list[BlockHash] = []
        append = out.append

        plain = not (request.mm_features or request.cache_salt or request.adapter_id
                     or request.prompt_embeds_digests is not None)
        if plain:
            # Hot path: one concat + one C call per block, nothing per token.
            for off in range(0, len(view), bs):
                parent = h(parent + view[off:off + bs], seed)
                append(parent)
            return out

        for i in range(first, end):
            off = (i - first) * bs
            chunk = view[off:off + bs]
            extra = self.block_extra_keys(request, i)
            if extra is None:
                parent = h(parent + chunk, seed)
            else:
                parent = _hash_with_extras(parent, chunk, bs, extra, seed)
            append(parent)
        return out
