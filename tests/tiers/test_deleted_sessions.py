"""A delete here is a delete here: a new history begun under a deleted session's name is
kept beside the fleet's (``NAME~2``) and reported, while an older version of the
session replayed on the tier stays refused.  ``delete(fleet=True)`` (``persist rm
--fleet``) deletes the fleet's too: a versioned tombstone takes the pointer's place,
so the next history under the name takes it, a replay of the deleted one is
refused, and a machine still continuing the deleted one is kept beside.

Found from outside (round 5's attack on the fleet): ``persist rm chat``, then
``persist generate --session chat --new``, then ``persist sync`` replaced the
fleet's ``chat`` with the one-turn history; forgetting the versions seen on
delete (the first fix) let a replayed old pointer back in.  Real redis-server,
moto's S3 server, real stores; the command-line case with real processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier, TierUnavailable
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli

KEY = bytes(range(32))
OLD, FLEET = list(range(100, 140)), list(range(100, 148))
OTHER = list(range(900, 940))  # a new conversation under the same name


def machine(tmp: Path, name: str, url: str, tier: str = "shared") -> persist.Store:
    return persist.Store(tmp / name, tier_key=KEY, **{tier: url})


def saved_twice(a: persist.Store) -> None:
    """``chat`` in two versions, the second continuing the first."""
    a.save([kv_cache(40, 1)], OLD, identity=IDENTITY, session="chat")
    a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")


def test_a_local_delete_refuses_replays_and_keeps_a_new_history_beside(
    redis_server: Any, tmp_path: Path
) -> None:
    r, ptr = redis_server.client(), f"{RedisTier.prefix('default')}sess:chat"
    with machine(tmp_path, "a", redis_server.url) as a:
        a.save([kv_cache(40, 1)], OLD, identity=IDENTITY, session="chat")
        stale = r.get(ptr)
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
        fleets = r.get(ptr)
        a.delete("chat")  # here only: the fleet still holds it
        r.set(ptr, stale)  # an authentic older pointer, replayed
        with pytest.raises(persist.SessionNotFoundError):
            a.restore("chat", identity=IDENTITY)
        assert a.stats().counters["shared_stale"] == 1
        r.set(ptr, fleets)
        a.save([kv_cache(40, 2)], OTHER, identity=IDENTITY, session="chat")
        assert a.sync()["conflicts"] == [{"tier": "shared", "session": "chat", "kept_as": "chat~2"}]
    with machine(tmp_path, "c", redis_server.url) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == FLEET
        assert c.restore("chat~2", identity=IDENTITY).tokens == OTHER


@pytest.mark.parametrize("tier", ["redis_server", "s3_server"])
def test_a_fleet_delete_lets_the_next_history_take_the_name(
    tier: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url, kind = request.getfixturevalue(tier).url, "shared" if tier == "redis_server" else "cold"
    with machine(tmp_path, "a", url, kind) as a:
        saved_twice(a)
        a.delete("chat", fleet=True)
    with machine(tmp_path, "b", url, kind) as b, pytest.raises(persist.SessionNotFoundError):
        b.restore("chat", identity=IDENTITY)  # deleted everywhere
    with machine(tmp_path, "a", url, kind) as a:
        a.save([kv_cache(40, 2)], OTHER, identity=IDENTITY, session="chat")
        assert a.sync()["conflicts"] == []
    with machine(tmp_path, "c", url, kind) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == OTHER


def test_a_replay_of_a_session_deleted_from_the_fleet_is_refused(
    redis_server: Any, tmp_path: Path
) -> None:
    r, ptr = redis_server.client(), f"{RedisTier.prefix('default')}sess:chat"
    with machine(tmp_path, "a", redis_server.url) as a:
        saved_twice(a)
        deleted = r.get(ptr)
        a.delete("chat", fleet=True)
    with machine(tmp_path, "b", redis_server.url) as b, pytest.raises(persist.SessionNotFoundError):
        b.restore("chat", identity=IDENTITY)  # b sees the tombstone
    r.set(ptr, deleted)  # the deleted version's authentic pointer, replayed
    for name in ("a", "b"):
        with machine(tmp_path, name, redis_server.url) as m:
            with pytest.raises(persist.SessionNotFoundError):
                m.restore("chat", identity=IDENTITY)
            assert m.stats().counters["shared_stale"] == 1, name


def test_a_turn_continuing_a_session_deleted_from_the_fleet_is_kept_beside(
    redis_server: Any, tmp_path: Path
) -> None:
    with machine(tmp_path, "a", redis_server.url) as a:
        saved_twice(a)
    with machine(tmp_path, "b", redis_server.url) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == FLEET
    with machine(tmp_path, "a", redis_server.url) as a:
        a.delete("chat", fleet=True)
    with machine(tmp_path, "b", redis_server.url) as b:  # b never heard of the delete
        later = [*FLEET, 7, 8]
        b.save([kv_cache(50, 3)], later, identity=IDENTITY, session="chat")
        assert b.sync()["conflicts"] == [{"tier": "shared", "session": "chat", "kept_as": "chat~2"}]
    with machine(tmp_path, "c", redis_server.url) as c:
        with pytest.raises(persist.SessionNotFoundError):
            c.restore("chat", identity=IDENTITY)
        assert c.restore("chat~2", identity=IDENTITY).tokens == later


def both(tmp: Path, name: str, redis: Any, s3: Any) -> persist.Store:
    return persist.Store(tmp / name, tier_key=KEY, shared=redis.url, cold=s3.url)


def test_a_fleet_delete_holds_when_the_shared_tier_loses_everything(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """An outside attack: after ``rm --fleet`` wrote tombstones in Redis and S3, Redis
    was flushed; a machine still holding the deleted session synced it back into
    Redis under its own name (reporting a conflict only against S3's tombstone), a
    fresh machine restored it from Redis, and its next turn replaced S3's tombstone.
    One name for every tier: the cold tier, durable, decides first.  b holds only a
    copy of the deleted version (nothing saved on top): it is not pushed back at all,
    not even as ``chat~2`` (attack 38, finding 3)."""
    with both(tmp_path, "a", redis_server, s3_server) as a:
        saved_twice(a)
    with both(tmp_path, "b", redis_server, s3_server) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == FLEET
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.delete("chat", fleet=True)
    redis_server.client().flushall()
    with both(tmp_path, "b", redis_server, s3_server) as b:
        got = b.sync()
        assert (got["conflicts"], got["deleted_on_fleet"]) == ([], ["chat"]), got
    for only in ({"shared": redis_server.url}, {"cold": s3_server.url}, {}):
        tiers = only or {"shared": redis_server.url, "cold": s3_server.url}
        with persist.Store(tmp_path / f"c{len(tiers)}{sorted(tiers)}", tier_key=KEY, **tiers) as c:
            for name in ("chat", "chat~2"):
                with pytest.raises(persist.SessionNotFoundError):
                    c.restore(name, identity=IDENTITY)


def test_a_fleet_delete_with_the_tier_down_deletes_nothing(
    redis_server: Any, tmp_path: Path
) -> None:
    with machine(tmp_path, "a", redis_server.url) as a:
        saved_twice(a)
        redis_server.stop()
        with pytest.raises(TierUnavailable, match="not deleted"):
            a.delete("chat", fleet=True)
        assert a.has_session("chat")  # nothing half done: try again when it answers


@pytest.mark.long  # four real generate processes; the library cases above are the quick ones
def test_rm_then_generate_new_then_sync_reports_a_conflict(
    model_dir: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, env = str(model_dir("llama")), {"PERSIST_SHARED": redis_server.url}

    def run(machine: str, *args: str) -> Any:
        store = ["--store", str(tmp_path / machine / "store")]
        return persist_cli(tmp_path / machine, *args, *store, check=False, env=env)

    def generate(machine: str, prompt: str, *extra: str) -> Any:
        return run(machine, "generate", "--model", model, "--session", "chat",
                   "--prompt", prompt, "--max-tokens", "3", "--json", *extra)  # fmt: skip

    fleet = json.loads(generate("a", "a conversation the fleet shares").stdout)
    assert run("a", "rm", "chat").returncode == 0
    assert generate("a", "a new one", "--new").returncode == 0
    sync = run("a", "sync")
    assert sync.returncode == 1, (sync.stdout, sync.stderr)
    assert "pushed as 'chat~2'" in sync.stdout, sync.stdout
    resumed = json.loads(generate("b", " and on machine b").stdout)
    assert resumed["reused_tokens"] == fleet["session_tokens"], resumed  # the fleet's

    gone = run("a", "rm", "--fleet", "chat", "--json")
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["fleet"] == ["chat"], gone.stdout
    assert generate("a", "the one to keep", "--new").returncode == 0
    assert run("a", "sync").returncode == 0
    assert json.loads(generate("c", " and on c").stdout)["source"] == "session"


def test_rm_fleet_without_a_tier_is_refused(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "store") as s:
        s.save([kv_cache(40, 1)], OLD, identity=IDENTITY, session="chat")
    out = persist_cli(tmp_path, "rm", "--fleet", "chat", "--store", str(tmp_path / "store"),
                      check=False, env={"PERSIST_SHARED": "", "PERSIST_COLD": ""})  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "rm --fleet needs --shared or --cold" in out.stderr, out.stderr
    with persist.Store(tmp_path / "store") as s:
        assert s.has_session("chat")  # nothing deleted
