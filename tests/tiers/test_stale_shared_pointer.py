"""A named session is the cold tier's latest version, also when Redis's pointer is behind.

A push writes the cold tier first, then Redis.  A pusher killed between the two
(or a Redis that lost a write: a failover, a restore from an older RDB) left
Redis naming version N while S3 named N+1; a named pull asked Redis first and
resumed N on another machine: a fork of the fleet's history (issue 38).  Now a
named pull reads the cold tier's pointer first and takes Redis's bytes only
where its pointer is the same; else it pulls from the cold tier and repairs
Redis's pointer by a compare-and-set over the stale value it read.  Real
redis-server, moto's S3 server, real stores, and a real process killed with
SIGKILL between the tiers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from persist.remote.s3_tier import S3Tier
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import ROOT, persist_cli, pythonpath
from tests.tiers.conftest import s3_down

KEY = bytes(range(32))
FLEET = list(range(100, 148))  # version N
LATER = [*FLEET, 7, 8]  # version N+1, a turn on
LATEST = [*LATER, 9]  # version N+2
MARKER_WAIT_S = 120.0


def both(tmp: Path, name: str, redis: Any, s3: Any, key: bytes | None = KEY) -> persist.Store:
    return persist.Store(tmp / name, tier_key=key, shared=redis.url, cold=s3.url)


def pointers(redis: Any, s3: Any) -> tuple[bytes | None, bytes | None]:
    """(Redis's, the cold tier's) ``chat`` pointer, read as the tiers hold them."""
    item = [("sess", b"chat")]
    return RedisTier(redis.url).pointers("default", item)[0], S3Tier(s3.url).pointers(
        "default", item
    )[0]


def rolled_back(tmp: Path, redis: Any, s3: Any, key: bytes | None = KEY) -> bytes:
    """``chat`` saved at N then N+1 on machine a (both tiers move), then Redis's pointer
    set back to N by hand (a restore from an older RDB): N's pointer value."""
    with both(tmp, "a", redis, s3, key) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
        old = pointers(redis, s3)[0]
        a.save([kv_cache(50, 2)], LATER, identity=IDENTITY, session="chat")
    assert old is not None
    redis.client().set(f"{RedisTier.prefix('default')}sess:chat", old)
    shared, cold = pointers(redis, s3)
    assert shared == old and cold != old
    return old


