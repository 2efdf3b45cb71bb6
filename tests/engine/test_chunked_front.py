"""Issue 36 repros 1 and 2: a chunked-attention session whose front mlx-lm dropped.

A llama4 model (``attention_chunk_size`` 32) fed 60 tokens in one call, then
20 single decode steps: ``ChunkedKVCache.maybe_trim_front`` keeps only the
last 32 positions of each chunked layer (``start_position`` 47), saved at 80.
A position in [47, 64) attends to its whole chunk [32, 64), whose positions
32..46 are gone: no cut there continues like a fresh prefill.  Every hit, on
every path, must continue exactly as a fresh prefill of its own tokens fed the
same chunks (60, then one at a time), logits and state after every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import make_prompt_cache

import persist
from persist.apps.decoding import Run
from persist.apps.generate import generate
from persist.errors import SessionNotFoundError
from tests.engine.chunked_session import (
    GIB,
    SAVED,
    check_hit,
    continues_alike,
    feed,
    prompt_sharing,
    session,
)
from tests.helpers import assert_same_state, live_state
from tests.store_helpers import block_blob, flip

SHARED = [1, 16, 31, 32, 33, *range(40, SAVED + 1)]


@pytest.mark.long
@pytest.mark.parametrize("path", ["index", "host"])
def test_every_hit_of_a_front_dropped_chunked_session_is_a_fresh_prefill(
    tiny: Any, tmp_path: Path, path: str
) -> None:
    model, _, ident, toks, cache = session(tiny)
    root = tmp_path / "s"
    with persist.Store(root) as store:
        store.save(cache, toks, identity=ident)
    host = GIB if path == "host" else None
    with persist.Store(root, host_cache=host) as store:
        if host:  # the host tier holds what this process saved
            store.save(feed(model, toks), toks, identity=ident)
        hits = 0
        for h in SHARED:
            hit = store.lookup(prompt_sharing(toks, h), identity=ident)
            if hit is not None:
                assert hit.source == ("host" if host else "local"), hit.source
                hits += 1
            check_hit(model, hit, toks, h)
        assert hits > 0  # the saved length itself always serves


@pytest.mark.parametrize("h", [48, 56, 63])
def test_a_cut_into_a_dropped_chunk_is_never_served(tiny: Any, tmp_path: Path, h: int) -> None:
    model, _, ident, toks, cache = session(tiny)
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident)
    for host in (None, GIB):
        with persist.Store(tmp_path / "s", host_cache=host) as store:
            if host:
                store.save(feed(model, toks), toks, identity=ident)
            check_hit(model, store.lookup(prompt_sharing(toks, h), identity=ident), toks, h)


@pytest.mark.parametrize("h", [56, 79])
def test_persist_generate_resumes_a_front_dropped_prefix_exactly(
    tiny: Any, tmp_path: Path, h: int
) -> None:
    model, tok, ident, toks, cache = session(tiny)
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident)
        text = "".join(map(chr, toks[:h])) + "#!"
        r = generate(model, tok, ident, store, session="b", prompt=text, max_tokens=4)
        new = [*toks[:h], ord("#"), ord("!")]
        want = feed(model, toks[: r.reused_tokens]) if r.reused_tokens else make_prompt_cache(model)
        run = Run(
            model,
            tok,
            identity=ident,
            sampling=persist.apps.generate.Sampling(),
            prefill_step_size=2048,
        )
        out, _, _ = run(new[r.reused_tokens :], want, max_tokens=4, bar=None, on_text=None, t0=0.0)
        assert r.generated_tokens == len(out)
        got = store.restore("b", identity=ident)
        assert got.tokens == new + out
        assert_same_state(live_state(got.cache), live_state(want))


def test_check_fix_never_cuts_a_chunked_session_where_its_chunks_cannot_serve(
    tiny: Any, tmp_path: Path
) -> None:
    model, _, ident, toks, cache = session(tiny)
    with persist.Store(tmp_path / "s", block_tokens=16) as store:
        store.save(cache, toks, identity=ident, session="c")
        flip(block_blob(store, "c", 3))  # the block of tokens 48..63
        store.check(fix=True)
        assert store.check() == []
        try:
            r = store.restore("c", identity=ident)
        except SessionNotFoundError:
            return  # dropped: nothing valid was left to serve
        k = len(r.tokens)
        assert r.tokens == toks[:k] and k < SAVED
        continues_alike(model, r.cache, feed(model, toks[:k]))


def as_written_before_the_rule(root: Path) -> None:
    """The row's floor as persist wrote it before the chunked rule (its front, 47)."""
    import sqlite3

    db = sqlite3.connect(root / "index.sqlite")
    with db:
        db.execute("UPDATE snapshots SET min_resume = 47")
        db.execute("UPDATE tails SET min_resume = 47")
    db.close()


def test_a_row_written_before_the_rule_serves_no_cut_the_rule_refuses(
    tiny: Any, tmp_path: Path
) -> None:
    model, _, ident, toks, cache = session(tiny)
    root = tmp_path / "s"
    with persist.Store(root, block_tokens=16) as store:
        store.save(cache, toks, identity=ident, session="c")
    as_written_before_the_rule(root)
    with persist.Store(root, block_tokens=16) as store:
        for h in (48, 56, 63, 70):
            check_hit(model, store.lookup(prompt_sharing(toks, h), identity=ident), toks, h)
        check_hit(model, store.lookup(prompt_sharing(toks, 80), identity=ident), toks, 80)
        flip(block_blob(store, "c", 3))
        store.check(fix=True)
        with pytest.raises(SessionNotFoundError):  # no valid cut, no checkpoint: dropped
            store.restore("c", identity=ident)


def test_a_chunked_state_mlx_lm_cut_below_its_chunk_serves_nothing(
    tiny: Any, tmp_path: Path
) -> None:
    """mlx-lm's trim_prompt_cache (its server's prompt cache) cuts the front-dropped
    session to 56 tokens, keeping start_position 47: no fresh prefill holds that."""
    from mlx_lm.models.cache import trim_prompt_cache

    model, _, ident, toks, cache = session(tiny)
    assert trim_prompt_cache(cache, SAVED - 56) == SAVED - 56
    for host in (None, GIB):
        with persist.Store(tmp_path / "s", host_cache=host) as store:
            store.save(cache, toks[:56], identity=ident)
            for h in (40, 56):
                check_hit(model, store.lookup(prompt_sharing(toks, h), identity=ident), toks, h)
