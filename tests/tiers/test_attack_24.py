"""Attacks on issue 24's fleet tiers (authenticated records, truthful sync, S3 names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.store.redis_tier import RedisTier
from tests.helpers import assert_same_state, live_state, prefill, tokens_for

KEY = bytes(range(32))


@pytest.mark.xfail(strict=True, reason="an old authentic sess: pointer replayed restores the stale version")
def test_replayed_old_pointer_is_not_restored_as_current(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r, p = redis_server.client(), RedisTier.prefix("default")
    old, new = tokens_for(300, seed=1), tokens_for(320, seed=2)
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, old)[0], old, identity=ident, session="x")
        stale = r.get(f"{p}sess:x")
        a.save(prefill(model, new)[0], new, identity=ident, session="x")
    assert r.get(f"{p}sess:x") != stale
    r.set(f"{p}sess:x", stale)  # the attacker replays the authentic old pointer
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        try:
            got = b.restore("x", identity=ident)
        except persist.SessionNotFoundError:
            return  # a miss is acceptable
        assert got.tokens == new, "the stale version of x was restored as current"
