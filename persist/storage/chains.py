"""Token lists as the index keeps them, and the chained hashes that find them.  No mlx.

Block i of a snapshot is found by h_i = H(h_{i-1}, tokens of block i), with
h_-1 keyed by the namespace secret and the identity.  A snapshot's head key
(its first ``HEAD_TOKENS`` tokens under h_-1) finds it for prompts that share
less than one block with it.  Hashes only select candidates: token lists,
compared in full, decide.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ..format.tokens import pack_tokens

__all__ = [
    "HEAD_TOKENS",
    "chain_root",
    "chains",
    "head_key",
    "boundary_heads",
]

HEAD_TOKENS = 16  # the shortest prefix a lookup reuses


def chain_root(secret: bytes, identity_digest: str) -> bytes:
    """h_-1: keyed by the namespace secret, so no other namespace can reach or probe it."""
    return hashlib.blake2b(identity_digest.encode(), key=secret[:64], digest_size=16).digest()


def chains(root: bytes, tokens: Sequence[int], block: int) -> list[bytes]:
    """[h_-1, h_0, ..., h_{k-1}] for the k full blocks of ``tokens``."""
    out = [root]
    for i in range(len(tokens) // block):
        chunk = pack_tokens(tokens[i * block : (i + 1) * block])
        out.append(hashlib.blake2b(out[-1] + chunk, digest_size=16).digest())
    return out


def head_key(root: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a token list's first ``HEAD_TOKENS`` tokens under ``root``.

    Shorter lists get a key no prompt produces: prefixes that short are not
    worth a lookup (such a snapshot is still restored by name).
    """
    if len(tokens) < HEAD_TOKENS:
        raw = b"short" + pack_tokens(tokens)
    else:
        raw = pack_tokens(tokens[:HEAD_TOKENS])
    return hashlib.blake2b(root + raw, digest_size=16).digest()


def boundary_heads(chains: Sequence[bytes], tokens: Sequence[int], block: int) -> list[bytes]:
    """``head_key`` at each block boundary b that HEAD_TOKENS tokens follow, under chain
    b (``chains`` as ``chains()`` gives them, h_-1 first): finds prefixes that end
    inside a block, in the index (``heads``) and in the shared tier (``head:``)."""
    out = []
    for b, chain in enumerate(chains):
        if len(tokens) - b * block < HEAD_TOKENS:
            break
        out.append(head_key(chain, tokens[b * block :]))
    return out
