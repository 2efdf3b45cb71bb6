"""The README's tour shows exactly the commands bench/tour.py runs (and wrote the output of)."""

from __future__ import annotations

import re

import pytest

from bench.tour import BLOCK, COMMANDS, README, run


def test_the_readme_tour_is_the_scripted_one() -> None:
    m = BLOCK.search(README.read_text())
    assert m is not None
    shown = [line[2:] for line in m.group(2).splitlines() if line.startswith("$ ")]
    assert shown == COMMANDS


def shape(text: str) -> list[str]:
    """Per command, its first and last lines of output, with what changes from run to
    run made one symbol: numbers (times, dates, sizes) and where a turn's tokens came
    from (the cost model may recompute a short prefix on a busy machine).  Lines of
    this machine's measurements (rates, decisions) are left out."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            blocks.append([line])
        elif blocks and not line.startswith(("rate ", "decision ", "cost_", "hits ", "misses ")):
            blocks[-1].append(line)
    out = []
    for b in blocks:
        for line in [b[0], *b[1:2], *b[2:][-1:]]:
            line = re.sub(r"\((none|prefix|session)\)", "(#)", line)
            out.append(re.sub(r"\d+(\.\d+)?", "#", line))
    return out


@pytest.mark.long
def test_the_readme_tour_shows_what_the_commands_print_now() -> None:
    """The tour's `persist stats` output was out of date: its outputs are checked too."""
    m = BLOCK.search(README.read_text())
    assert m is not None
    assert shape(run()) == shape(m.group(2))
