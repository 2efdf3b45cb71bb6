"""``check --fix`` keeps what is still valid of a damaged session, and says what it cut.

Round 3: one flipped byte in one blob of an 1,861-token session removed the
whole session; the next ``persist generate --session`` on it silently started
a fresh 2-token session, and ``check --fix`` printed snapshot ids.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import persist
from persist.storage.check_damage import QUARANTINE_DAYS
from tests.helpers import assert_same_state, live_state, persist_cli, prefill, tokens_for
from tests.store_helpers import block_blob, flip


def test_a_trimmable_session_keeps_the_blocks_before_the_damage(
    tiny: Any, tmp_path: Path, caplog: Any
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(1861, seed=3)
    with persist.Store(tmp_path / "s", block_tokens=256) as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="long")
        flip(block_blob(store, "long", 3))
        found = store.check()
        cut = [p for p in found if p.kind == "session-cut"]
        assert len(cut) == 1 and "'long'" in cut[0].target and not cut[0].fixed
        assert "first 768 of 1861 tokens" in cut[0].detail and "block 3 of 7" in cut[0].detail
        fixed = store.check(fix=True)
        assert all(p.fixed for p in fixed) and store.check() == []
        with caplog.at_level(logging.WARNING, logger="persist"):
            r = store.restore("long", identity=ident)
        assert r.tokens == toks[:768] and r.notice is not None and "loses 1093" in r.notice
        assert sum("loses 1093" in m for m in caplog.messages) == 1
        assert_same_state(live_state(prefill(model, toks[:768])[0]), live_state(r.cache))
        assert store.restore("long", identity=ident).notice is None  # said once


def test_a_recurrent_session_goes_back_to_its_deepest_valid_checkpoint(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(400, seed=4)
    with persist.Store(tmp_path / "s") as store:
        for k in (100, 200):
            store.checkpoint(prefill(model, toks[:k])[0], toks[:k], identity=ident, session="r")
        store.save(prefill(model, toks)[0], toks, identity=ident, session="r")
        row = store.index.by_name("default", "r")
        assert row is not None and not row.trimmable
        flip(store.blobs.path(row.tail))
        fixed = store.check(fix=True)
        cut = [p for p in fixed if p.kind == "session-cut"]
        assert len(cut) == 1 and "checkpoint of 200 of 400 tokens" in cut[0].detail, fixed
        assert store.check() == []
        r = store.restore("r", identity=ident)
        assert r.tokens == toks[:200] and r.notice is not None
        assert_same_state(live_state(prefill(model, toks[:200])[0]), live_state(r.cache))


def test_check_fix_names_the_session_and_generate_says_so_once(tiny: Any, tmp_path: Path) -> None:
    model, tok, model_dir = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(700, seed=5)
    root = tmp_path / "s"
    with persist.Store(root) as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="chat")
        flip(block_blob(store, "chat", 1))
    out = persist_cli(root, "check", "--fix")
    assert "session 'chat'" in out.stdout and "keeps its first 256 of 700" in out.stdout, out
    gen = ["generate", "--model", str(model_dir), "--session", "chat", "--prompt", "hi"]
    first = persist_cli(root, *gen, "--max-tokens", "2")
    assert "keeps its first 256 of 700" in first.stderr, first.stderr
    second = persist_cli(root, *gen, "--max-tokens", "2")
    assert "check --fix" not in second.stderr, second.stderr


def test_gc_clears_quarantine_after_its_retention_time(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with persist.Store(root) as store:
        q = root / "quarantine"
        q.mkdir()
        old = int(time.time() - QUARANTINE_DAYS * 86400 - 60)
        (q / f"{old}-aa.safetensors").write_bytes(b"old")
        (q / f"{int(time.time())}-bb.safetensors").write_bytes(b"new")
        assert store.gc(dry_run=True).quarantine_cleared == 1
        assert len(os.listdir(q)) == 2
        assert store.gc().quarantine_cleared == 1
        assert [n.split("-", 1)[1] for n in os.listdir(q)] == ["bb.safetensors"]


def test_check_reports_progress_over_files_and_rows(tmp_path: Path) -> None:
    from mlx_lm.models import cache as mc

    from tests.golden.cases import IDENTITY, kvs

    with persist.Store(tmp_path / "s") as store:
        for i in range(3):
            c = mc.KVCache()
            c.update_and_fetch(*kvs(i, 300))
            store.save([c], list(range(300)), identity=IDENTITY, session=f"s{i}")
        seen: list[tuple[int, int]] = []
        assert store.check(progress=lambda d, t: seen.append((d, t))) == []
    total = seen[-1][1]
    assert [d for d, _ in seen] == list(range(1, total + 1)) and total == 6 + 3  # blobs, then rows


def statements_of_a_check(root: Path, n: int) -> int:
    from mlx_lm.models import cache as mc

    from tests.golden.cases import IDENTITY, kvs

    with persist.Store(root) as store:
        c = mc.KVCache()
        c.update_and_fetch(*kvs(1, 40))
        for i in range(n):
            store.save([c], list(range(i, i + 40)), identity=IDENTITY, session=f"s{i}")
        seen = [0]

        def count(_: str) -> None:
            seen[0] += 1

        store.index.db.conn.set_trace_callback(count)
        assert store.check() == []
        store.index.db.conn.set_trace_callback(None)
    return seen[0]


def test_check_is_linear_in_files_and_rows(tmp_path: Path) -> None:
    """Counted in SQL statements, not timed: twice the sessions, at most twice the work."""
    small = statements_of_a_check(tmp_path / "a", 20)
    large = statements_of_a_check(tmp_path / "b", 40)
    assert large <= 2 * small + 10, (small, large)
