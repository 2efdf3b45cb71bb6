"""Hostile files are refused cheaply: bounded memory, typed errors, nothing written.

Round 1: ``persist inspect`` of a 98 MB file declaring 11M tokens peaked at
738 MB; ``persist import`` of it ran for minutes and wrote 43,000 blob files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from persist.errors import CorruptBlobError
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
    # the import opened the store, then refused the file before writing a blob
    assert store.is_dir() and not list((store / "blobs").rglob("*.safetensors"))


HUGE_INDEX = """
import sys
import mlx.core as mx
from mlx_lm.models import cache as mc
c = mc.KVCache()
c.update_and_fetch(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)))
mc.save_prompt_cache(sys.argv[1], [c])
arrays, meta = mx.load(sys.argv[1], return_metadata=True)
meta["1." + sys.argv[2]] = "KVCache"  # a class list of N + 1 entries, says the key
mx.save_safetensors(sys.argv[1], arrays, meta)
"""


def make_huge_index(path: Path, index: str) -> None:
    make = [sys.executable, "-c", HUGE_INDEX, str(path), index]
    subprocess.run(make, cwd=ROOT, check=True, timeout=300)


# long: four fresh persist processes with mlx (about 10 s each on 2 cores)
@pytest.mark.long
def test_an_mlx_lm_file_whose_keys_claim_a_huge_list(tmp_path: Path, model_dir: Any) -> None:
    """Round 5: a 66 KB mlx-lm cache file with the metadata key ``1.<N>`` made
    ``persist import`` allocate N list slots (850 MiB for 10**7; MemoryError, exit 3,
    for 10**11) in mlx's tree_unflatten, before any check."""
    tiny = ROOT / "tests" / "golden" / "v1" / "kv-10.safetensors"
    base, _ = peak_rss("inspect", str(tiny))
    for index in ("100000000000", "10000000", "01"):
        hostile = tmp_path / f"h{index}.safetensors"
        make_huge_index(hostile, index)
        model = str(model_dir("llama"))
        args = ("import", str(hostile), "--model", model, "--prompt", "hi")
        rss, out = peak_rss(*args, "--store", str(tmp_path / "store"))
        assert out.startswith("1 ") and "malformed mlx-lm prompt-cache" in out, out
        assert "Traceback" not in out
        assert rss - base < EXTRA_BYTES, (index, rss - base)


def test_an_mlx_lm_key_that_python_reads_as_a_number(tmp_path: Path) -> None:
    """``int("1_0")`` is 10: such a key is no list index a real file has."""
    from persist.engine.mlx_lm_files import read_mlx_lm

    hostile = tmp_path / "h.safetensors"
    make_huge_index(hostile, "1_0")
    with pytest.raises(CorruptBlobError, match="malformed mlx-lm prompt-cache key"):
        read_mlx_lm(hostile)
