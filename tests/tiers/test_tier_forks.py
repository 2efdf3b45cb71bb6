"""Two tiers holding two different histories under one name are a fork, not a newer version.

Found from outside (attack 38c, finding 2): the shared tier lost ``chat``'s pointer
(an LRU), then a machine with only ``--shared`` started a new conversation ``chat``
there; a fresh machine with both tiers took Redis's (newer by save time) and
"repaired" the cold tier over the original, which no tier named any more, and the
original writer's ``sync`` listed its own live copy as "deleted on the fleet".  The
reverse (the cold tier lost the pointer, a ``--cold``-only machine started ``chat``)
repaired Redis over the original the same way.  Now the cold tier decides the name
(its history is read), the other tier's is left as it is (counted ``<tier>_forked``,
logged), and the original's holder keeps its copy beside, a conflict.

Real redis-server, moto's S3 server, real stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import persist
from persist.remote.redis_tier import RedisTier
from tests.golden.cases import IDENTITY, kv_cache
from tests.tiers.two_tiers import KEY, both, pointers, restored

ORIG = list(range(100, 160))  # the fleet's conversation
OTHER = list(range(900, 920))  # a new one started under the name where a tier lost it
BESIDE = [{"tier": "cold", "session": "chat", "kept_as": "chat~2"}]


def only(tmp: Path, name: str, **tier: str) -> persist.Store:
    return persist.Store(tmp / name, tier_key=KEY, **tier)


def redis_lost_pointer(redis: Any) -> None:
    """Redis's ``chat`` pointer evicted (an LRU), its record and blobs kept."""
    assert redis.client().delete(f"{RedisTier.prefix('default')}sess:chat") == 1


def cold_lost_pointer(s3: Any) -> None:
    """The cold tier's ``chat`` pointer object deleted (a lifecycle rule, by hand)."""
    c = s3.client()
    got = [o["Key"] for o in c.list_objects_v2(Bucket="persist-test").get("Contents", [])]
    sess = [k for k in got if k.endswith("/sess/chat")]
    assert len(sess) == 1, got
    c.delete_object(Bucket="persist-test", Key=sess[0])


def test_a_new_history_on_redis_does_not_replace_the_cold_tiers(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(60, 1)], ORIG, identity=IDENTITY, session="chat")
    redis_lost_pointer(redis_server)
    with only(tmp_path, "m", shared=redis_server.url) as m:
        m.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) == ORIG  # the cold tier decides the name
        got = f.stats().counters
        assert got.get("shared_forked") == 1 and not got.get("cold_repaired"), got
    held = pointers(redis_server, s3_server)
    assert held[0] != held[1]  # neither history written over the other
    with only(tmp_path, "k", shared=redis_server.url) as k:
        assert restored(k) == OTHER
    with only(tmp_path, "g", cold=s3_server.url) as g:
        assert restored(g) == ORIG
    with both(tmp_path, "a", redis_server, s3_server) as a:
        got = a.sync()
        assert (got["deleted_on_fleet"], got["conflicts"]) == ([], BESIDE), got
    with both(tmp_path, "h", redis_server, s3_server) as h:
        assert restored(h) == ORIG and restored(h, "chat~2") == ORIG


def test_a_new_history_on_the_cold_tier_does_not_replace_redis(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(60, 1)], ORIG, identity=IDENTITY, session="chat")
    cold_lost_pointer(s3_server)
    with only(tmp_path, "m", cold=s3_server.url) as m:
        m.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) == OTHER  # the cold tier's: it decides the name
        got = f.stats().counters
        assert got.get("shared_forked") == 1 and not got.get("shared_repaired"), got
    with only(tmp_path, "k", shared=redis_server.url) as k:
        assert restored(k) == ORIG  # Redis's history is not written over
    with both(tmp_path, "a", redis_server, s3_server) as a:
        got = a.sync()
        assert (got["deleted_on_fleet"], got["conflicts"]) == ([], BESIDE), got
    with both(tmp_path, "h", redis_server, s3_server) as h:
        assert restored(h) == OTHER and restored(h, "chat~2") == ORIG


def test_a_newer_turn_of_the_same_history_still_repairs_the_other_tier(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """Not a fork: Redis's newer version extends the cold tier's (a turn from a machine
    with only ``--shared``): it wins and the cold tier is repaired, as before."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], ORIG[:48], identity=IDENTITY, session="chat")
    with only(tmp_path, "m", shared=redis_server.url) as m:
        assert restored(m) == ORIG[:48]
        m.save([kv_cache(60, 2)], ORIG, identity=IDENTITY, session="chat")
    with both(tmp_path, "f", redis_server, s3_server) as f:
        assert restored(f) == ORIG
        got = f.stats().counters
        assert got.get("cold_repaired") == 1 and not got.get("shared_forked"), got
    held = pointers(redis_server, s3_server)
    assert held[0] == held[1]
