"""A pull into a store whose disk is full is StoreFullError, as a save's is, and leaves
nothing behind (attack 38b, finding 6: a raw OSError ENOSPC, exit 3, for ``restore``
and ``generate --session``).  A tmpfs of the test's own (skipped where mounting is not
allowed), filled to the last byte but for too little room; real Redis and S3."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli
from tests.mounts import small_disk

KEY = bytes(range(32))
FLEET = list(range(1000, 4072))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", "3m") as mnt:
        yield mnt


def leave(mnt: Path, room: int) -> None:
    """Take every byte but ``room``, as another program on the disk would."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 1 << 12, 1 << 9):
            with contextlib.suppress(OSError):
                while True:
                    st = os.statvfs(mnt)
                    if st.f_bavail * st.f_frsize - size < room:
                        break
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)


def fleet(tmp: Path, redis: Any, s3: Any) -> None:
    with persist.Store(tmp / "a", tier_key=KEY, shared=redis.url, cold=s3.url) as a:
        a.save([kv_cache(3072, i) for i in range(8)], FLEET, identity=IDENTITY, session="chat")


@pytest.mark.parametrize("which", ["both", "cold", "shared"])
def test_a_pull_into_a_full_disk_is_store_full_and_leaves_nothing(
    disk: Path, redis_server: Any, s3_server: Any, tmp_path: Path, which: str
) -> None:
    fleet(tmp_path, redis_server, s3_server)
    root = disk / "b"
    persist.Store(root).close()
    leave(disk, 256 << 10)
    shared = redis_server.url if which in ("both", "shared") else None
    cold = s3_server.url if which in ("both", "cold") else None
    with persist.Store(root, tier_key=KEY, shared=shared, cold=cold) as b:
        with pytest.raises(persist.StoreFullError, match="full"):
            b.restore("chat", identity=IDENTITY)
        assert not b.has_session("chat")
    out = persist_cli(tmp_path, "check", "--store", str(root), check=False)
    assert out.returncode == 0 and "consistent" in out.stdout, (out.stdout, out.stderr)


def test_generate_session_into_a_full_disk_exits_1(
    tiny: Any, disk: Path, redis_server: Any, tmp_path: Path
) -> None:
    _, _, d = tiny("llama")
    env = {"PERSIST_TIER_KEY": KEY.hex()}
    run = ["generate", "--model", str(d), "--session", "chat", "-m", "2"]
    run += ["--shared", redis_server.url]
    persist_cli(tmp_path, *run, "--store", str(tmp_path / "a"), "--prompt", "hi " * 2500, env=env)
    root = disk / "b"
    persist.Store(root).close()
    leave(disk, 256 << 10)  # room for the index, not for the blobs
    out = persist_cli(tmp_path, *run, "--store", str(root), "--prompt", " and?", check=False,
                      env=env)  # fmt: skip
    assert out.returncode == 1 and "full" in out.stderr, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr


def test_a_lookup_whose_pull_finds_the_disk_full_answers_from_here(
    disk: Path, redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    fleet(tmp_path, redis_server, s3_server)
    root = disk / "b"
    persist.Store(root).close()
    leave(disk, 256 << 10)
    with persist.Store(root, tier_key=KEY, shared=redis_server.url) as b:
        assert b.lookup([*FLEET, 1], identity=IDENTITY, max_cost=1e9) is None
        assert b.stats().counters.get("shared_full_skipped") == 1, b.stats().counters
