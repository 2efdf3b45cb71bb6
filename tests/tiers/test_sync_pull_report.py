"""``persist sync --pull NAME`` reports ``pulled`` only where it fetched the fleet's
session into this store.  Before, any local session of the name made it "pulled"
(attack 38e, finding F1): a stale copy (the fleet's newer turn was not fetched, and
the next turn forked), another history of the name, a copy of a fleet-deleted
session ("pulled" beside "deleted on the fleet"), and a copy held while the cold
tier was stalled (SIGSTOP: "pulled", nothing ``unreached``).  Real redis-server and
moto's S3 server, real ``persist`` processes for the CLI's words and exit codes."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli
from tests.tiers.two_tiers import KEY, both, restored

T = list(range(100, 148))


def _sync(tmp: Path, machine: str, redis: Any, s3: Any, *names: str) -> Any:
    pulls = [a for n in names for a in ("--pull", n)]
    return persist_cli(
        tmp / machine, "sync", "--store", str(tmp / machine), "--shared", redis.url,
        "--cold", s3.url, *pulls, "--json", check=False, env={"PERSIST_TIER_KEY": KEY.hex()},
    )  # fmt: skip


def test_a_stale_copy_is_replaced_by_the_fleets_newer_turn(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")  # v1
    with both(tmp_path, "b", redis_server, s3_server) as b:
        assert restored(b) == T
        b.save([kv_cache(50, 2)], [*T, 7, 8], identity=IDENTITY, session="chat")  # v2
    out = _sync(tmp_path, "a", redis_server, s3_server, "chat")
    with both(tmp_path, "a", redis_server, s3_server) as a:
        assert restored(a) == [*T, 7, 8]  # the fleet's turn, not the stale v1
    r = json.loads(out.stdout)
    assert out.returncode == 0 and r["pulled"] == ["chat"] and r["up_to_date"] == [], r
    with both(tmp_path, "a", redis_server, s3_server) as a:
        again = a.sync(pull=["chat"])
        assert again["pulled"] == [] and again["up_to_date"] == ["chat"], again
        a.save([kv_cache(51, 3)], [*T, 7, 8, 9], identity=IDENTITY, session="chat")
        assert a.sync()["conflicts"] == []  # the next turn continues the fleet's: no fork
    text = persist_cli(
        tmp_path / "a", "sync", "--store", str(tmp_path / "a"), "--shared", redis_server.url,
        "--cold", s3_server.url, "--pull", "chat", env={"PERSIST_TIER_KEY": KEY.hex()},
    )  # fmt: skip
    assert "pulled 0 sessions, up to date 1" in text.stdout, text.stdout


def test_another_history_of_the_name_is_kept_and_said_not_pulled(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    with both(tmp_path, "f", redis_server, s3_server) as f:
        f.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "a") as a:  # never on a tier: its own conversation
        a.save([kv_cache(20, 9)], list(range(20)), identity=IDENTITY, session="chat")
    out = _sync(tmp_path, "a", redis_server, s3_server, "chat")
    r = json.loads(out.stdout)
    assert r["pulled"] == [] and r["kept_here"] == ["chat"] and r["missing"] == [], r
    assert out.returncode == 1, out.stderr
    with persist.Store(tmp_path / "a") as a:
        assert restored(a) == list(range(20))  # this store's history, kept
    text = persist_cli(
        tmp_path / "a", "sync", "--store", str(tmp_path / "a"), "--shared", redis_server.url,
        "--cold", s3_server.url, "--pull", "chat", check=False,
        env={"PERSIST_TIER_KEY": KEY.hex()},
    )  # fmt: skip
    assert "pulled 0 sessions" in text.stdout, text.stdout
    assert "kept here, differs from the fleet's" in text.stdout, text.stdout
    assert "persist rm" in text.stdout, text.stdout  # what the user can do


def test_a_copy_of_a_fleet_deleted_session_is_reported_only_as_deleted(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
    with both(tmp_path, "b", redis_server, s3_server) as b:
        assert restored(b) == T
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.delete("chat", fleet=True)
    out = _sync(tmp_path, "b", redis_server, s3_server, "chat")
    r = json.loads(out.stdout)
    assert r["pulled"] == [] and r["up_to_date"] == [] and r["kept_here"] == [], r
    assert r["missing"] == [] and r["deleted_on_fleet"] == ["chat"], r


def test_a_local_copy_while_the_cold_tier_is_stalled_is_unreached(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    with both(tmp_path, "f", redis_server, s3_server) as f:
        f.save([kv_cache(48, 1)], T, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "a") as a:  # a local history, not pushed
        a.save([kv_cache(20, 9)], list(range(20)), identity=IDENTITY, session="chat")
    assert s3_server.proc is not None
    os.kill(s3_server.proc.pid, signal.SIGSTOP)
    try:
        out = _sync(tmp_path, "a", redis_server, s3_server, "chat")
    finally:
        os.kill(s3_server.proc.pid, signal.SIGCONT)
    r = json.loads(out.stdout)
    assert r["pulled"] == [] and r["unreached"] == ["chat"], r
    assert r["kept_here"] == [] and r["up_to_date"] == [], r
    assert out.returncode == 1, out.stderr
