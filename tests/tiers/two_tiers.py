"""Two machines' view of a fleet with both tiers: a store on Redis and the cold tier,
each tier's ``chat`` pointer, and what a store restores of a name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import persist
from persist.remote.redis_tier import RedisTier
from persist.remote.s3_tier import S3Tier
from tests.golden.cases import IDENTITY

KEY = bytes(range(32))


def both(tmp: Path, name: str, redis: Any, s3: Any) -> persist.Store:
    return persist.Store(tmp / name, tier_key=KEY, shared=redis.url, cold=s3.url)


def pointers(redis: Any, s3: Any) -> tuple[bytes | None, bytes | None]:
    """(Redis's, the cold tier's) ``chat`` pointer."""
    item = [("sess", b"chat")]
    return (
        RedisTier(redis.url).pointers("default", item)[0],
        S3Tier(s3.url).pointers("default", item)[0],
    )


def restored(store: persist.Store, name: str = "chat") -> list[int] | None:
    try:
        return list(store.restore(name, identity=IDENTITY).tokens)
    except persist.SessionNotFoundError:
        return None
