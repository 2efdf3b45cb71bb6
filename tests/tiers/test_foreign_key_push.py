"""A push never replaces a tier's session it cannot authenticate.

Found from outside (attack 38b, finding 5): a machine with another operator key (or
none) that saved under a name the fleet holds anyway (``generate --new``, a library
``Store.save(session=...)``, a local copy it held) replaced the fleet's session
pointer on every tier, because a value it could not authenticate counted as "nothing
there": correctly keyed machines then got "no session".  Now such a push keeps the
local save, reports a conflict naming the tier and the key, and writes nothing over
the tier's value; a rotation replaces it only when told (``sync(rekey=True)``).
Real redis-server, moto's S3 server, real stores, a real ``persist sync`` process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli

K1, K2 = bytes(range(32)), bytes(range(1, 33))
FLEET, OTHER = list(range(100, 148)), list(range(900, 920))
KEYS = pytest.mark.parametrize("key", [K2, None], ids=["wrong-key", "keyless"])


def _tiers(redis: Any, s3: Any | None) -> dict[str, str]:
    return {"shared": redis.url, **({"cold": s3.url} if s3 is not None else {})}


def _fleet_resumes(tmp: Path, tiers: dict[str, str]) -> None:
    with persist.Store(tmp / "fresh", tier_key=K1, **tiers) as f:
        assert f.restore("chat", identity=IDENTITY).tokens == FLEET  # the fleet's, untouched


@KEYS
@pytest.mark.parametrize("cold", [True, False], ids=["redis+s3", "redis-only"])
def test_a_save_under_another_key_replaces_no_fleet_session(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    key: Any, cold: bool,
) -> None:  # fmt: skip
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server if cold else None)
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    before = sorted(redis_server.client().keys("*sess:*"))
    with persist.Store(tmp_path / "b", tier_key=key, **tiers) as b:
        b.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")  # --new
        assert b.restore("chat", identity=IDENTITY).tokens == OTHER  # the local save is kept
        counters = b.stats().counters
        assert counters.get("shared_conflicts", 0) == 1, counters
        assert cold is (counters.get("cold_conflicts", 0) == 1), counters
        report = b.sync()
    assert report["conflicts"], report
    for c in report["conflicts"]:
        assert c["session"] == "chat" and c["kept_as"] is None, c
        assert ("key id" in c["why"]) if key else ("no operator key" in c["why"]), c
    assert {c["tier"] for c in report["conflicts"]} == set(tiers)
    assert sorted(redis_server.client().keys("*sess:*")) == before  # no chat~2 under a foreign key
    _fleet_resumes(tmp_path, tiers)


@KEYS
def test_a_copy_held_under_another_key_is_not_pushed_over_the_fleet(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: Any
) -> None:
    """A machine that held the session and continued it after its key changed (a wrong
    key file): its longer turn still goes nowhere over the fleet's value."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server)
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "a", tier_key=key, **tiers) as b:
        b.save([kv_cache(50, 1)], [*FLEET, 7, 8], identity=IDENTITY, session="chat")
        assert b.stats().counters.get("cold_conflicts", 0) == 1
    _fleet_resumes(tmp_path, tiers)


def test_persist_sync_under_another_key_exits_1_naming_tier_and_key(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server)
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", tier_key=K2) as b:  # saved while the tiers were away
        b.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
    flags = ["--shared", redis_server.url, "--cold", s3_server.url, "--store", str(tmp_path / "b")]
    out = persist_cli(tmp_path, "sync", *flags, check=False, env={"PERSIST_TIER_KEY": K2.hex()})
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "conflict" in out.stdout and "key id" in out.stdout, out.stdout
    assert "cold tier" in out.stdout and "shared tier" in out.stdout, out.stdout
    _fleet_resumes(tmp_path, tiers)


def test_a_rotation_replaces_the_old_keys_session_only_when_told(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine cannot tell the old key from the fleet's: ``rekey`` says it is."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server)
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "a", tier_key=K2, **tiers) as a:
        assert a.sync()["conflicts"]
        done = a.sync(rekey=True)
        assert not done["conflicts"] and done["pushed"] == 2, done
    with persist.Store(tmp_path / "c", tier_key=K2, **tiers) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == FLEET


@pytest.mark.parametrize("cold", [True, False], ids=["redis+s3", "redis-only"])
def test_a_refused_push_writes_nothing_to_any_tier(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool
) -> None:
    """A keyless machine in a keyed fleet wrote its own namespace secret (and block size)
    to Redis before its push was refused (attack 38b, finding 5): then a fresh keyless
    machine chained under that secret.  A refused push leaves every tier as it was."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server if cold else None)
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    r, s3 = redis_server.client(), s3_server.client()

    def state() -> tuple[Any, Any]:
        listed = s3.list_objects_v2(Bucket="persist-test").get("Contents", [])
        return {k: r.dump(k) for k in r.keys("*")}, sorted(o["Key"] for o in listed)

    before = state()
    with persist.Store(tmp_path / "b", **tiers) as b:  # no key
        b.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
        assert b.sync()["conflicts"]
    assert state() == before


def test_a_wrong_key_that_wrote_alone_to_redis_does_not_vouch_for_itself(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the cold tier, which decides names, vouches for a key (``fleet_plan``): a
    machine with the wrong key that once pushed alone to Redis (a ``--shared``-only
    setup, the fleet's pointer evicted there) finds its own session authenticated on
    Redis, and must still not replace the fleet's durable cold pointer."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    cold, both = {"cold": s3_server.url}, _tiers(redis_server, s3_server)
    with persist.Store(tmp_path / "a", tier_key=K1, **cold) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", tier_key=K2, shared=redis_server.url) as b:
        b.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", tier_key=K2, **both) as b:
        b.save([kv_cache(22, 9)], [*OTHER, 1, 2], identity=IDENTITY, session="chat")
        assert b.stats().counters.get("cold_conflicts") == 1
    with persist.Store(tmp_path / "fresh", tier_key=K1, **cold) as f:
        assert f.restore("chat", identity=IDENTITY).tokens == FLEET
