"""Attack 38c, finding 6: a Ctrl-C during a many-name ``persist rm`` (``--fleet``
too) said only "interrupted", though some names were already deleted; the re-run
the docs advise then listed those as "not deleted: no session".  Now the line
names what was deleted before the interrupt.  A real store; the interrupt is
injected between two deletes (where a real Ctrl-C lands)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.cli import interrupts, removal
from tests.golden.cases import IDENTITY, kv_cache


class CtrlCOnThird:
    """A real store whose third delete is interrupted."""

    def __init__(self, store: persist.Store) -> None:
        self.store, self.calls = store, 0

    def delete(self, name: str, **kw: Any) -> bool:
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return bool(self.store.delete(name, **kw))


def test_an_interrupted_rm_says_what_it_deleted(tmp_path: Path) -> None:
    names = [f"s{i}" for i in range(5)]
    with persist.Store(tmp_path / "store") as store:
        for n in names:
            store.save([kv_cache(8, 1)], list(range(8)), identity=IDENTITY, session=n)
        interrupts.forget_committed()
        with pytest.raises(KeyboardInterrupt):
            removal._each(CtrlCOnThird(store), names, "default", False)
        line = interrupts.interrupted_line()
        assert "2 sessions deleted ('s0', 's1')" in line, line
        assert "committed before the interrupt" in line
        assert sorted(e.session or "" for e in store.sessions()) == ["s2", "s3", "s4"]
    interrupts.forget_committed()


def test_the_line_is_bounded() -> None:
    line = removal._so_far([f"n{i}" for i in range(100)], ["n0"])
    assert line.endswith("and 80 more, 1 from the tiers too)") and line.count("'n") == 20
