"""A session the fleet names but this machine cannot read is an error, never "no session".

Found from outside (attack 38b, findings 5 and 8): a machine with another operator
key (or none) was told "no session" for the fleet's sessions, and its
``generate --session`` started a new conversation and replaced the fleet's
pointers; on a Redis-only fleet one evicted blob or one expired record did the
same.  Now the tier that names the session but cannot be read is
SessionUnreadableError (a SessionUnreachableError: ``--new`` is the way past it),
naming the tier and, for a key, the key.  Real redis-server, moto's S3 server,
real stores, real ``persist`` processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli

K1, K2 = bytes(range(32)), bytes(range(1, 33))
FLEET = list(range(100, 148))


def saved_on_a(tmp: Path, redis: Any, s3: Any | None) -> None:
    cold = {"cold": s3.url} if s3 is not None else {}
    with persist.Store(tmp / "a", tier_key=K1, shared=redis.url, **cold) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")


@pytest.mark.parametrize("key", [K2, None], ids=["wrong-key", "keyless"])
def test_a_machine_with_another_key_is_told_so_not_no_session(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: Any
) -> None:
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    saved_on_a(tmp_path, redis_server, s3_server)
    b = persist.Store(tmp_path / "b", tier_key=key, shared=redis_server.url, cold=s3_server.url)
    with b, pytest.raises(persist.SessionUnreadableError) as got:
        b.restore("chat", identity=IDENTITY)
    text = str(got.value)
    assert "shared tier" in text and "cold tier" in text, text
    assert ("key id" in text) if key else ("no operator key" in text), text
    with persist.Store(tmp_path / "c", tier_key=K1, shared=redis_server.url) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == FLEET  # the fleet's, untouched


def test_generate_with_the_wrong_key_exits_1_and_pushes_nothing(
    tiny: Any, redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    _, _, d = tiny("llama")
    env = {"PERSIST_TIER_KEY": K1.hex()}
    tiers = ["--shared", redis_server.url, "--cold", s3_server.url]
    first = ["generate", "--model", str(d), "--session", "chat", "-m", "2", *tiers]
    persist_cli(tmp_path, *first, "--store", str(tmp_path / "a"), "--prompt", "hi " * 40, env=env)
    before = {k: redis_server.client().get(k) for k in redis_server.client().scan_iter()}
    out = persist_cli(
        tmp_path, *first, "--store", str(tmp_path / "b"), "--prompt", " and?", check=False,
        env={"PERSIST_TIER_KEY": K2.hex()},
    )  # fmt: skip
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "cannot read it" in out.stderr and "--new" in out.stderr, out.stderr
    after = {k: redis_server.client().get(k) for k in redis_server.client().scan_iter()}
    assert after == before  # nothing pushed over the fleet's session


def _drop(redis: Any, pattern: str) -> None:
    keys = list(redis.client().scan_iter(match=pattern))
    assert keys, pattern
    redis.client().delete(keys[0])


@pytest.mark.parametrize("what", ["*blob:*", "*rec:*"], ids=["evicted-blob", "expired-record"])
def test_a_redis_only_fleet_missing_part_of_a_session_is_an_error(
    redis_server: Any, tmp_path: Path, what: str
) -> None:
    saved_on_a(tmp_path, redis_server, None)
    _drop(redis_server, what)
    b = persist.Store(tmp_path / "b", tier_key=K1, shared=redis_server.url)
    with b, pytest.raises(persist.SessionUnreadableError, match="shared tier"):
        b.restore("chat", identity=IDENTITY)


def test_generate_on_a_redis_only_fleet_with_an_evicted_blob_starts_nothing(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    _, _, d = tiny("llama")
    env = {"PERSIST_TIER_KEY": K1.hex()}
    first = ["generate", "--model", str(d), "--session", "chat", "-m", "2"]
    first += ["--shared", redis_server.url]
    persist_cli(tmp_path, *first, "--store", str(tmp_path / "a"), "--prompt", "hi " * 40, env=env)
    _drop(redis_server, "*blob:*")
    b = ["--store", str(tmp_path / "b"), "--prompt", " and?"]
    out = persist_cli(tmp_path, *first, *b, check=False, env=env)
    assert out.returncode == 1 and "shared tier" in out.stderr, (out.stdout, out.stderr)
    assert "~2" not in out.stderr + out.stdout
    new = persist_cli(tmp_path, *first, *b, "--new", check=False, env=env)
    assert new.returncode == 0, (new.stdout, new.stderr)  # --new is the way past it


@pytest.mark.parametrize("key", [K2.hex(), None], ids=["wrong-key", "keyless"])
def test_sync_pull_of_an_unreadable_session_exits_1_and_says_why(
    redis_server: Any, s3_server: Any, tmp_path: Path, key: Any
) -> None:
    """Attack 38c, finding 3: ``sync --pull chat`` said "not in any tier: chat", exit 0,
    where restore, export and generate say SessionUnreadableError."""
    saved_on_a(tmp_path, redis_server, s3_server)
    tiers = ["--shared", redis_server.url, "--cold", s3_server.url]
    env = {"PERSIST_TIER_KEY": key} if key else {"PERSIST_TIER_KEY": ""}
    args = ["sync", "--pull", "chat", "--store", str(tmp_path / "b"), *tiers]
    out = persist_cli(tmp_path, *args, check=False, env=env)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "not in any tier" not in out.stdout, out.stdout
    assert "cannot be read" in out.stdout and "unreadable" in out.stderr, (out.stdout, out.stderr)
