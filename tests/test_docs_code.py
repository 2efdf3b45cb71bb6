"""The Python the README and the documentation show runs, as a reader would run it.

Each file's ```python blocks run in order in one fresh interpreter, in an empty
folder holding a tiny random-weight llama model at ./tiny, with PERSIST_HOME
inside that folder.  A block fenced ```py only sketches signatures: never run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, pythonpath

# a fence at the start of a line: ```python alone (```py, ```pycon and others are not run)
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


WITH_CODE = [p for p in pages() if blocks(p)]


def test_blocks_are_found_where_they_are() -> None:
    """The pages with runnable code are the ones expected to have it, so a fence
    written another way (and so never run) does not go unnoticed here."""
    names = {p.relative_to(ROOT).as_posix() for p in WITH_CODE}
    assert {"README.md", "docs/library.md"} <= names
    assert blocks(ROOT / "docs" / "library.md")[0].lstrip().startswith("import math")


@pytest.mark.parametrize("page", WITH_CODE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_page_code_runs(page: Path, model_dir: Any, tmp_path: Path) -> None:
    shutil.copytree(model_dir("llama"), tmp_path / "tiny")
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks(page)), encoding="utf-8")
    env = {**os.environ, "PERSIST_HOME": str(tmp_path / "home"), "PYTHONPATH": pythonpath()}
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"{page.name}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
