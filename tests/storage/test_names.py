"""The name rule (attack 38d, finding E): names are 1 to 1024 characters, and a session
name may go past that only by the fork suffix persist itself adds (``~2``..``~1000``);
every name ``fork_name`` makes passes ``check_name``."""

from __future__ import annotations

import pytest

from persist.errors import InvalidNameError
from persist.storage.rows import MAX_FORKS, MAX_NAME, check_name, fork_name

BASE = "b" * MAX_NAME


@pytest.mark.parametrize("name", ["x", "x~1", "x~0", BASE, f"{BASE}~2", f"{BASE}~1000"])
def test_names_a_session_may_have(name: str) -> None:
    assert check_name(name, "session") == name


@pytest.mark.parametrize(
    "name",
    ["", f"{BASE}x", f"{BASE}~1", f"{BASE}~02", f"{BASE}~1001", f"{BASE}~2~2", f"x{BASE}~2"],
)
def test_past_the_limit_only_a_fork_suffix(name: str) -> None:
    with pytest.raises(InvalidNameError, match="fork suffix"):
        check_name(name, "session")


def test_a_namespace_has_no_forks() -> None:
    with pytest.raises(InvalidNameError) as e:
        check_name(f"{BASE}~2", "namespace")
    assert "fork" not in str(e.value)


@pytest.mark.parametrize("name", ["chat", "chat~2", BASE, f"{BASE}~2", f"{BASE}~1000"])
def test_every_fork_name_is_a_name(name: str) -> None:
    made = {fork_name(name, n) for n in range(2, MAX_FORKS + 1)}
    assert all(check_name(m, "session") == m for m in made)
    assert len(made) == MAX_FORKS - 1  # one name each
    if len(name) > MAX_NAME:  # forks beside it, one of them the name itself (passed over)
        assert name in made and fork_name(name, 3) == f"{BASE}~3"
    else:
        assert fork_name(name, 2) == f"{name}~2"
