"""Token packing alone: one little-endian uint32 layout, one gate for bad ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from persist.errors import InvalidTokensError
from persist.format.tokens import (
    MAX_TOKEN,
    check_tokens,
    common_prefix_packed,
    pack_tokens,
    unpack_tokens,
)

ids = st.lists(st.integers(0, MAX_TOKEN), max_size=300)


@given(ids)
def test_packing_round_trips(toks: list[int]) -> None:
    raw = pack_tokens(toks)
    assert len(raw) == 4 * len(toks) and unpack_tokens(raw) == toks
    assert raw[:4] == (toks[0].to_bytes(4, "little") if toks else b"")


@given(ids, ids)
def test_common_prefix_of_packed_lists(a: list[int], b: list[int]) -> None:
    naive = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    assert common_prefix_packed(pack_tokens(a), pack_tokens(b)) == naive
    assert common_prefix_packed(pack_tokens(a), pack_tokens(a + b)) == len(a)


@pytest.mark.parametrize("bad", [[-1], [MAX_TOKEN + 1], [1.5], ["3"]])
def test_bad_ids_are_refused(bad: list[object]) -> None:
    with pytest.raises(InvalidTokensError):
        check_tokens(bad)  # type: ignore[arg-type]
