"""Attack 38b, finding 4, through the tiers: ``persist rm --fleet 'notes[1]'`` deleted
``notes1`` on every tier (the name was taken as a glob pattern).  A name is a name:
the tiers' session of exactly that name goes, ``notes1`` stays on the fleet.  Real
redis-server, real ``persist`` processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY
from tests.helpers import persist_cli
from tests.store_helpers import saved_sessions, sessions_left


def test_rm_fleet_deletes_the_name_given_on_the_tiers(redis_server: Any, tmp_path: Path) -> None:
    key = bytes(range(32))
    saved_sessions(tmp_path / "a", "notes[1]", "notes1", tier_key=key, shared=redis_server.url)
    saved_sessions(tmp_path / "b")  # a store holding no session
    env = {"PERSIST_SHARED": redis_server.url, "PERSIST_TIER_KEY": key.hex()}
    for machine in ("b", "a"):  # b holds nothing: the name goes to the tiers as given
        out = persist_cli(
            tmp_path, "rm", "--fleet", "notes[1]", "--store", str(tmp_path / machine),
            "--json", check=False, env=env,
        )  # fmt: skip
        got = json.loads(out.stdout or "{}")
        assert got.get("deleted") == ["notes[1]"] and got["fleet"] in ([], ["notes[1]"]), out
    with persist.Store(tmp_path / "c", tier_key=key, shared=redis_server.url) as c:
        assert len(c.restore("notes1", identity=IDENTITY).tokens) == 16
    assert sessions_left(tmp_path / "a") == ["notes1"]


def test_a_fleet_delete_run_again_says_already_deleted(redis_server: Any, tmp_path: Path) -> None:
    """Attack 38d, finding F: a re-run of ``rm --fleet`` (after a partial failure) over
    names already deleted fleet-wide (a tombstone on the tier, nothing here) exited 1,
    "no session".  It is idempotent: "already deleted", exit 0; a name with no session
    anywhere and no tombstone is still "no session", exit 1."""
    key = bytes(range(32))
    saved_sessions(tmp_path / "a", "chat", "notes", tier_key=key, shared=redis_server.url)
    saved_sessions(tmp_path / "b")  # a store holding no session
    env = {"PERSIST_SHARED": redis_server.url, "PERSIST_TIER_KEY": key.hex()}

    def rm(machine: str, *names: str) -> Any:
        at = ("--store", str(tmp_path / machine))
        return persist_cli(tmp_path, "rm", "--fleet", *names, *at, check=False, env=env)

    first = rm("a", "chat", "notes")
    assert first.returncode == 0, first.stderr
    for machine in ("a", "b"):  # the one that deleted, and one that never held them
        again = rm(machine, "chat", "notes")
        assert again.returncode == 0, again.stderr
        assert "already deleted" in again.stdout and "chat" in again.stdout, again
        got = json.loads(rm(machine, "chat", "--json").stdout)
        assert got["already_deleted"] == ["chat"] and got["deleted"] == [], got
    mixed = rm("b", "chat", "never")
    assert mixed.returncode == 1 and "no session 'never'" in mixed.stderr, mixed
    assert "already deleted" in mixed.stdout and "chat" not in mixed.stderr, mixed
    c = persist.Store(tmp_path / "c", tier_key=key, shared=redis_server.url)
    with c, pytest.raises(persist.SessionNotFoundError):
        c.restore("chat", identity=IDENTITY)
