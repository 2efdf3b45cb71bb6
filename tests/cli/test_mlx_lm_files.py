"""mlx-lm's own prompt-cache files, in and out: import with the tokens and model they
lack, export one mlx-lm loads, and a typed refusal where a persist file was expected."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import persist
from persist.engine.mlx_lm_files import MAX_KEY_DEPTH
from tests.helpers import assert_same_state, continue_run, live_state, persist_cli, prefill, raw

PROMPT = "a prompt cached by mlx_lm.cache_prompt, then resumed through persist"


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return persist_cli(home, *args, check=False)


@pytest.fixture
def mlx_file(tiny: Any, tmp_path: Path) -> tuple[Path, list[int]]:
    model, tok, _ = tiny("llama")
    ids = list(tok.encode(PROMPT, add_special_tokens=False))
    cache, _ = prefill(model, ids)
    path = tmp_path / "prompt.safetensors"
    save_prompt_cache(str(path), cache, {"note": "from mlx-lm"})
    return path, ids


def test_import_an_mlx_lm_file_with_its_prompt(
    mlx_file: tuple[Path, list[int]], tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    path, ids = mlx_file
    home = tmp_path / "home"
    m = str(model_dir("llama"))
    out = cli(home, "import", str(path), "--session", "p", "--model", m, "--prompt", PROMPT)
    assert out.returncode == 0, out.stderr
    model, tok, _ = tiny("llama")
    with persist.Store(home) as store:
        r = store.restore("p", identity=persist.ModelIdentity.of(model, tok))
    assert r.tokens == ids and r.entry.metadata == {"note": "from mlx-lm"}
    theirs = load_prompt_cache(str(path))
    assert_same_state(live_state(r.cache), live_state(theirs))
    la, ga = continue_run(model, r.cache, [5, 6, 7])
    lb, gb = continue_run(model, theirs, [5, 6, 7])
    assert ga == gb and all(raw(a) == raw(b) for a, b in zip(la, lb, strict=True))


def test_an_mlx_lm_file_needs_its_tokens_and_model(
    mlx_file: tuple[Path, list[int]], model_dir: Any, tmp_path: Path
) -> None:
    path, ids = mlx_file
    home = tmp_path / "home"
    bare = cli(home, "import", str(path))
    assert bare.returncode == 1 and "--model DIR --prompt TEXT" in bare.stderr
    m = str(model_dir("llama"))
    wrong = cli(home, "import", str(path), "--model", m, "--tokens", "1,2,3")
    assert wrong.returncode == 1 and f"covers {len(ids)} positions" in wrong.stderr
    assert cli(home, "ls", "--all", "--json").stdout.strip() == "[]"


def test_load_file_names_the_import_command(mlx_file: tuple[Path, list[int]]) -> None:
    path, _ = mlx_file
    with pytest.raises(persist.UnsupportedFormatError, match="persist import") as e:
        persist.load_file(path)
    assert isinstance(e.value, ValueError) and not isinstance(e.value, persist.CorruptBlobError)
    with pytest.raises(persist.UnsupportedFormatError):
        persist.read_manifest(path)


def test_export_a_file_mlx_lm_loads(tiny: Any, model_dir: Any, tmp_path: Path) -> None:
    home = tmp_path / "home"
    m = str(model_dir("llama"))
    gen = cli(home, "generate", "--model", m, "--session", "w", "--prompt", PROMPT,
              "--max-tokens", "3")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    out = tmp_path / "w-mlx.safetensors"
    assert cli(home, "export", "w", str(out), "--format", "mlx-lm").returncode == 0
    model, tok, _ = tiny("llama")
    with persist.Store(home) as store:
        ours = store.restore("w", identity=persist.ModelIdentity.of(model, tok)).cache
    assert_same_state(live_state(load_prompt_cache(str(out))), live_state(ours))
    again = cli(home, "export", "w", str(out), "--format", "mlx-lm")
    assert again.returncode == 1 and "--force" in again.stderr


def test_class_names_are_never_looked_up_outside_the_registry(tmp_path: Path) -> None:
    path = tmp_path / "evil.safetensors"
    meta = {"1.0": "load_prompt_cache", "2.0": ""}
    mx.save_safetensors(str(path), {"0.0": mx.zeros((1, 1, 2, 4))}, meta)
    with pytest.raises(persist.UnknownKindError, match="load_prompt_cache"):
        persist.Store(tmp_path / "s").import_file(
            path, identity=persist.ModelIdentity("t", "c", "w", "k", "h"), tokens=[1, 2]
        )


@pytest.mark.parametrize(
    "arrays, classes",
    [
        ({"0.0": (1, 1, 2, 4)}, ["KVCache"]),  # too few state arrays
        ({"0.0": (2, 4), "0.1": (2, 4), "0.2": (1,)}, ["KVCache"]),  # wrong dims
        ({"0.0": (1, 1, 2, 4), "0.1": (1, 1, 2, 4)}, ["RotatingKVCache"]),  # no meta state
        ({"0.0": (1, 1, 2, 4)}, ["KVCache", "KVCache"]),  # two classes, one state
    ],
)
def test_malformed_mlx_lm_files_are_typed_refusals(
    arrays: dict[str, tuple[int, ...]], classes: list[str], tmp_path: Path
) -> None:
    path = tmp_path / "bad.safetensors"
    meta = {**{f"1.{i}": c for i, c in enumerate(classes)}, "2.0": ""}
    mx.save_safetensors(str(path), {k: mx.zeros(s) for k, s in arrays.items()}, meta)
    with pytest.raises(persist.CorruptBlobError):
        persist.Store(tmp_path / "s").import_file(
            path, identity=persist.ModelIdentity("t", "c", "w", "k", "h"), tokens=[1, 2]
        )


def test_a_key_nested_thousands_deep_is_refused_naming_the_limit(
    tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    """tree_unflatten recurses once per level: 5,000 levels were a RecursionError (exit 3)."""
    model, tok, _ = tiny("llama")
    ids = list(tok.encode(PROMPT, add_special_tokens=False))
    path = tmp_path / "deep.safetensors"
    deep = "a" + ".0" * 5000
    save_prompt_cache(str(path), prefill(model, ids)[0], {deep: "x"})  # mlx-lm's own writer
    m = str(model_dir("llama"))
    out = cli(tmp_path / "home", "import", str(path), "--model", m, "--prompt", PROMPT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"nests 5002 levels; persist reads at most {MAX_KEY_DEPTH}" in out.stderr


def test_a_session_mlx_lm_cannot_load_is_not_exported_for_it(tmp_path: Path) -> None:
    from persist.caches import DelayedQuantizedKVCache
    from tests.golden.cases import IDENTITY

    c = DelayedQuantizedKVCache(start=64)
    c.update_and_fetch(mx.zeros((1, 1, 3, 32)), mx.zeros((1, 1, 3, 32)))
    kv_bits = dataclasses.replace(IDENTITY, cache_config=(("kv_bits", 4), ("kv_group_size", 64)))
    with persist.Store(tmp_path / "s") as store:
        store.save([c], [1, 2, 3], identity=kv_bits, session="d")  # its own settings
        with pytest.raises(persist.UnsupportedFormatError, match="DelayedQuantizedKVCache"):
            store.export("d", tmp_path / "d.safetensors", format="mlx-lm")
    assert not list(tmp_path.glob("*d.safetensors*"))


def _mlx_generate(model: str, cache_file: Path, prompt: str) -> str:
    """``python -m mlx_lm generate`` on a prompt-cache file: its answer's text."""
    import os
    import sys

    from tests.helpers import pythonpath

    env = {**os.environ, "PYTHONPATH": pythonpath()}
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", model, "--prompt-cache-file",
         str(cache_file), "--prompt", prompt, "--max-tokens", "6", "--temp", "0"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.split("==========")[1]


