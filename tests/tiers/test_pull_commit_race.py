"""A named pull reuses local blobs it chose before fetching the rest; a concurrent rm/gc
(another Store handle, as another process) may collect them before the pull commits.
The pull must check them inside its commit and fetch what died, never commit a row
naming dead blob files, and never report a session the tier holds as 'not found'
(attack 38, finding 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kv_cache

KEY = bytes(range(32))
T = list(range(100, 148))


def _setup(tmp: Path, url: str) -> Any:
    full = kv_cache(48, 1)
    with persist.Store(tmp / "a", tier_key=KEY, shared=url, block_tokens=16) as a:
        a.save([full], T, identity=IDENTITY, session="chat")
    k, v = full.state[0], full.state[1]
    part = mc.KVCache()
    part.update_and_fetch(k[:, :, :32], v[:, :, :32])
    with persist.Store(tmp / "b", tier_key=KEY, shared=url, block_tokens=16) as b:
        b.save([part], T[:32], identity=IDENTITY, session="S")  # shares chat's 2 blocks
    return full


def _race(tmp: Path, url: str, *, unlink_late: bool) -> tuple[int, list[int]]:
    """Pull 'chat' into b while a second handle rm's S (whose blobs the pull reuses)
    just before the fetch. ``unlink_late``: rm's collect lists the dead blobs then, and
    unlinks them only after the pull has committed (else the rm finishes entirely)."""
    b = persist.Store(tmp / "b", tier_key=KEY, shared=url, block_tokens=16)
    r = persist.Store(tmp / "b", block_tokens=16)
    listed: list[str] = []
    fetched: list[int] = []
    real_get, real_delete, real_forget = b.shared.tier.get_blobs, r.blobs.delete, r.index.forget
    if unlink_late:
        r.blobs.delete = listed.append  # type: ignore[method-assign]
        r.index.forget = lambda files: None  # type: ignore[method-assign]

    def get_blobs(*args: Any, **kwargs: Any) -> Any:
        fetched.append(len(args[1]))
        if len(fetched) == 1:  # between choosing the reused blobs and the commit
            r.delete("S")
        return real_get(*args, **kwargs)

    b.shared.tier.get_blobs = get_blobs
    try:
        got = b.restore("chat", identity=IDENTITY)
    finally:
        b.close()
    for f in listed:  # the rm's unlinks and row deletes, after the pull's commit
        real_delete(f)
    real_forget(listed)
    r.close()
    return len(got.tokens), fetched


def _restores_whole(tmp: Path, full: Any) -> None:
    with persist.Store(tmp / "b", block_tokens=16) as c:
        assert [e.session for e in c.sessions()] == ["chat"]
        got = c.restore("chat", identity=IDENTITY)
        assert got.tokens == T
        assert mx.array_equal(got.cache[0].state[0][..., :48, :], full.state[0][..., :48, :])


def test_a_pull_whose_reused_blobs_are_collected_before_its_commit_fetches_them(
    tmp_path: Path, redis_server: Any
) -> None:
    full = _setup(tmp_path, redis_server.url)
    n, fetched = _race(tmp_path, redis_server.url, unlink_late=True)
    assert n == 48
    assert fetched[0] < 4 and fetched[-1] > fetched[0]  # the dead ones fetched again
    _restores_whole(tmp_path, full)


def test_a_pull_that_loses_its_reused_blobs_to_a_finished_rm_is_not_a_miss(
    tmp_path: Path, redis_server: Any
) -> None:
    full = _setup(tmp_path, redis_server.url)
    n, fetched = _race(tmp_path, redis_server.url, unlink_late=False)
    assert n == 48  # not SessionNotFoundError: the tier holds it
    assert fetched[0] < 4 and fetched[-1] > fetched[0]
    _restores_whole(tmp_path, full)
