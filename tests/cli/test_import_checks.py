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


def test_a_purely_recurrent_file_needs_unverified_tokens_and_serves_only_its_name(
    tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    """A mamba2 prompt cache records no offset: 30 or 50 token ids for its 40 are
    refused unless --unverified-tokens, and then only its own name restores it."""
    from tests.helpers import NEXT, assert_same_state, continue_run, live_state, raw

    path, ids = _file(tiny, tmp_path, "mamba2")
    home, m = tmp_path / "home", str(model_dir("mamba2"))
    for n in (30, 40, 50):
        out = cli(home, "import", str(path), "--model", m,
                  "--tokens", ",".join(map(str, tokens_for(n, seed=7))))  # fmt: skip
        assert out.returncode == 1 and "--unverified-tokens" in out.stderr, out.stderr
    assert cli(home, "ls", "--all", "--json").stdout.strip() == "[]"
    toks = ",".join(map(str, ids))
    out = cli(home, "import", str(path), "--model", m, "--tokens", toks, "--unverified-tokens")
    assert out.returncode == 0, out.stderr
    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(home) as store:
        got = store.restore("mamba2", identity=ident)  # its own name: as the file holds it
        fresh, _ = prefill(model, ids)
        assert_same_state(live_state(got.cache), live_state(fresh))
        la, ga = continue_run(model, got.cache, NEXT)
        lb, gb = continue_run(model, fresh, NEXT)
        assert ga == gb and all(raw(a) == raw(b) for a, b in zip(la, lb, strict=True))
        assert store.entry("mamba2").metadata["persist.unverified_tokens"] == "true"
        for prompt in (ids + [1, 2], ids):  # another session's lookup: never
            assert store.lookup(prompt, identity=ident) is None
        # the session continued (restore, more tokens, save) is still unverified
        more = [*ids, *NEXT, *ga]
        store.save(got.cache, more, identity=ident, session="mamba2")
        assert store.lookup([*more, 5], identity=ident) is None
        assert store.restore("mamba2", identity=ident).tokens == more
        store.save(got.cache, more, identity=ident, session="other")  # marked: unverified
        assert store.lookup([*more, 5], identity=ident) is None
        store.save(prefill(model, more)[0], more, identity=ident, session="checked")
        assert store.lookup([*more, 5], identity=ident) is not None


def test_a_cache_prompt_file_imports_with_chat(tiny: Any, model_dir: Any, tmp_path: Path) -> None:
    """mlx_lm.cache_prompt applies the chat template: --prompt alone says so, --chat
    imports it; the restore continues as a fresh prefill of the templated tokens."""
    import os
    import sys

    from tests.helpers import NEXT, continue_run, pythonpath, raw

    m, text = str(model_dir("llama")), "a system prompt worth caching"
    path = tmp_path / "cp.safetensors"
    made = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", m, "--prompt", text,
         "--prompt-cache-file", str(path)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": pythonpath()},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    home = tmp_path / "home"
    plain = cli(home, "import", str(path), "--model", m, "--prompt", text)
    assert plain.returncode == 1 and "--chat" in plain.stderr, plain.stderr
    out = cli(home, "import", str(path), "--model", m, "--prompt", text, "--chat")
    assert out.returncode == 0, out.stderr
    model, tok, _ = tiny("llama")
    want = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    with persist.Store(home) as store:
        got = store.restore("cp", identity=persist.ModelIdentity.of(model, tok))
    assert got.tokens == list(want)
    fresh, _ = prefill(model, want)  # its own chunks: the continuation must agree
    la, ga = continue_run(model, got.cache, NEXT)
    lb, gb = continue_run(model, fresh, NEXT)
    assert ga == gb and all(raw(a) == raw(b) for a, b in zip(la, lb, strict=True))


def _named_file(tiny: Any, tmp: Path, named: str) -> tuple[Path, list[int]]:
    """A prompt-cache file of the llama variant whose metadata names ``named`` as its
    model, as mlx_lm.cache_prompt and persist export --format mlx-lm write it."""
    model, _, _ = tiny("llama")
    ids = tokens_for(40, seed=7)
    cache, _ = prefill(model, ids)
    path = tmp / "named.safetensors"
    save_prompt_cache(str(path), cache, {"model": named})
    return path, ids


def test_an_import_under_a_model_other_than_the_one_the_file_names_is_refused(
    tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    """Outside attack r15 (a wrong cache): a file whose metadata names model A, imported
    with --model B of the same shapes and other weights, was stored under B's identity
    and served to B's lookups (logits off by up to 5).  The layouts fit; the file's own
    word for its model was never read."""
    from persist.apps.demo import make_model

    a = model_dir("llama")
    b = tmp_path / "llama-other-weights"
    make_model(b, "llama", seed=7)
    path, ids = _named_file(tiny, tmp_path, str(a))
    home, toks = tmp_path / "home", ",".join(map(str, ids))
    out = cli(home, "import", str(path), "--model", str(b), "--tokens", toks)
    assert out.returncode == 1 and "weights" in out.stderr and str(a) in out.stderr, out.stderr
    assert cli(home, "ls", "--all", "--json").stdout.strip() == "[]"
    # the model it names: imported; a model it names that is not here: refused, unless
    # the user vouches for --model (--trust-model)
    assert cli(home, "import", str(path), "--model", str(a), "--tokens", toks).returncode == 0
    gone, _ = _named_file(tiny, tmp_path, "/nowhere/on/this/machine/model")
    out = cli(home, "import", str(gone), "--model", str(a), "--tokens", toks, "--session", "x")
    assert out.returncode == 1 and "--trust-model" in out.stderr, out.stderr
    out = cli(
        home, "import", str(gone), "--model", str(a), "--tokens", toks, "--session", "x",
        "--trust-model",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_the_library_import_reads_the_model_the_file_names(
    tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    from persist.apps.demo import make_model

    b = tmp_path / "llama-other-weights"
    make_model(b, "llama", seed=7)
    from mlx_lm import load

    other, otok = load(str(b))
    ident = persist.ModelIdentity.of(other, otok, path=b)
    path, ids = _named_file(tiny, tmp_path, str(model_dir("llama")))
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(persist.IdentityMismatchError, match="weights"):
            store.import_file(path, identity=ident, tokens=ids, model=other)
        assert store.entries() == []
        store.import_file(path, identity=ident, tokens=ids, model=other, trust_model=True)
        assert len(store.sessions()) == 1
