"""save_file/load_file as files: size, atomicity, permissions, compatibility."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import save_prompt_cache
from safetensors import safe_open

import persist
from tests.helpers import ROOT, prefill, tokens_for


def test_ten_token_file_is_a_small_fraction_of_mlx_lm(tiny: Any, tmp_path: Path) -> None:
    model, _, _ = tiny("llama")
    cache, _ = prefill(model, tokens_for(10))
    ours, theirs = tmp_path / "p.safetensors", tmp_path / "m.safetensors"
    persist.save_file(ours, cache, tokens_for(10))
    save_prompt_cache(str(theirs), cache)
    # mlx-lm writes the whole 256-step buffer; persist the 10 live positions
    assert ours.stat().st_size * 8 < theirs.stat().st_size
    print(f"10 tokens: persist {ours.stat().st_size} B, mlx-lm {theirs.stat().st_size} B")


def test_file_is_plain_safetensors_and_private(tiny: Any, tmp_path: Path) -> None:
    model, _, _ = tiny("gemma3")
    cache, _ = prefill(model, tokens_for(50))
    path = tmp_path / "g.safetensors"
    persist.save_file(path, cache, tokens_for(50))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    arrays = mx.load(str(path))
    with safe_open(str(path), "numpy") as f:
        assert set(f.keys()) == set(arrays)
        assert f.metadata()["format"] == "persist"
    assert (mx.array(arrays["2/keys"]) == cache[2].keys[..., :50, :]).all().item()


def test_failed_save_keeps_the_previous_file(tiny: Any, tmp_path: Path) -> None:
    """A save that dies mid-write (file size limit) leaves the old file and no debris."""
    model, _, model_dir = tiny("llama")
    cache, _ = prefill(model, tokens_for(20))
    path = tmp_path / "s.safetensors"
    persist.save_file(path, cache, tokens_for(20))
    before = path.read_bytes()
    script = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from mlx_lm import load
import persist
from tests.helpers import prefill, tokens_for
model, _ = load({str(model_dir)!r})
cache, _ = prefill(model, tokens_for(600))
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
try:
    persist.save_file({str(path)!r}, cache, tokens_for(600))
except OSError as e:
    print("refused:", e.errno)
    raise SystemExit(3)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 3, r.stderr
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]
    assert persist.load_file(path).tokens == tokens_for(20)
