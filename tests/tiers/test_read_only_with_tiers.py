"""A read-only store with tiers (attack 38, finding 4): a restore of a session only the
fleet holds is the read-only one-liner, a lookup answers from what is here; neither
tries to pull (a pull writes a lease, rows and blobs: EROFS, exit 3, before).  A real
read-only bind mount, a real Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import prefill, tokens_for
from tests.mounts import read_only_mount


def test_a_read_only_store_never_pulls(tiny: Any, redis_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(60, seed=8)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="chat")
    mine = tokens_for(200, seed=9)
    root = tmp_path / "b"
    with persist.Store(root, shared=redis_server.url) as b:  # its own, then read-only
        b.save(prefill(model, mine)[0], mine, identity=ident, session="mine")
    with read_only_mount(root), persist.Store(root, shared=redis_server.url) as b:
        assert b.read_only
        with pytest.raises(persist.ReadOnlyStoreError, match="is read-only"):
            b.restore("chat", identity=ident)
        with pytest.raises(persist.ReadOnlyStoreError, match="is read-only"):
            b.export("chat", tmp_path / "chat.safetensors")  # not "no session" (attack r13c)
        assert not (tmp_path / "chat.safetensors").exists()
        assert b.lookup(toks + [1], identity=ident) is None  # the fleet's: not pulled
        hit = b.lookup(mine + [1], identity=ident)
        assert hit is not None and hit.tokens == mine
