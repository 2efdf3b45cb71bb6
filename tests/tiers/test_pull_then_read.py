"""What a pull brings is read: ``export`` pulls as ``restore`` does, and a restore whose
pulled session is evicted before it is read pulls it again (attack 38b, findings 7, 15).

``persist export NAME --shared/--cold`` said "no session" while the fleet held it;
and a ``gc`` in another process that evicted a session between a restore's pull and
its read made the restore say "no session" (then ``generate --session`` started a
new conversation).  Real redis-server, moto's S3 server, real ``persist`` processes;
the eviction is a real ``persist gc --max-bytes 0`` run at the moment between the two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.engine import reading
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli
from tests.mounts import read_only_mount

KEY = bytes(range(32))
FLEET = list(range(100, 148))


def saved_on_a(tmp: Path, redis: Any, s3: Any) -> None:
    with persist.Store(tmp / "a", tier_key=KEY, shared=redis.url, cold=s3.url) as a:
        a.save([kv_cache(48, 1)], FLEET, identity=IDENTITY, session="chat")


@pytest.mark.parametrize("which", ["both", "cold", "shared"])
def test_export_pulls_a_session_only_the_fleet_holds(
    redis_server: Any, s3_server: Any, tmp_path: Path, which: str
) -> None:
    saved_on_a(tmp_path, redis_server, s3_server)
    persist.Store(tmp_path / "b").close()
    tiers = ["--shared", redis_server.url] if which in ("both", "shared") else []
    tiers += ["--cold", s3_server.url] if which in ("both", "cold") else []
    out = persist_cli(
        tmp_path, "export", "chat", str(tmp_path / "chat.persist"), "--store",
        str(tmp_path / "b"), *tiers, check=False, env={"PERSIST_TIER_KEY": KEY.hex()},
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout, out.stderr)
    with persist.Store(tmp_path / "c") as c:
        c.import_file(tmp_path / "chat.persist", session="chat")
        assert c.restore("chat", identity=IDENTITY).tokens == FLEET


def test_export_from_a_read_only_store_never_pulls(
    redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    saved_on_a(tmp_path, redis_server, s3_server)
    root = tmp_path / "b"
    persist.Store(root).close()
    with read_only_mount(root):
        b = persist.Store(root, tier_key=KEY, shared=redis_server.url, cold=s3_server.url)
        with b, pytest.raises(persist.PersistError):
            b.export("chat", tmp_path / "chat.persist")
    with persist.Store(root) as b:
        assert not b.has_session("chat")


def test_a_restore_whose_pulled_session_is_evicted_before_the_read_pulls_it_again(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_on_a(tmp_path, redis_server, s3_server)
    root = tmp_path / "b"
    real, evicted = reading.restore_named, []

    def evict_first(*args: Any, **kw: Any) -> Any:
        if not evicted:  # another process's gc, between the pull's commit and the read
            evicted.append(1)
            persist_cli(tmp_path, "gc", "--max-bytes", "0", "--store", str(root))
        return real(*args, **kw)

    monkeypatch.setattr(reading, "restore_named", evict_first)
    with persist.Store(root, tier_key=KEY, shared=redis_server.url, cold=s3_server.url) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == FLEET
    assert evicted
