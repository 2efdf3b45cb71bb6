"""``persist explain`` as a user runs it: the demo model, a real store, real processes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import persist_cli


def test_explain_locates_the_divergence_and_says_why(tmp_path: Path) -> None:
    home = tmp_path / "home"
    said = "The quick brown fox jumps over the lazy dog"
    persist_cli(home, "generate", "--session", "fox", "--prompt", said, "--max-tokens", "2")
    out = persist_cli(home, "explain", "--prompt", "The quick brown fox jumps over a cat")
    assert "best usable hit: 31 tokens of session 'fox'" in out.stdout
    assert "after 'ver '" in out.stdout  # the shared text just before the divergence
    got = json.loads(persist_cli(home, "explain", "--prompt", said, "--json").stdout)
    assert got["reason"] == "last-token" and got["best"]["usable"] == len(said) - 1
    # another cache setting is another identity (kv_bits would be refused up front here:
    # the demo model's head dim 16 takes no quantization group)
    other = persist_cli(home, "explain", "--prompt", said, "--max-kv-size", "64", "--json")
    got = json.loads(other.stdout)
    assert got["reason"] == "identity" and got["best"] is None
    assert "cache_config.max_kv_size" in got["longest"]["identity_fields"]


def test_explain_on_an_empty_store_is_a_miss_not_an_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    persist_cli(home, "generate", "--session", "a", "--prompt", "Hello", "--max-tokens", "1")
    got = json.loads(persist_cli(home, "explain", "--prompt", "Zebra", "--json").stdout)
    assert got["reason"] == "empty" and got["nearest"] == []


def test_explain_needs_a_prompt(tmp_path: Path) -> None:
    out = persist_cli(tmp_path / "home", "explain", check=False)
    assert out.returncode == 2 and "--prompt" in out.stderr
