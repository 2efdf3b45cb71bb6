"""Two machines that extend one session differently and push at the same moment: one
takes the name, the other is kept beside it (``NAME~2``) and reported, never lost.

Found from outside (round 5's attack on the fleet): a push read the tier's session,
decided it continued it, then wrote the pointer (check, then put): a second
machine's push between the two was replaced without a word.  The interleaving is
made, not waited for: the first machine's write of its record and pointer runs
the second machine's whole sync first.  Real redis-server, a real Redis Cluster,
moto's S3 server; real stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache

BASE = list(range(100, 148))  # the fleet's session, 48 tokens
MINE, THEIRS = BASE + list(range(200, 210)), BASE + list(range(300, 310))


def stores(tmp: Path, where: dict[str, str]) -> None:
    """Machine a saves ``chat``, machine b pulls it; then each extends it otherwise,
    with no tier (a train, a stalled network): both continue the fleet's version."""
    with persist.Store(tmp / "a", **where) as a:
        a.save([kv_cache(48, 1)], BASE, identity=IDENTITY, session="chat")
    with persist.Store(tmp / "b", **where) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == BASE
    with persist.Store(tmp / "a") as a, persist.Store(tmp / "b") as b:
        a.save([kv_cache(58, 2)], MINE, identity=IDENTITY, session="chat")
        b.save([kv_cache(58, 3)], THEIRS, identity=IDENTITY, session="chat")


def synced_at_once(tmp: Path, where: dict[str, str], monkeypatch: Any) -> dict[str, Any]:
    """a's sync, with b's whole sync run between a's reading of the tier's ``chat`` and
    its write of the pointer (the window a check-then-put leaves open)."""
    reports: dict[str, Any] = {}
    with persist.Store(tmp / "a", **where) as a, persist.Store(tmp / "b", **where) as b:
        tier = a.tiers[0].tier
        write = tier.put_record

        def between(*args: Any, **kwargs: Any) -> Any:
            if "b" not in reports:
                reports["b"] = b.sync()
            return write(*args, **kwargs)

        monkeypatch.setattr(tier, "put_record", between)
        reports["a"] = a.sync()
    return reports


def check_both_kept(tmp: Path, where: dict[str, str], reports: dict[str, Any]) -> None:
    assert reports["b"]["conflicts"] == [], reports["b"]  # b's push went first: the name
    got = [(c["session"], c["kept_as"]) for c in reports["a"]["conflicts"]]
    assert got == [("chat", "chat~2")], reports["a"]  # a's: beside it, reported (exit 1)
    with persist.Store(tmp / "c", **where) as c:  # a new machine finds both histories
        assert c.restore("chat", identity=IDENTITY).tokens == THEIRS
        assert c.restore("chat~2", identity=IDENTITY).tokens == MINE


@pytest.mark.parametrize("tier", ["redis_server", "s3_server"])
def test_two_syncs_at_once_keep_both_histories(
    tier: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = request.getfixturevalue(tier)
    where = {"shared" if tier == "redis_server" else "cold": server.url}
    stores(tmp_path, where)
    check_both_kept(tmp_path, where, synced_at_once(tmp_path, where, monkeypatch))


@pytest.mark.long  # a three-node cluster: the quick test above checks one server
def test_two_syncs_at_once_on_a_redis_cluster_keep_both_histories(
    redis_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = {"shared": redis_cluster.url}
    stores(tmp_path, where)
    check_both_kept(tmp_path, where, synced_at_once(tmp_path, where, monkeypatch))
