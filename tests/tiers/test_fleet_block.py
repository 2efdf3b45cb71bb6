"""One block size per fleet: a shared tier records the namespace's block size when a
store first saves to it, and a store that cuts other blocks refuses the tier.

Prefix lookups find a fleet's snapshots by chain hashes of whole blocks, so a
machine with 256-token blocks never finds one a machine with 16-token blocks
pushed (every prefix lookup missed, and nothing said so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import prefill, tokens_for
from tests.trim_checks import assert_continues_alike


def saved(model: Any, tok: Any, root: Path, url: str, block: int) -> list[int]:
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=41)
    with persist.Store(root, shared=url, block_tokens=block) as s:
        s.save(prefill(model, toks)[0], toks, identity=ident, session="chat")
    return toks


def test_a_store_of_another_block_size_refuses_the_tier(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = saved(model, tok, tmp_path / "a", redis_server.url, 16)
    prompt = [*toks[:200], 1, 2, 3]
    with persist.Store(tmp_path / "b", shared=redis_server.url, block_tokens=256) as b:
        with pytest.raises(persist.BlockSizeMismatchError) as e:
            b.lookup(prompt, identity=ident)
        msg = str(e.value)
        assert "16" in msg and "256" in msg and "block_tokens" in msg
        assert (e.value.tier, e.value.store) == (16, 256)
        assert isinstance(e.value, ValueError)
        with pytest.raises(persist.BlockSizeMismatchError):
            b.save(prefill(model, toks[:20])[0], toks[:20], identity=ident, session="x")
        assert b.sessions() == []  # refused before anything was written here
    # another namespace is another fleet setting: its first saver sets it
    with persist.Store(tmp_path / "c", shared=redis_server.url, block_tokens=256) as c:
        c.save(prefill(model, toks[:20])[0], toks[:20], identity=ident, namespace="other")


def test_equal_block_sizes_share_prefix_hits(tiny: Any, redis_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = saved(model, tok, tmp_path / "a", redis_server.url, 16)
    prompt = [*toks[:200], 1, 2, 3]
    with persist.Store(tmp_path / "b", shared=redis_server.url, block_tokens=16) as b:
        hit = b.lookup(prompt, identity=ident)
        assert hit is not None and hit.tokens == prompt[:200]
        assert_continues_alike(model, hit.cache, prefill(model, prompt[:200])[0], prompt[200:])


def test_the_tier_records_the_first_savers_block_size(redis_server: Any) -> None:
    tier = RedisTier(redis_server.url)
    assert tier.block_tokens("ns", 32, create=False) is None  # a read creates nothing
    assert tier.block_tokens("ns", 32, create=True) == 32
    assert tier.block_tokens("ns", 64, create=True) == 32  # the first one stays
    key = RedisTier.prefix("ns") + "block_tokens"
    redis_server.client().set(key, b"garbage")  # persist's own key gone bad: replaced
    assert RedisTier(redis_server.url).block_tokens("ns", 64, create=True) == 64
