"""Where an array's bytes lie, read without moving them (``cuda/addressing``).

On MLX's CUDA backend a DLPack export copies a device buffer into managed memory
for good, so there a kernel reports addresses and a view's strides come from the
addresses of its views one element along each dimension (``rows_from``).  On the
CPU the same derivation runs over DLPack's addresses and must give DLPack's own
layout for every view; on CUDA the kernel's addresses must be right and leave
every array where it was."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.cuda import addressing, dlpack
from tests.helpers import ON_CUDA


def _cpu_where(arrays: Any) -> list[int]:
    return [dlpack.first_byte(a) for a in arrays]


def _layout(a: mx.array, how: Any) -> Any:
    try:
        return how(a)
    except ValueError:
        return "refused"


@st.composite
def views(draw: Any) -> mx.array:
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    a = mx.arange(int(np.prod(shape)), dtype=mx.int32).reshape(shape)
    index = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        hi = draw(st.integers(lo + 1, n))
        index.append(slice(lo, hi, draw(st.sampled_from([1, 1, 2]))))
    v = a[tuple(index)]
    if draw(st.booleans()) and v.ndim > 1:
        v = v.swapaxes(0, -1)
    mx.eval(v)
    return v


@pytest.mark.skipif(ON_CUDA, reason="DLPack moves CUDA arrays to managed memory for good")
@settings(max_examples=200, deadline=None)
@given(views())
def test_rows_from_addresses_alone_are_dlpack_s_rows(v: mx.array) -> None:
    want = _layout(v, dlpack.rows)
    got = _layout(v, lambda a: addressing.rows_from(a, _cpu_where))
    if want == "refused":
        assert got == "refused"
        return
    assert got == want
    start, width, height, _ = got  # the view's bytes, from its first one
    assert start == dlpack.first_byte(v) and width * height == v.nbytes


@pytest.mark.skipif(not ON_CUDA, reason="MLX's CUDA backend: the PTX address kernel")
def test_the_kernel_s_addresses_are_right_and_move_nothing() -> None:
    from tests.cuda_memory import compiled_address, managed

    assert addressing.kernel_proven()
    mx.clear_cache()  # no buffer an earlier host read left managed is handed out again
    a = mx.zeros((4, 8, 64), dtype=mx.bfloat16) + 1  # a kernel's output: device memory
    view = a[:, 2:5, :]
    mx.eval(a, view)
    assert not managed(a)
    at = addressing.address(a)
    assert at == compiled_address(a)
    start, width, height, pitch = addressing.rows(view)
    assert (start, width, height, pitch) == (at + 2 * 64 * 2, 3 * 64 * 2, 4, 8 * 64 * 2)
    assert not managed(a)  # still device memory after both reads
    with pytest.raises(ValueError, match="not contiguous"):
        addressing.address(view)
