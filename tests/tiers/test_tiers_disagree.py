"""The tiers disagree about a session name: the newest version by lineage wins.

Found from outside (attack 38b, findings 1, 2, 3 and 13):

1. a cold tier that came back with an older pointer (a restore from backup, a
   versioned bucket rolled back) won over a newer Redis: a fresh machine resumed the
   older version, and its next push replaced Redis's newer turn (or tombstone) with
   no conflict; a machine with only ``--shared`` did the same without any rollback;
2. a cold tier that came back empty after ``rm --fleet``: ``sync`` said "deleted on
   the fleet" and pushed the deleted session to S3 under its name;
3. after ``rm --fleet`` and a new conversation under the name, a machine holding an
   unchanged pulled copy pushed the deleted conversation back as ``NAME~2``;
13. ``rm --fleet`` where another machine had deleted the name already did not record
   that tombstone, so the next conversation went to ``NAME~2``.

Real redis-server, moto's S3 server, real stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from persist.remote.s3_tier import S3Tier
from tests.golden.cases import IDENTITY, kv_cache
from tests.tiers.two_tiers import KEY, both, pointers, restored

FLEET = list(range(100, 148))  # version N
LATER = list(range(100, 156))  # version N+1, continuing N
OTHER = list(range(500, 540))  # a new conversation under the name


def set_cold(s3: Any, value: bytes) -> None:
    """The cold tier's ``chat`` pointer put back to ``value`` (a rollback)."""
    tier = S3Tier(s3.url)
    _, token = tier.session_pointer("default", b"chat")
    assert tier.swap_session("default", b"chat", value, token)


def emptied(s3: Any) -> None:
    """Every object of the bucket deleted (a new bucket, a lifecycle rule)."""
    c = s3.client()
    for o in c.list_objects_v2(Bucket="persist-test").get("Contents", []):
        c.delete_object(Bucket="persist-test", Key=o["Key"])


def test_a_cold_tier_rolled_back_loses_to_a_newer_redis(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """Finding 1, the reader: Redis's newer version is resumed and the cold tier repaired;
    the push of a machine that continued the older version goes beside."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
        older = pointers(redis_server, s3_server)[1]
        with both(tmp_path, "g", redis_server, s3_server) as g:
            assert restored(g) == FLEET  # g holds N, and will continue it
        a.save([kv_cache(56, 2)], LATER, identity=IDENTITY, session="chat")
    newer = pointers(redis_server, s3_server)[0]
    assert older is not None and newer is not None
    set_cold(s3_server, older)
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) == LATER
        assert f.stats().counters.get("cold_repaired") == 1, f.stats().counters
    assert pointers(redis_server, s3_server) == (newer, newer)
    set_cold(s3_server, older)  # rolled back again, before g pushes its turn on N
    with both(tmp_path, "g", redis_server, s3_server) as g:
        g.save([kv_cache(52, 3)], [*FLEET, 7, 7, 7, 7], identity=IDENTITY, session="chat")
        got = g.sync()["conflicts"]  # said once, by the tier that decides the name
        assert got == [{"tier": "cold", "session": "chat", "kept_as": "chat~2"}], got
    assert pointers(redis_server, s3_server)[0] == newer  # N+1 is not replaced
    fork = [("sess", b"chat~2")]
    assert RedisTier(redis_server.url).pointers("default", fork)[0] is not None
    with both(tmp_path, "h", redis_server, s3_server) as h:
        assert restored(h) == LATER
        assert restored(h, "chat~2") == [*FLEET, 7, 7, 7, 7]


def test_a_turn_from_a_machine_without_the_cold_tier_is_not_overwritten(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """Finding 1, a mixed fleet: a Redis-only machine's turn is newer than the cold
    tier's version; a machine with both tiers resumes it and does not replace it."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "m", tier_key=KEY, shared=redis_server.url) as m:
        assert restored(m) == FLEET
        m.save([kv_cache(56, 2)], LATER, identity=IDENTITY, session="chat")
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) == LATER
        f.save([kv_cache(58, 3)], [*LATER, 1, 2], identity=IDENTITY, session="chat")
        assert f.sync()["conflicts"] == []
    with persist.Store(tmp_path / "k", tier_key=KEY, shared=redis_server.url) as k:
        assert restored(k) == [*LATER, 1, 2]


