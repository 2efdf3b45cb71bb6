"""Hostile files are refused cheaply: bounded memory, typed errors, nothing written.

Round 1: ``persist inspect`` of a 98 MB file declaring 11M tokens peaked at
738 MB; ``persist import`` of it ran for minutes and wrote 43,000 blob files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

MAKE = """
import sys
import mlx.core as mx
from mlx_lm.models import cache as mc
import persist, persist.format.tokens as chains
from tests.golden.cases import IDENTITY
chains.MAX_TOKENS = 1 << 30  # the hostile writer ignores persist's limit
c = mc.ArraysCache(2)
c[0] = mx.zeros((1, 4, 8))
c[1] = mx.zeros((1, 2, 8, 8))
persist.save_file(sys.argv[1], [c], [i % 50000 for i in range(11_000_000)], identity=IDENTITY)
"""

EXTRA_BYTES = 256 << 20


def peak_rss(*args: str) -> tuple[int, str]:
    """Run ``persist ARGS`` in a fresh process: (its peak RSS in bytes, its output)."""
    code = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-m', 'persist', *sys.argv[1:]],"
        " capture_output=True, text=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print(r.returncode, r.stdout + r.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    ).stdout
    kib, rest = out.split("\n", 1)
    return int(kib) * 1024, rest


# long: 17 s (it builds the hostile file); the import checks of tests/cli run quickly
@pytest.mark.long
def test_a_file_declaring_eleven_million_tokens(tmp_path: Path) -> None:
    hostile = tmp_path / "h.safetensors"
    subprocess.run([sys.executable, "-c", MAKE, str(hostile)], cwd=ROOT, check=True, timeout=300)
    tiny = ROOT / "tests" / "golden" / "v1" / "kv-10.safetensors"
    base, _ = peak_rss("inspect", str(tiny))
    store = tmp_path / "store"
    for args in (("inspect", str(hostile)), ("import", str(hostile), "--store", str(store))):
        rss, out = peak_rss(*args)
        assert out.startswith("1 ") and "larger than" in out, out
        assert rss - base < EXTRA_BYTES, (args[0], rss - base)
    assert not store.exists() or not list((store / "blobs").rglob("*.safetensors"))
