"""A value planted on Redis does not stop the keyed fleet's push, and the push repairs it.

Found from outside (attack 38c, finding 4): a writer without the key stripped the tag
off Redis's session pointer (one SET); the fleet's own machine then pushed its next
turn to no tier at all (not even the cold one, whose pointer it authenticated), told
its operator that the correct key was not the fleet's, other machines resumed the
older turn, and the committed turn ended as ``chat~2``.  Now the cold tier,
authenticating under this key a session of the name this store's history continues,
shows the key is the fleet's: the push goes on, and the unauthenticated value on
Redis decides nothing and is replaced (counted ``shared_foreign_replaced``), as
docs/fleet.md promises of planted values.  Where the cold tier does not vouch, the
push is still refused (tests/tiers/test_foreign_key_push.py).  Real redis-server, moto's S3 server.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache

K1 = bytes(range(32))
V1, V2 = list(range(100, 148)), list(range(100, 160))


def _strip_tag(redis: Any) -> None:
    """The keyless attacker: Redis's session pointer of ``chat`` without its tag."""
    r = redis.client()
    [k] = list(r.scan_iter("*sess:*"))
    r.set(k, r.get(k).partition(b".")[0])


def _tagged(redis: Any) -> bool:
    r = redis.client()
    [k] = list(r.scan_iter("*sess:*"))
    return b"." in r.get(k)


def test_a_planted_pointer_on_one_tier_does_not_stop_the_next_turn(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url, "tier_key": K1}
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    _strip_tag(redis_server)
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(60, 1)], V2, identity=IDENTITY, session="chat")
        counters = a.stats().counters
        assert not counters.get("shared_conflicts") and not counters.get("cold_conflicts"), counters
        assert counters.get("shared_foreign_replaced") == 1, counters
        assert not a.sync()["conflicts"]
    assert _tagged(redis_server)
    with persist.Store(tmp_path / "b", **tiers) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == V2
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=K1) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == V2  # Redis's own, repaired


def test_persist_sync_repairs_a_planted_pointer(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url, "tier_key": K1}
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(60, 1)], V2, identity=IDENTITY, session="chat")
    _strip_tag(redis_server)
    with persist.Store(tmp_path / "a", **tiers) as a:
        done = a.sync()
        assert not done["conflicts"], done
        assert a.stats().counters.get("shared_foreign_replaced") == 1
    assert _tagged(redis_server)
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=K1) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == V2


def test_a_forged_tombstone_on_one_tier_does_not_send_the_turn_beside(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One SET of an untagged tombstone with a far-future version: the cold tier still
    vouches for the key, so the forgery decides nothing and is replaced; the turn keeps
    its name (no ``chat~2``) and every machine resumes it."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url, "tier_key": K1}
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    r = redis_server.client()
    [k] = list(r.scan_iter("*sess:*"))
    r.set(k, b"~" + struct.pack(">d", 4e9).hex().encode())  # no key needed
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save([kv_cache(60, 1)], V2, identity=IDENTITY, session="chat")
        counters = a.stats().counters
        assert not counters.get("shared_conflicts") and not counters.get("cold_conflicts"), counters
        assert not a.sync()["conflicts"]
    assert _tagged(redis_server)
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=K1) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == V2
