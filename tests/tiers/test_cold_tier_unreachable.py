"""With the cold tier configured but unreachable, a session's push to the shared tier
holds its name back: the cold tier alone decides which name a session takes.

Found from outside (edge2's attack): after ``rm --fleet`` put tombstones in Redis
and S3, Redis was flushed; a machine still holding the deleted session synced
while S3 could not be reached (its endpoint a dead port, as in an outage), its
cold push failed so no fork name was learned, and the session went to Redis
under its own name: a fresh machine restored the deleted conversation.  Real
redis-server, moto's S3 server, real stores; S3 made unreachable by pointing a
machine at a port nothing listens on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import TierUnavailable
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli
from tests.tiers.conftest import free_port, s3_down

KEY = bytes(range(32))
FLEET = list(range(100, 148))
LATER = [*FLEET, 7, 8]


def both(tmp: Path, name: str, redis: Any, s3: Any) -> persist.Store:
    return persist.Store(tmp / name, tier_key=KEY, shared=redis.url, cold=s3.url)


def deleted_then_flushed(tmp: Path, redis: Any, s3: Any) -> None:
    """``chat`` saved on a, restored on b, deleted fleet-wide by a; then Redis loses all."""
    with both(tmp, "a", redis, s3) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with both(tmp, "b", redis, s3) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == FLEET
    with both(tmp, "a", redis, s3) as a:
        a.delete("chat", fleet=True)
    redis.client().flushall()


def test_a_sync_with_the_cold_tier_unreachable_gives_no_deleted_session_back(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deleted_then_flushed(tmp_path, redis_server, s3_server)
    with s3_down(monkeypatch), both(tmp_path, "b", redis_server, s3_server) as b:
        b.sync()
    c = both(tmp_path, "c", redis_server, s3_server)
    with c, pytest.raises(persist.SessionNotFoundError):
        c.restore("chat", identity=IDENTITY)


def test_a_save_with_the_cold_tier_unreachable_gives_no_deleted_session_back(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deleted_then_flushed(tmp_path, redis_server, s3_server)
    with s3_down(monkeypatch), both(tmp_path, "b", redis_server, s3_server) as b:
        b.save([kv_cache(50, 3)], LATER, identity=IDENTITY, session="chat")  # the write-through
    c = persist.Store(tmp_path / "c", tier_key=KEY, shared=redis_server.url)
    with c, pytest.raises(persist.SessionNotFoundError):
        c.restore("chat", identity=IDENTITY)


def test_a_sync_with_the_cold_tier_unreachable_reports_the_session_held_back(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deleted_then_flushed(tmp_path, redis_server, s3_server)
    with s3_down(monkeypatch), both(tmp_path, "b", redis_server, s3_server) as b:
        got = b.sync()
    assert (got["tiers"]["shared"]["held"], got["snapshots_failed"]) == (1, 1), got


def test_a_session_held_back_is_decided_by_the_cold_tier_once_it_answers(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b holds only a copy of the version the fleet deleted (nothing saved on top):
    once the cold tier answers, its tombstone decides for both tiers, and the copy is
    not pushed back, not even as ``chat~2`` (attack 38, finding 3)."""
    deleted_then_flushed(tmp_path, redis_server, s3_server)
    with s3_down(monkeypatch), both(tmp_path, "b", redis_server, s3_server) as b:
        b.sync()
    with both(tmp_path, "b", redis_server, s3_server) as b:
        got = b.sync()
    assert (got["deleted_on_fleet"], got["conflicts"], got["pushed"]) == (["chat"], [], 0), got
    with persist.Store(tmp_path / "c", tier_key=KEY, shared=redis_server.url) as c:
        for name in ("chat", "chat~2"):
            with pytest.raises(persist.SessionNotFoundError):
                c.restore(name, identity=IDENTITY)


def test_persist_sync_exits_1_naming_a_session_held_back(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    deleted_then_flushed(tmp_path, redis_server, s3_server)
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"PERSIST_SHARED": redis_server.url, "PERSIST_COLD": s3_server.url,
           "PERSIST_TIER_KEY": KEY.hex(), "AWS_ENDPOINT_URL": dead}  # fmt: skip
    out = persist_cli(tmp_path, "sync", "--store", str(tmp_path / "b"), check=False, env=env)
    assert (out.returncode, "held back 1" in out.stdout) == (1, True), (out.stdout, out.stderr)


def test_a_fleet_delete_with_the_cold_tier_down_writes_no_tombstone_anywhere(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rm --fleet`` asks the cold tier first, as a push does: with it down, the Redis
    pointer is left as it was, not a tombstone the cold tier lacks (attack 38, finding 7)."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    before = {k: redis_server.client().get(k) for k in redis_server.client().scan_iter()}
    with s3_down(monkeypatch), both(tmp_path, "a", redis_server, s3_server) as a:
        with pytest.raises(TierUnavailable, match="not deleted"):
            a.delete("chat", fleet=True)
        assert a.has_session("chat")
    after = {k: redis_server.client().get(k) for k in redis_server.client().scan_iter()}
    assert after == before  # nothing half done
