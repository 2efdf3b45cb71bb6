"""Every golden file of every format version ever written still decodes and behaves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import persist
from tests.golden.cases import CASES, IDENTITY, probe
from tests.helpers import ROOT

GOLDEN = ROOT / "tests" / "golden"
FILES = sorted(GOLDEN.glob("v*/*.safetensors"))


def test_every_case_has_golden_files() -> None:
    v1 = {p.stem for p in (GOLDEN / "v1").glob("*.safetensors")}
    assert v1 == set(CASES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_golden_file_decodes_and_behaves(path: Path) -> None:
    expected = json.loads((path.parent / "expected.json").read_text())[path.stem]
    loaded = persist.load_file(path, identity=IDENTITY)
    (cache,) = loaded.cache
    assert persist.kind_of(cache) == expected["kind"]
    assert loaded.metadata == {"case": path.stem}
    assert (loaded.tokens is not None) == expected["tokens"]
    assert probe(cache) == expected["probe"]
