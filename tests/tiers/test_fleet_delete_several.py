"""``persist rm --fleet A B C`` when one name cannot be deleted: the others still are,
each name is reported, and the command exits 1 naming the ones not deleted.

A fleet delete cannot be all-or-nothing (Redis and S3 share no transaction, and a
tombstone written on one tier is not taken back), so it goes name by name and says
what happened to each.  It used to stop at the first failure with that name's
error alone: the names deleted before it went unreported, the ones after it
untried.  Real redis-server, real ``persist`` processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli

KEY = bytes(range(32))


def rm_fleet(tmp: Path, redis: Any, *args: str) -> Any:
    """Sessions a and c saved on machine m and pushed; then ``rm --fleet`` there."""
    with persist.Store(tmp / "m", tier_key=KEY, shared=redis.url) as m:
        for i, name in enumerate(("a", "c")):
            toks = list(range(100 + i, 140 + i))
            m.save([kv_cache(40, i)], toks, identity=IDENTITY, session=name)
    env = {"PERSIST_SHARED": redis.url, "PERSIST_TIER_KEY": KEY.hex()}
    store = ["--store", str(tmp / "m")]
    return persist_cli(tmp, "rm", "--fleet", *args, *store, check=False, env=env)


def test_rm_fleet_goes_on_past_a_name_it_cannot_delete(redis_server: Any, tmp_path: Path) -> None:
    rm_fleet(tmp_path, redis_server, "a", "b", "c")  # b: in no store, on no tier
    fresh = persist.Store(tmp_path / "fresh", tier_key=KEY, shared=redis_server.url)
    with fresh, pytest.raises(persist.SessionNotFoundError):
        fresh.restore("c", identity=IDENTITY)


def test_rm_fleet_exits_1_naming_the_sessions_not_deleted(
    redis_server: Any, tmp_path: Path
) -> None:
    out = rm_fleet(tmp_path, redis_server, "a", "b", "c", "--json")
    got = json.loads(out.stdout)
    said = (out.returncode, got["deleted"], [f["session"] for f in got["not_deleted"]])
    assert said == (1, ["a", "c"], ["b"]), (out.stdout, out.stderr)


def test_rm_fleet_says_which_sessions_were_deleted_and_which_not(
    redis_server: Any, tmp_path: Path
) -> None:
    out = rm_fleet(tmp_path, redis_server, "a", "b", "c")
    lines = (out.stdout.strip(), out.stderr.strip().splitlines()[-1])
    assert lines == (
        "deleted 2 sessions: a, c (from the tiers too: a, c)",
        "persist: error: 1 of 3 sessions not deleted: b",
    ), (out.stdout, out.stderr)
