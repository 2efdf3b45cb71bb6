"""What importing persist costs, checked in fresh interpreters (sys.modules, not source text).

``import persist``, ``import persist.storage``, ``import persist.policy`` and the
store-only commands (ls, show, rm, gc, check, stats, --help) never import mlx
or mlx-lm; importing persist never imports click.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import persist
from tests.helpers import ROOT

HEAVY = ("mlx", "mlx.core", "mlx_lm")


def modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "module", ["persist", "persist.storage", "persist.policy", "persist.errors"]
)
def test_light_imports(module: str) -> None:
    loaded = modules_after(f"import {module}")
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert "click" not in loaded


@pytest.mark.parametrize(
    "command", ["ls", "--help", "stats", "check", "gc", "show nope", "rm nope", "ls --all"]
)
def test_store_only_commands_never_import_mlx(command: str, tmp_path: Path) -> None:
    args = [*command.split(), *([] if command == "--help" else ["--store", str(tmp_path / "s")])]
    code = (
        "import sys\n"
        f"sys.argv = ['persist', *{args!r}]\n"
        "from persist.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
    )
    loaded = modules_after(code)
    assert not loaded & set(HEAVY), (command, sorted(loaded & set(HEAVY)))


def test_every_public_name_resolves() -> None:
    for name in persist.__all__:
        assert getattr(persist, name) is not None, name
    with pytest.raises(AttributeError):
        _ = persist.no_such_name  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", ["ls", "show w", "stats", "rm w"])
def test_reads_of_a_current_store_never_import_sqlite_utils(command: str, tmp_path: Path) -> None:
    """`persist ls` spent 0.22-0.27 s of 0.31 s in `import sqlite_utils` (it pulls in
    numpy): a store whose schema is current is opened without it."""
    root = tmp_path / "s"
    persist.Store(root).close()  # made (and migrated) here, in this process
    code = (
        "import sys\n"
        f"sys.argv = ['persist', *{command.split()!r}, '--store', {str(root)!r}]\n"
        "from persist.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
    )
    loaded = modules_after(code)
    assert not loaded & {"sqlite_utils", "numpy", *HEAVY}, sorted(
        loaded & {"sqlite_utils", "numpy"}
    )


# What a listing does not need: the engine (costs, retention, tiers), the blob files
# and their container format, logging's machinery, and the other commands' modules.
LISTING_NEVER = (
    "persist.engine.store",
    "persist.engine.costs",
    "persist.storage.blobs",
    "persist.storage.retention",
    "persist.format.container",
    "persist.format.sink",
    "persist.policy",
    "persist.cli.maintenance",
    "persist.cli.run",
    "persist.cli.transfer",
    "logging",
    "sqlite_utils",
    "numpy",
)


@pytest.mark.parametrize("command", ["ls", "ls --sort used --limit 1", "show w", "show nope"])
def test_ls_and_show_import_only_the_index(command: str, tmp_path: Path) -> None:
    """`persist ls` and `show` print their first rows after click, SQLite and the index
    modules: the engine's Store and the blob layer cost them ~0.1 s of CPU at start."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from tests.golden.cases import IDENTITY

    root = tmp_path / "s"
    with persist.Store(root) as store:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 8, 4)), mx.zeros((1, 1, 8, 4)))
        store.save([c], list(range(8)), identity=IDENTITY, session="w")
    code = (
        "import sys\n"
        f"sys.argv = ['persist', *{command.split()!r}, '--store', {str(root)!r}]\n"
        "from persist.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
    )
    loaded = modules_after(code)
    assert not loaded & set(LISTING_NEVER), sorted(loaded & set(LISTING_NEVER))
    assert "persist.storage.index" in loaded  # the probe ran the command's read
