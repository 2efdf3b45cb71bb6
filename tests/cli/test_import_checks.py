"""What an import of an mlx-lm prompt-cache file checks (issue 23): the file must
fit the model it is imported for, and tokens nothing can check are refused
unless the user says they are unverified."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import save_prompt_cache

import persist
from tests.helpers import persist_cli, prefill, tokens_for


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return persist_cli(home, *args, check=False)


def _file(tiny: Any, tmp: Path, variant: str, n: int = 40) -> tuple[Path, list[int]]:
    model, _, _ = tiny(variant)
    ids = tokens_for(n, seed=7)
    cache, _ = prefill(model, ids)
    path = tmp / f"{variant}.safetensors"
    save_prompt_cache(str(path), cache)
    return path, ids


@pytest.mark.parametrize(
    ("source", "target", "field"),
    [
        ("llama", "qwen3_next", "layers"),
        ("llama", "mamba2", "layer 0"),
        ("llama_hd64", "llama", "layer 0"),
    ],
)
def test_an_import_under_another_model_is_refused_and_stores_nothing(
    tiny: Any, model_dir: Any, tmp_path: Path, source: str, target: str, field: str
) -> None:
    path, ids = _file(tiny, tmp_path, source)
    home = tmp_path / "home"
    toks = ",".join(map(str, ids))
    out = cli(home, "import", str(path), "--model", str(model_dir(target)), "--tokens", toks)
    assert out.returncode == 1, out.stderr
    assert "another model" in out.stderr and field in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert cli(home, "ls", "--all", "--json").stdout.strip() == "[]"


def test_the_library_import_checks_with_the_model(tiny: Any, tmp_path: Path) -> None:
    path, ids = _file(tiny, tmp_path, "llama")
    model, tok, _ = tiny("qwen3_next")
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(persist.IdentityMismatchError, match="layers") as e:
            store.import_file(path, identity=ident, tokens=ids, model=model)
        assert isinstance(e.value, ValueError)
        assert store.sessions() == []
        right, rtok, _ = tiny("llama")
        info = store.import_file(
            path, identity=persist.ModelIdentity.of(right, rtok), tokens=ids, model=right
        )
        assert info.tokens == len(ids)


def test_a_save_under_a_model_of_another_layer_count_is_refused(tiny: Any, tmp_path: Path) -> None:
    llama, _, _ = tiny("llama")
    model, tok, _ = tiny("qwen3_next")
    ident = persist.ModelIdentity.of(model, tok)
    assert ident.layers == 4
    ids = tokens_for(40, seed=8)
    cache, _ = prefill(llama, ids)  # two layers: another model's
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(persist.IdentityMismatchError, match="4 layers"):
            store.save(cache, ids, identity=ident, session="x")
        assert store.entries() == [] and store.check() == []
        again = persist.ModelIdentity.from_dict(ident.to_dict())  # kept through the index
        assert again.layers == 4
