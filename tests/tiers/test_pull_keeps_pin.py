"""``sync --pull NAME`` over a copy here (attack 38f): the fleet's newer turn that
replaces the copy keeps the copy's pin and retention hints (F2: pinned 0, hints
dropped), a pull that loses the race to a local save reports the name ``kept_here``,
not ``missing`` (F3), and a version refused as a replay is ``unreadable`` with why,
never "not in any tier".  Real redis-server and moto's S3 server; the race is a hook
on the pull's commit, no sleeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.engine.tiers import pull as pull_mod
from persist.remote.redis_tier import RedisTier
from persist.storage import writes
from tests.golden.cases import IDENTITY, kv_cache
from tests.tiers.two_tiers import KEY, both, restored

T = list(range(100, 148))


def _fleet_turn_after(tmp: Path, redis: Any, s3: Any) -> None:
    """a saves v1 of chat; b, another machine, continues it (v2) on the fleet."""
    with both(tmp, "a", redis, s3) as a:
        a.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
    with both(tmp, "b", redis, s3) as b:
        assert restored(b) == T
        b.save([kv_cache(50, 2)], [*T, 7, 8], identity=IDENTITY, session="chat")


def test_the_fleets_newer_turn_keeps_the_copys_pin_and_hints(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    _fleet_turn_after(tmp_path, redis_server, s3_server)
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.pin("chat")
        a.retain("chat", ttl=600.0, priority=7)
        got = a.sync(pull=["chat"])
        assert got["pulled"] == ["chat"], got
        assert restored(a) == [*T, 7, 8]
        assert a.entry("chat").pinned
        with a.index.read() as db:
            assert writes.session_hints(db, "default", "chat") == (600.0, 7)


def test_a_pull_that_loses_the_race_to_a_local_save_is_kept_here(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fleet_turn_after(tmp_path, redis_server, s3_server)
    mine = [*T, 1, 2, 3]  # this machine's own turn: another history than the fleet's
    real = pull_mod._commit

    def local_save_first(*a: Any, **k: Any) -> Any:  # the pull fetched, not committed yet
        with persist.Store(tmp_path / "a") as other:  # another process's handle
            other.save([kv_cache(51, 9)], mine, identity=IDENTITY, session="chat")
        return real(*a, **k)

    monkeypatch.setattr(pull_mod, "_commit", local_save_first)
    with both(tmp_path, "a", redis_server, s3_server) as a:
        got = a.sync(pull=["chat"])
        assert got["kept_here"] == ["chat"] and got["missing"] == [], got
        assert got["pulled"] == [], got
        assert restored(a) == mine  # the local turn is kept


def test_a_replayed_version_is_unreadable_not_missing(redis_server: Any, tmp_path: Path) -> None:
    r, p = redis_server.client(), RedisTier.prefix("default")
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
        old = r.get(f"{p}sess:chat")
        a.save([kv_cache(50, 2)], [*T, 7, 8], identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY) as c:
        assert restored(c) == [*T, 7, 8]  # c sees the newer version, then deletes its copy
        c.delete("chat")
    r.set(f"{p}sess:chat", old)  # an authentic old pointer, replayed
    with persist.Store(tmp_path / "c", shared=redis_server.url, tier_key=KEY) as c:
        got = c.sync(pull=["chat"])
        assert got["missing"] == [] and "replay" in got["unreadable"]["chat"], got
