"""Token lists as the index keeps them, and the chained hashes that find them.  No mlx.

Block i of a snapshot is found by h_i = H(h_{i-1}, tokens of block i), with
h_-1 keyed by the namespace secret and the identity.  A snapshot's head key
(its first ``HEAD_TOKENS`` tokens under h_-1) finds it for prompts that share
less than one block with it.  Hashes only select candidates: token lists,
compared in full, decide.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Sequence

from ..errors import InvalidTokensError
from ..records import MAX_TOKENS

__all__ = [
    "HEAD_TOKENS",
    "MAX_TOKEN",
    "chain_root",
    "chains",
    "head_key",
    "pack_tokens",
    "unpack_tokens",
    "check_tokens",
    "common_prefix_packed",
]

HEAD_TOKENS = 16  # the shortest prefix a lookup reuses
MAX_TOKEN = (1 << 32) - 1  # token ids are stored as little-endian uint32


def check_tokens(tokens: Sequence[int]) -> list[int]:
    """Token ids as plain ints in [0, 2**32); anything else is InvalidTokensError."""
    if hasattr(tokens, "tolist"):  # an mx.array or numpy array of ids
        tokens = tokens.tolist()
    if len(tokens) > MAX_TOKENS:
        raise InvalidTokensError(f"{len(tokens)} tokens; a snapshot covers at most {MAX_TOKENS}")
    try:
        out = [operator.index(t) for t in tokens]  # ints only: 1.5 is not a token id
    except TypeError as e:
        raise InvalidTokensError(f"token ids must be integers: {e}") from None
    if out and not (min(out) >= 0 and max(out) <= MAX_TOKEN):
        bad = next(t for t in out if not 0 <= t <= MAX_TOKEN)
        raise InvalidTokensError(f"token id {bad} is outside [0, {MAX_TOKEN}]")
    return out


def pack_tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def unpack_tokens(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def common_prefix_packed(a: bytes, b: bytes) -> int:
    """Tokens two packed token lists share from the start (slice compares are memcmp)."""
    n = min(len(a), len(b)) // 4
    lo, hi = 0, n  # the first lo tokens are common
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[4 * lo : 4 * mid] == b[4 * lo : 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def chain_root(secret: bytes, identity_digest: str) -> bytes:
    """h_-1: keyed by the namespace secret, so no other namespace can reach or probe it."""
    return hashlib.blake2b(identity_digest.encode(), key=secret[:64], digest_size=16).digest()


def chains(root: bytes, tokens: Sequence[int], block: int) -> list[bytes]:
    """[h_-1, h_0, ..., h_{k-1}] for the k full blocks of ``tokens``."""
    out = [root]
    for i in range(len(tokens) // block):
        chunk = struct.pack(f"<{block}I", *tokens[i * block : (i + 1) * block])
        out.append(hashlib.blake2b(out[-1] + chunk, digest_size=16).digest())
    return out


def head_key(root: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a token list's first ``HEAD_TOKENS`` tokens under ``root``.

    Shorter lists get a key no prompt produces: prefixes that short are not
    worth a lookup (such a snapshot is still restored by name).
    """
    if len(tokens) < HEAD_TOKENS:
        raw = b"short" + struct.pack(f"<{len(tokens)}I", *tokens)
    else:
        raw = struct.pack(f"<{HEAD_TOKENS}I", *tokens[:HEAD_TOKENS])
    return hashlib.blake2b(root + raw, digest_size=16).digest()
