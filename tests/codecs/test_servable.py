"""persist.servable: one rule per kind, and every place that reports a layer's
servable set (live facts, stored rows) agrees with the rule over its record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import persist
from persist import servable
from persist.codecs import encode_cache, facts_of, trim_record
from persist.errors import NotResumableError
from tests.helpers import prefill, tokens_for


@given(
    start=st.integers(0, 300),
    extra=st.integers(0, 300),
    chunk=st.integers(1, 128),
    n=st.integers(1, 700),
)
def test_the_chunked_rule_keeps_what_the_next_front_drop_keeps(
    start: int, extra: int, chunk: int, n: int
) -> None:
    """A cut to n serves iff mlx-lm's next front drop leaves the cut and a fresh
    prefill of n tokens holding the same positions: [max(start, n - chunk), n)
    against [max(0, n - chunk), n)."""
    offset = start + extra
    rule = servable.chunked({"offset": offset, "start_position": start, "chunk_size": chunk})
    if not 0 < n <= offset:
        assert not rule.serves(n, offset)
        return
    same_front = max(start, n - chunk) == max(0, n - chunk)
    assert rule.serves(n, offset) == same_front


def test_rings_and_recurrent_state() -> None:
    ring = {"offset": 10, "idx": 10, "max_size": 16, "keep": 0}
    assert servable.rotating(ring).serves(3, 10)
    wrapped = {**ring, "offset": 20, "idx": 4}
    assert not servable.rotating(wrapped).serves(19, 20) and servable.rotating(wrapped).serves(
        20, 20
    )
    assert not servable.EXACT.serves(5, 6) and servable.EXACT.serves(6, 6)
    q = servable.quantized({"offset": 50, "min_resume_offset": 30})
    assert q.serves(30, 50) and not q.serves(29, 50)
    # wrappers: the intersection of their parts
    d = servable.delayed({"converted_at": 40}, [servable.ANY])
    assert d.floor == 40 and d.trimmable
    assert not servable.every_part({}, [servable.ANY, servable.EXACT]).trimmable
    assert servable.Servable(True, 0).serves(5, 5) and not servable.Servable(True, 6).serves(5, 5)


FAMILIES = ["llama", "gemma3", "qwen3_next", "mamba2", "falcon_h1", "llama4", "deepseek_v4"]


@pytest.mark.parametrize("variant", FAMILIES)
def test_live_facts_stored_rows_and_the_rule_agree(tiny: Any, tmp_path: Path, variant: str) -> None:
    model, tok, _ = tiny(variant)
    toks = tokens_for(70, seed=9)
    cache, _ = prefill(model, toks, step=24)  # chunked layers drop their front
    for c in cache:
        rule = servable.of_record(encode_cache(c))
        assert rule is not None
        f = facts_of(c)
        assert (f.trimmable, f.min_resume_offset) == (rule.trimmable, rule.floor)
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident, session="s")
        row = store.index.by_name("default", "s")
        assert row is not None
        ruled = servable.of_manifest(row.manifest)
        assert ruled == servable.Servable(row.trimmable, row.min_resume)
        assert servable.of_row(row.trimmable, row.min_resume, row.manifest) == ruled


def test_a_cut_the_rule_refuses_is_refused_by_trim(tiny: Any) -> None:
    model, _, _ = tiny("llama4")
    cache, _ = prefill(model, tokens_for(80, seed=9), step=24)  # start 40: floor 72
    rec = next(encode_cache(c) for c in cache if hasattr(c, "start_position"))
    assert rec.meta["start_position"] == 40
    with pytest.raises(NotResumableError):
        trim_record(rec, 60)
    assert trim_record(rec, 72).meta["offset"] == 72


def test_a_tier_record_whose_columns_predate_the_rule_serves_no_refused_cut() -> None:
    """A peer running an older persist pushed a front-dropped chunked session with
    its front (47) as the floor: the record is chosen only where the rule allows."""
    import msgpack

    from persist.engine.tiers.records import best_record
    from persist.format.tokens import pack_tokens

    toks = tokens_for(80, seed=4)
    chunked = {"offset": 80, "start_position": 47, "chunk_size": 32}
    layer = {"kind": "chunked-kv", "version": 1, "meta": chunked, "tensors": [], "children": []}
    manifest = msgpack.packb({"v": 1, "layers": [layer], "block": 16})
    row = {"tokens": pack_tokens(toks), "n_tokens": 80, "trimmable": True, "min_resume": 47}
    body = {"row": {**row, "manifest": manifest}}
    assert best_record([body], [*toks[:56], 999]) is None
    assert best_record([body], [*toks[:79], 999]) == (79, body)
