"""Token ids as every persist layout stores them: little-endian uint32, packed once here.

No mlx.  ``check_tokens`` is the one gate every token list passes before it
is hashed, compared or written.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence

from ..errors import InvalidTokensError
from ..records import MAX_TOKENS

__all__ = ["MAX_TOKEN", "check_tokens", "pack_tokens", "unpack_tokens", "common_prefix_packed"]

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