def test_a_pusher_killed_between_the_tiers_leaves_no_old_version_to_resume(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")
    old = pointers(redis_server, s3_server)[0]
    marker, job = tmp_path / "between", tmp_path / "job.json"
    job.write_text(json.dumps({
        "store": str(tmp_path / "a"), "shared": redis_server.url, "cold": s3_server.url,
        "key": KEY.hex(), "marker": str(marker), "tokens": LATER,
    }))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    cmd = [sys.executable, "-m", "tests.tiers.push_and_die", str(job)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + MARKER_WAIT_S
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the pusher did not reach the tiers' gap (rc {proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    shared, cold = pointers(redis_server, s3_server)
    assert shared == old and cold != old  # the gap the death left: Redis names N

    with both(tmp_path, "b", redis_server, s3_server) as b:
        got = b.restore("chat", identity=IDENTITY)
        assert got.tokens == LATER  # N+1, the cold tier's, and its turn
        counters = b.stats().counters
    assert counters.get("shared_repaired") == 1, counters
    shared, cold = pointers(redis_server, s3_server)
    assert shared == cold  # Redis repaired: the next machine reads N+1 there too
    r = persist.Store(tmp_path / "c", tier_key=KEY, shared=redis_server.url)
    with r as c:
        assert c.restore("chat", identity=IDENTITY).tokens == LATER


@pytest.mark.parametrize("key", [KEY, None], ids=["keyed", "keyless"])
def test_a_rolled_back_redis_pointer_is_read_past_and_repaired(
    key: bytes | None, redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    rolled_back(tmp_path, redis_server, s3_server, key)
    with both(tmp_path, "b", redis_server, s3_server, key) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == LATER
        counters = b.stats().counters
    assert counters.get("shared_repaired") == 1, counters
    assert counters.get("cold_hits") == 1, counters  # the bytes came from the cold tier
    shared, cold = pointers(redis_server, s3_server)
    assert shared == cold


def test_a_fleet_delete_the_cold_tier_holds_is_put_over_a_stale_redis_pointer(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """``rm --fleet`` put tombstones on both tiers, then Redis's pointer went back to the
    deleted version (an older RDB): the cold tier's tombstone is followed (nothing to
    restore) and put over Redis's stale pointer."""
    old = rolled_back(tmp_path, redis_server, s3_server)
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.delete("chat", fleet=True)
    redis_server.client().set(f"{RedisTier.prefix('default')}sess:chat", old)
    with both(tmp_path, "b", redis_server, s3_server) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("chat", identity=IDENTITY)
        counters = b.stats().counters
    assert counters.get("shared_repaired") == 1, counters
    shared, cold = pointers(redis_server, s3_server)
    assert shared == cold and cold is not None and cold.startswith(b"~")


def test_a_repair_that_races_a_newer_push_is_declined(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machine b reads Redis's stale N and pulls N+1 from the cold tier; before its repair
    writes Redis's pointer, machine a pushes N+2 to both tiers.  The repair's
    compare-and-set finds N+2, not the N it read, and is declined: N+2 stays."""
    rolled_back(tmp_path, redis_server, s3_server)
    with both(tmp_path, "b", redis_server, s3_server) as b:
        assert b.shared is not None
        tier, raced = b.shared.tier, []
        write = tier.put_record

        def newer_push_first(*args: Any, **kwargs: Any) -> Any:
            if not raced:
                raced.append(True)
                with both(tmp_path, "a", redis_server, s3_server) as a:
                    a.save([kv_cache(51, 3)], LATEST, identity=IDENTITY, session="chat")
            return write(*args, **kwargs)

        monkeypatch.setattr(tier, "put_record", newer_push_first)
        assert b.restore("chat", identity=IDENTITY).tokens == LATER  # the latest when read
        counters = b.stats().counters
    assert raced, "the repair never wrote"
    assert counters.get("shared_repair_declined") == 1, counters
    assert "shared_repaired" not in counters, counters
    shared, cold = pointers(redis_server, s3_server)
    assert shared == cold  # N+2 on both: nothing lost
    with persist.Store(tmp_path / "c", tier_key=KEY, shared=redis_server.url) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == LATEST


def test_with_the_cold_tier_down_redis_serves_and_says_it_may_be_behind(
    redis_server: Any,
    s3_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = rolled_back(tmp_path, redis_server, s3_server)
    warned = caplog.at_level(logging.WARNING, logger="persist")
    with warned, s3_down(monkeypatch), both(tmp_path, "b", redis_server, s3_server) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == FLEET  # Redis's: all there is
        b.delete("chat")
        assert b.restore("chat", identity=IDENTITY).tokens == FLEET  # again: not said again
        counters = b.stats().counters
    assert counters.get("shared_cold_unasked") == 2, counters
    said = [
        r.getMessage() for r in caplog.records if "may be behind the cold tier" in r.getMessage()
    ]
    assert len(said) == 1, caplog.text  # said once
    assert "'chat'" in said[0], said
    assert pointers(redis_server, s3_server)[0] == old  # nothing repaired without the cold tier

    with s3_down(monkeypatch):  # the CLI shows it
        env = {"PERSIST_SHARED": redis_server.url, "PERSIST_COLD": s3_server.url,
               "PERSIST_TIER_KEY": KEY.hex()}  # fmt: skip
        store = str(tmp_path / "d")
        out = persist_cli(tmp_path / "d", "sync", "--pull", "chat", "--store", store,
                          check=False, env=env)  # fmt: skip
    assert "may be behind the cold tier" in out.stderr, (out.stdout, out.stderr)
    assert "pulled 1 sessions" in out.stdout, out.stdout
