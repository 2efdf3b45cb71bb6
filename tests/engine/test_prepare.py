"""``engine.staged.restore.prepare``: what ``persist serve`` runs before it answers, so
a fresh process's first restore builds no kernel (issue 39: 4.6 s against 0.09 s)."""

from __future__ import annotations

import pytest

from persist.cuda import kernels, pinned
from persist.engine.staged.restore import prepare
from tests.helpers import ON_CUDA

KERNELS = 6  # persist/cuda/kernels.py's: zeroed, scatter, address, pack, unpack, copy_in


def test_prepare_is_a_no_op_off_cuda() -> None:
    if ON_CUDA:
        pytest.skip("the CUDA case below")
    assert prepare() is False
    assert pinned.data_path().driver is None


@pytest.mark.skipif(not ON_CUDA, reason="MLX's CUDA backend")
def test_prepare_builds_every_kernel_of_the_data_path() -> None:
    """Every kernel the module has is built: one added and not warmed fails here."""
    assert prepare() is True
    assert kernels._kernel.cache_info().currsize == KERNELS
