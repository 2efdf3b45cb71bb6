"""A tier's record is replaced only by a snapshot that continues it by its tokens; a
version older than this store's base is no licence (``lineage.continues``).

Found from outside (attack 38d): a push took the name whenever the tier's version was
at or below ``Index.base`` (the latest version this store's own history of the name
pushed or pulled).  Versions are save times from every machine's clock, so a record
from a machine whose clock is behind (or one planted with an old version) that the
snapshot does not extend was replaced without a conflict: that history lost its name
fleet-wide.  Now only a tombstone (a fleet delete this store's history moved past)
is taken by version; a record the snapshot does not extend keeps the name and the
snapshot goes beside as ``NAME~2``, a conflict.  Real redis-server, moto's S3 server.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import persist
from persist.engine import saving
from persist.engine.tiers.lineage import Held, continues
from persist.remote.redis_tier import RedisTier
from tests.golden.cases import IDENTITY, kv_cache
from tests.tiers.two_tiers import KEY, restored

V1, V2 = list(range(100, 148)), list(range(100, 160))  # a's conversation, two turns
OTHER = list(range(900, 920))  # b's, under the same name


def test_an_older_record_the_turn_does_not_extend_keeps_the_name(
    redis_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis evicts ``chat``'s pointer; b, its clock an hour behind, starts another
    conversation ``chat`` there (an older version than a's); a's next turn goes beside."""
    tier = {"shared": redis_server.url, "tier_key": KEY}
    with persist.Store(tmp_path / "a", **tier) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    assert redis_server.client().delete(f"{RedisTier.prefix('default')}sess:chat") == 1
    behind = SimpleNamespace(time=lambda: time.time() - 3600.0)
    with monkeypatch.context() as m, persist.Store(tmp_path / "b", **tier) as b:
        m.setattr(saving, "time", behind)  # b's clock: its save time is its version
        b.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
        b_version = b.entry("chat").created
    with persist.Store(tmp_path / "a", **tier) as a:
        assert b_version < a.index.base("default", "chat")  # older than a's base
        a.save([kv_cache(60, 1)], V2, identity=IDENTITY, session="chat")
        assert a.stats().counters.get("shared_conflicts") == 1
        done = a.sync()
        assert done["conflicts"] == [{"tier": "shared", "session": "chat", "kept_as": "chat~2"}]
    with persist.Store(tmp_path / "f", **tier) as f:
        assert restored(f) == OTHER  # b's history keeps its name
        assert restored(f, "chat~2") == V2  # a's beside it


def test_a_tombstone_at_or_below_the_base_is_taken_by_the_next_history(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """``rm --fleet`` then a new conversation under the name: it takes the name on every
    tier (the tombstone is a version this store's history moved past), no conflict."""
    tiers = {"shared": redis_server.url, "cold": s3_server.url, "tier_key": KEY}
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
        assert a.delete("chat", fleet=True)
        a.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
        assert not a.stats().counters.get("shared_conflicts")
        assert not a.stats().counters.get("cold_conflicts")
        assert not a.sync()["conflicts"]
    with persist.Store(tmp_path / "f", **tiers) as f:
        assert restored(f) == OTHER and restored(f, "chat~2") is None


def test_a_planted_pointer_still_lets_a_new_conversation_go_beside(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cold tier authenticates, under this key, the record this store pushed (at its
    base): evidence that the key is the fleet's, whether or not the new conversation
    continues it.  A tag-stripped pointer on Redis then refuses nothing: the new
    conversation goes beside on both tiers, the fleet's ``chat`` stays a's first."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url, "tier_key": KEY}
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    r = redis_server.client()
    key = f"{RedisTier.prefix('default')}sess:chat"
    r.set(key, r.get(key).partition(b".")[0])  # the keyless writer's one SET
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
        done = a.sync()
    kept = {(c["tier"], c["kept_as"]) for c in done["conflicts"] if c["session"] == "chat"}
    assert kept == {("cold", "chat~2")}, done  # beside, not refused (kept_as None)
    with persist.Store(tmp_path / "f", **tiers) as f:
        assert restored(f) == V1 and restored(f, "chat~2") == OTHER


# --- continues, as a property -------------------------------------------------------

tokens = st.lists(st.integers(0, 3), max_size=6)
versions = st.floats(1.0, 100.0)
bases = st.none() | versions


@st.composite
def records(draw: Any) -> Held:
    return Held(None, draw(st.sampled_from(["r1", "r2"])), draw(tokens), draw(versions))


@given(toks=tokens, held=records(), base=bases)
def test_a_record_is_continued_only_by_its_own_record_or_tokens_that_extend_it(
    toks: list[int], held: Held, base: float | None
) -> None:
    extends = toks[: len(held.tokens or [])] == held.tokens
    assert continues(toks, held, "r1", base) == (held.rkey == "r1" or extends)
    for other in (None, 0.0, held.version, 1e9):  # a version decides nothing for a record
        assert continues(toks, held, "r1", other) == continues(toks, held, "r1", base)


@given(toks=tokens, version=versions, base=bases)
def test_a_tombstone_is_taken_only_at_or_below_the_base(
    toks: list[int], version: float, base: float | None
) -> None:
    stone = Held(None, None, None, version)
    assert continues(toks, stone, "r1", base) == (base is not None and version <= base)


@given(toks=tokens, base=bases)
def test_nothing_there_is_taken(toks: list[int], base: float | None) -> None:
    assert continues(toks, Held(None, None, None, None), "r1", base)