def test_an_export_mlx_lm_generate_continues(tiny: Any, model_dir: Any, tmp_path: Path) -> None:
    """The export's metadata is what mlx_lm.cache_prompt writes, so mlx-lm's own
    generate resumes it; its answer equals one from a fresh prefill of the tokens."""
    home = tmp_path / "home"
    m = str(model_dir("llama"))
    gen = cli(home, "generate", "--model", m, "--session", "w", "--prompt", PROMPT,
              "--max-tokens", "3")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    out = tmp_path / "w-mlx.safetensors"
    done = cli(home, "export", "w", str(out), "--format", "mlx-lm", "--model", m)
    assert done.returncode == 0, done.stderr
    _, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta["model"] == m and meta["tokenizer_config"] == "{}"
    model, tok, _ = tiny("llama")
    with persist.Store(home) as store:
        tokens = store.restore("w", identity=persist.ModelIdentity.of(model, tok)).tokens
    fresh, _ = prefill(model, tokens)
    ref = tmp_path / "fresh.safetensors"
    save_prompt_cache(str(ref), fresh, {"model": m, "tokenizer_config": "{}"})
    assert _mlx_generate(m, out, " more") == _mlx_generate(m, ref, " more")
    other = str(model_dir("llama_hd64"))  # a file claims its model: never another one
    wrong = cli(home, "export", "w", str(out), "--format", "mlx-lm", "--model", other, "--force")
    assert wrong.returncode == 1 and "another model" in wrong.stderr


