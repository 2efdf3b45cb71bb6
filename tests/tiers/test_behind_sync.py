"""``persist sync`` on a machine that is merely behind pushes nothing: its copy of a
session is a version the fleet had (pulled or pushed here, nothing saved on top), and
the tier's session continues it, or a fleet delete removed it.  Before, the copy was
pushed beside the fleet's as ``chat~2`` with a conflict (sync exit 1, every run), and a
fleet-deleted session came back as ``chat~2`` (attack 38, findings 2 and 3).  A real
continuation of an old version is still kept beside as ``chat~2``.  Real redis-server
and moto's S3 server."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache

KEY = bytes(range(32))
T = list(range(100, 148))


def _where(cold: bool, redis: Any, request: pytest.FixtureRequest) -> dict[str, Any]:
    s3 = request.getfixturevalue("s3_server") if cold else None
    return {"tier_key": KEY, "shared": redis.url, **({"cold": s3.url} if s3 else {})}


def _names(tmp: Path, where: dict[str, Any]) -> dict[str, int]:
    got = {}
    with persist.Store(tmp / "fresh", **where) as f:
        for n in ("chat", "chat~2"):
            with contextlib.suppress(persist.SessionNotFoundError):
                got[n] = len(f.restore(n, identity=IDENTITY).tokens)
    return got


@pytest.mark.parametrize("cold", [False, True], ids=["redis", "redis+s3"])
def test_a_machine_that_is_merely_behind_pushes_nothing_and_reports_no_conflict(
    cold: bool, redis_server: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    where = _where(cold, redis_server, request)
    with persist.Store(tmp_path / "a", **where) as a:
        a.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", **where) as b:
        assert len(b.restore("chat", identity=IDENTITY).tokens) == 48  # version N
    with persist.Store(tmp_path / "a", **where) as a:
        a.save([kv_cache(50, 2)], [*T, 7, 8], identity=IDENTITY, session="chat")  # N+1
    with persist.Store(tmp_path / "b", **where) as b:
        for _ in range(2):
            r = b.sync()
            assert r["conflicts"] == [] and r["pushed"] == 0 and r["failed"] == 0, r
    assert _names(tmp_path, where) == {"chat": 50}


@pytest.mark.parametrize("cold", [False, True], ids=["redis", "redis+s3"])
def test_a_copy_of_a_fleet_deleted_session_is_not_pushed_back(
    cold: bool, redis_server: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    where = _where(cold, redis_server, request)
    with persist.Store(tmp_path / "a", **where) as a:
        a.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", **where) as b:
        assert len(b.restore("chat", identity=IDENTITY).tokens) == 48
    with persist.Store(tmp_path / "a", **where) as a:
        a.delete("chat", fleet=True)
    with persist.Store(tmp_path / "b", **where) as b:
        for _ in range(2):
            r = b.sync()
            assert r["conflicts"] == [] and r["pushed"] == 0 and r["failed"] == 0, r
            assert r["deleted_on_fleet"] == ["chat"], r
    assert _names(tmp_path, where) == {}


def test_a_continuation_of_an_old_version_is_still_kept_beside(
    redis_server: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    where = _where(True, redis_server, request)
    with persist.Store(tmp_path / "a", **where) as a:
        a.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", **where) as b:
        assert len(b.restore("chat", identity=IDENTITY).tokens) == 48
    with persist.Store(tmp_path / "b") as b:  # a turn saved on top, not pushed yet
        b.save([kv_cache(50, 3)], [*T, 5, 6], identity=IDENTITY, session="chat")  # b's turn
    with persist.Store(tmp_path / "a", **where) as a:
        a.save([kv_cache(50, 2)], [*T, 7, 8], identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", **where) as b:
        r = b.sync()
    assert {(c["session"], c["kept_as"]) for c in r["conflicts"]} == {("chat", "chat~2")}, r
    assert _names(tmp_path, where) == {"chat": 50, "chat~2": 50}
