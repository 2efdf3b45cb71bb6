"""System tools some tests drive (redis-server, redis-cli, strace): a machine without
one skips those tests with one line naming the package; CI, which installs them all
(.ci/run sets PERSIST_REQUIRE_TOOLS=1), fails instead, so no check drops out there."""

from __future__ import annotations

import os
import shutil

import pytest

PACKAGES = {"redis-server": "redis-server", "redis-cli": "redis-tools", "strace": "strace"}


def required() -> bool:
    return bool(os.environ.get("PERSIST_REQUIRE_TOOLS") or os.environ.get("CI"))


def need(tool: str) -> str:
    """The tool's path; skip (fail where tools are required) when it is missing."""
    exe = shutil.which(tool)
    if exe is not None:
        return exe
    why = f"needs {tool}: apt-get install {PACKAGES[tool]} (.ci/run installs it)"
    if required():
        pytest.fail(why)
    pytest.skip(why)


# fixtures that start a tool (tests/tiers/conftest.py); tests using them, even through
# another fixture, need it
FIXTURE_TOOLS = {"redis_server": ("redis-server",), "redis_cluster": ("redis-server", "redis-cli")}
_left_out: dict[str, int] = {}


def tools_of(item: pytest.Item) -> set[str]:
    names = set(getattr(item, "fixturenames", ()))
    out = {t for f, tools in FIXTURE_TOOLS.items() if f in names for t in tools}
    for mark in item.iter_markers("needs"):
        out |= set(mark.args)
    return out


def leave_out_missing(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests whose tools are missing here (unless tools are required),
    counted per tool for the one line ``summary`` prints."""
    if required():
        return
    missing = {t for t in PACKAGES if shutil.which(t) is None}
    if not missing:
        return
    keep, drop = [], []
    for item in items:
        lacks = sorted(tools_of(item) & missing)
        (drop if lacks else keep).append(item)
        for t in lacks[:1]:
            _left_out[t] = _left_out.get(t, 0) + 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def summary(terminalreporter: object) -> None:
    for tool, n in sorted(_left_out.items()):
        line = (
            f"left out {n} test{'s that need' if n != 1 else ' that needs'} {tool}, not installed: "
            f"apt-get install {PACKAGES[tool]} (CI installs it and runs them)"
        )
        terminalreporter.write_line(line, yellow=True)  # type: ignore[attr-defined]
