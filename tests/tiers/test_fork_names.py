"""Attack 38d, finding E, through a fleet: a push that does not continue the tier's
session of the longest name (1024 characters) is kept as ``NAME~2``; no command took
that name (``sync --pull``, ``show``, ``rm --fleet``).  Now a fork suffix may take a
session name past the limit, and a fork of such a name goes beside it (``NAME~3``),
never ``NAME~2~2``.  Real redis-server, real stores, real ``persist`` processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli

KEY = bytes(range(32))
LONGEST = "L" * 1024  # persist.storage.rows.MAX_NAME
FIRST, SECOND, THIRD = list(range(100, 140)), list(range(900, 940)), list(range(500, 540))


def kept_beside(root: Path, url: str, name: str, tokens: list[int]) -> list[dict[str, Any]]:
    """A new history under ``name`` where the tier holds another: the sync's conflicts."""
    with persist.Store(root, tier_key=KEY, shared=url) as s:
        if s.has_session(name):
            s.delete(name)  # here only: the tier keeps its history of the name
        s.save([kv_cache(len(tokens), 3)], tokens, identity=IDENTITY, session=name)
        return list(s.sync()["conflicts"])


def test_a_fork_of_the_longest_name_on_the_fleet_is_taken_by_every_command(
    redis_server: Any, tmp_path: Path
) -> None:
    with persist.Store(tmp_path / "a", tier_key=KEY, shared=redis_server.url) as a:
        a.save([kv_cache(40, 1)], FIRST, identity=IDENTITY, session=LONGEST)
    fork = f"{LONGEST}~2"
    got = kept_beside(tmp_path / "a", redis_server.url, LONGEST, SECOND)
    assert got == [{"tier": "shared", "session": LONGEST, "kept_as": fork}]
    env = {"PERSIST_SHARED": redis_server.url, "PERSIST_TIER_KEY": KEY.hex()}
    at = ("--store", str(tmp_path / "c"))
    out = persist_cli(tmp_path, "sync", "--pull", fork, *at, "--json", env=env)
    assert json.loads(out.stdout)["pulled"] == [fork]
    shown = json.loads(persist_cli(tmp_path, "show", fork, *at, "--json", env=env).stdout)
    assert shown["session"] == fork and shown["tokens"] == len(SECOND)
    # a fork of the fork: beside it, a name every command takes
    got = kept_beside(tmp_path / "c", redis_server.url, fork, THIRD)
    assert got == [{"tier": "shared", "session": fork, "kept_as": f"{LONGEST}~3"}]
    out = persist_cli(tmp_path, "rm", "--fleet", fork, f"{LONGEST}~3", *at, "--json", env=env)
    assert json.loads(out.stdout)["fleet"] == [fork, f"{LONGEST}~3"]
    with persist.Store(tmp_path / "d", tier_key=KEY, shared=redis_server.url) as d:
        assert d.restore(LONGEST, identity=IDENTITY).tokens == FIRST
        assert not d.sync(pull=[fork, f"{LONGEST}~3"])["pulled"]
