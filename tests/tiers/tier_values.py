"""What a test reads off a real tier to overwrite it as a hostile writer would."""

from __future__ import annotations

from typing import Any


def blob_keys(r: Any, p: str) -> list[bytes]:
    """Every whole blob's key under prefix ``p`` on Redis client ``r`` (not its parts)."""
    return sorted(k for k in r.scan_iter(f"{p}blob:*") if b":" not in k[len(p) + 5 :])


def keys_of(r: Any, p: str, kind: str) -> list[bytes]:
    """Every key of one kind (``blk``, ``head``, ``sess``...) under prefix ``p``."""
    return sorted(r.scan_iter(f"{p}{kind}:*"))