def test_a_cold_tier_rolled_back_past_a_fleet_delete_does_not_resurrect(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """Finding 1, case 5: Redis's tombstone is newer than the cold tier's record."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
        deleted = pointers(redis_server, s3_server)[1]
        assert a.delete("chat", fleet=True) == ["cold", "shared"]
    assert deleted is not None
    set_cold(s3_server, deleted)
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) is None
    gone = pointers(redis_server, s3_server)
    assert gone[0] is not None and gone[0].startswith(b"~")
    assert gone[1] == gone[0]  # the cold tier repaired to the tombstone
    with both(tmp_path, "k", redis_server, s3_server) as k:
        assert restored(k) is None


@pytest.mark.parametrize("saw", [True, False])
def test_a_cold_tier_emptied_after_a_fleet_delete_gets_nothing_back(
    saw: bool, redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """Finding 2: an empty tier cannot prove the delete; the other's tombstone holds."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with both(tmp_path, "b", redis_server, s3_server) as b:
        assert restored(b) == FLEET
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.delete("chat", fleet=True)
    with both(tmp_path, "b", redis_server, s3_server) as b:
        if saw:
            assert b.sync()["deleted_on_fleet"] == ["chat"]
        emptied(s3_server)
        got = b.sync()
        assert (got["pushed"], got["conflicts"], got["deleted_on_fleet"]) == (0, [], ["chat"])
    cold = pointers(redis_server, s3_server)[1]
    assert cold is None or cold.startswith(b"~"), cold
    for only in ({"cold": s3_server.url}, {"shared": redis_server.url, "cold": s3_server.url}):
        with persist.Store(tmp_path / f"fresh{len(only)}", tier_key=KEY, **only) as f:
            assert restored(f) is None and restored(f, "chat~2") is None


@pytest.mark.parametrize("synced_between", [True, False])
def test_an_unchanged_copy_of_a_deleted_session_is_not_pushed_back_beside_a_new_one(
    synced_between: bool, redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """Finding 3: after ``rm --fleet`` and a new conversation under the name, a copy
    pulled before the delete, with nothing saved on it, is the fleet's past."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with both(tmp_path, "b", redis_server, s3_server) as b:
        assert restored(b) == FLEET
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.delete("chat", fleet=True)
    if synced_between:
        with both(tmp_path, "b", redis_server, s3_server) as b:
            assert b.sync()["deleted_on_fleet"] == ["chat"]
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(40, 7)], OTHER, identity=IDENTITY, session="chat")
        assert a.sync()["conflicts"] == []
    with both(tmp_path, "b", redis_server, s3_server) as b:
        got = b.sync()
        assert (got["pushed"], got["conflicts"], got["deleted_on_fleet"]) == (0, [], ["chat"])
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) == OTHER
        assert restored(f, "chat~2") is None


def test_a_second_fleet_delete_records_the_tombstone_it_finds(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """Finding 13: c deleted the name first; a's own ``rm --fleet`` finds the tombstone,
    and a's next conversation takes the name as if a had written it."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(32, 1)], FLEET[:32], identity=IDENTITY, session="chat")
        with both(tmp_path, "c", redis_server, s3_server) as c:
            assert c.delete("chat", fleet=True) == ["cold", "shared"]
        assert a.delete("chat", fleet=True) == []
        a.save([kv_cache(20, 5)], OTHER[:20], identity=IDENTITY, session="chat")
        assert a.sync()["conflicts"] == []
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) == OTHER[:20]
        assert restored(f, "chat~2") is None
