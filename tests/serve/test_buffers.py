"""``persist serve`` keeps freed MLX buffers for reuse on the CPU, as MLX does on GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from persist.serve.app import keep_freed_buffers
from tests.helpers import ON_CUDA

pytestmark = pytest.mark.skipif(ON_CUDA, reason="MLX's GPU backends keep freed buffers already")


@pytest.fixture
def mlx_default() -> Iterator[int]:
    old = mx.set_cache_limit(32 << 20)
    mx.clear_cache()
    yield old
    mx.set_cache_limit(old)
    mx.clear_cache()


def freed_and_kept(nbytes: int) -> int:
    """Bytes MLX keeps after an array of ``nbytes`` is freed."""
    mx.clear_cache()
    a = mx.zeros((nbytes,), dtype=mx.uint8)
    mx.eval(a)
    del a
    return int(mx.get_cache_memory())


def test_a_restored_cache_sized_buffer_is_kept_once_asked(mlx_default: int) -> None:
    assert freed_and_kept(64 << 20) < 64 << 20  # MLX's CPU default: back to the OS
    assert keep_freed_buffers(256 << 20) == 32 << 20  # the old limit comes back
    assert freed_and_kept(64 << 20) >= 64 << 20
    keep_freed_buffers(None)  # auto: up to MLX's memory limit, as on GPUs
    assert mx.set_cache_limit(32 << 20) == mx.get_memory_limit()


def test_a_bad_size_is_a_usage_error(tmp_path: Path) -> None:
    env = {**os.environ, "PERSIST_HOME": str(tmp_path)}  # never the user's own store
    r = subprocess.run(
        [sys.executable, "-m", "persist", "serve", "--mlx-cache", "lots"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    assert "'lots' is not a size" in r.stderr
