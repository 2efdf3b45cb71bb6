"""Read-only bind mounts for the tests of read-only stores (skipped where mounting
is not permitted)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only_mount(path: Path) -> Iterator[None]:
    """``path`` bind-mounted read-only over itself; skip where mounting is refused."""
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        pytest.skip("mount --bind is not permitted here (a read-only store needs a mount)")
    try:
        remount = ["mount", "-o", "remount,bind,ro", str(path)]
        subprocess.run(remount, check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)  # lazy: mapped blobs may linger
