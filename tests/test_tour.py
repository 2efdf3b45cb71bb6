"""The README's tour shows exactly the commands bench/tour.py runs (and wrote the output of)."""

from __future__ import annotations

from bench.tour import BLOCK, COMMANDS, README


def test_the_readme_tour_is_the_scripted_one() -> None:
    m = BLOCK.search(README.read_text())
    assert m is not None
    shown = [line[2:] for line in m.group(2).splitlines() if line.startswith("$ ")]
    assert shown == COMMANDS