def _fake_hf_repo(hub: Path, repo: str, src: Path) -> None:
    """``repo`` in a Hugging Face cache at ``hub``, holding ``src``'s files."""
    import shutil

    root = hub / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / ("a" * 40)
    shutil.copytree(src, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("a" * 40)


def test_an_mlx_lm_export_for_a_repo_id_of_another_model_is_refused(
    tiny: Any, tmp_path: Path
) -> None:
    """`mlx_lm generate --prompt-cache-file OUT` without --model loads the file's
    `model`: here another llama, which would continue this llama's cache."""
    from persist.apps.demo import make_model

    d = tiny("llama")[2]
    other = tmp_path / "other"
    make_model(other, "llama", seed=1)
    hub = tmp_path / "hub"
    _fake_hf_repo(hub, "someone/other-llama", other)
    home = tmp_path / "home"
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    persist_cli(home, "generate", "--model", str(d), "--session", "s", "--prompt", "Hello",
                "--max-tokens", "2", env=env)  # fmt: skip
    out = tmp_path / "s.safetensors"
    got = persist_cli(home, "export", "s", str(out), "--format", "mlx-lm",
                      "--model", "someone/other-llama", check=False, env=env)  # fmt: skip
    assert got.returncode == 1 and not out.exists(), got.stdout + got.stderr
    assert "another model" in got.stderr
    _fake_hf_repo(hub, "someone/this-llama", d)  # the session's own model, by repo id
    ok = persist_cli(home, "export", "s", str(out), "--format", "mlx-lm",
                     "--model", "someone/this-llama", env=env)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    _, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta["model"] == "someone/this-llama"
    out.unlink()
    for model, says in (
        (str(tmp_path / "nowhere"), "no such folder"),  # a path that does not exist
        ("someone/not-cached", "not in the Hugging Face cache"),  # never downloaded
        (str(d / "config.json"), "not a folder"),
    ):
        got = persist_cli(home, "export", "s", str(out), "--format", "mlx-lm",
                          "--model", model, check=False, env=env)  # fmt: skip
        assert got.returncode == 1 and says in got.stderr, got.stderr
        assert not out.exists()
    with persist.Store(home) as store:  # the API cannot resolve a repo id: it must be told
        with pytest.raises(persist.ModelNotFoundError, match="not a folder"):
            store.export("s", out, format="mlx-lm", model="someone/this-llama")
        snap = hub / "models--someone--this-llama" / "snapshots" / ("a" * 40)
        store.export("s", out, format="mlx-lm", model="someone/this-llama", model_dir=snap)
        assert out.exists()
