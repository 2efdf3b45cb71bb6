"""The weights digest is remembered by the files a model was loaded from: the same
digest, computed once; any change to a file computes it again.  It stands for a
model only while that model holds what persist loaded (``persist.provenance``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import persist
import persist.provenance as provenance
from tests.helpers import prefill, tokens_for


@pytest.fixture
def memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "memo"
    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(d))
    return d


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = provenance.weights_digest

    def spy(model: Any) -> str:
        calls.append(1)
        return real(model)

    monkeypatch.setattr(provenance, "weights_digest", spy)
    return calls


def test_from_path_hashes_once_and_agrees_with_of(
    tiny: Any, model_dir: Any, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, d = tiny("llama")  # mlx_lm.load: no provenance
    want = persist.ModelIdentity.of(model, tok)  # no path: hashed, never remembered
    calls = counting(monkeypatch)
    first = persist.ModelIdentity.from_path(d)
    second = persist.ModelIdentity.from_path(d)
    assert len(calls) == 1
    again = persist.ModelIdentity.of(model, tok, path=d)  # not loaded by persist: hashed
    assert len(calls) == 2
    loaded, ltok = provenance.load_model(d)[:2]
    stamped = persist.ModelIdentity.of(loaded, ltok, path=d)  # loaded by persist: the memo
    assert first == second == again == stamped == want and first.digest == want.digest
    assert len(calls) == 2 and len(list(memo.glob("*.json"))) == 1


def test_a_changed_weight_file_is_hashed_again(
    model_dir: Any, tmp_path: Path, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "m"
    shutil.copytree(model_dir("llama"), d)
    persist.ModelIdentity.from_path(d)
    calls = counting(monkeypatch)
    weights = next(d.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    want = persist.ModelIdentity.from_path(d)
    assert len(calls) == 1
    for f in memo.glob("*.json"):  # a damaged memo is computed again, never trusted
        f.write_text("{not json")
    assert persist.ModelIdentity.from_path(d) == want and len(calls) == 2
    assert persist.ModelIdentity.from_path(d) == want and len(calls) == 2  # rewritten


def test_a_hugging_face_blob_name_is_the_key(
    model_dir: Any, tmp_path: Path, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = model_dir("llama")
    blobs, snap = tmp_path / "hf" / "blobs", tmp_path / "hf" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = blobs / (f"{abs(hash(f.name)):064x}"[:64])
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(blob)
    first = persist.ModelIdentity.from_path(snap)
    calls = counting(monkeypatch)
    for blob in blobs.iterdir():  # touching a content-addressed blob changes nothing
        os.utime(blob)
    assert persist.ModelIdentity.from_path(snap) == first and not calls


# -- a model changed in memory never gets the files' identity (issue 23.2) ----------


def _fresh(d: Path) -> tuple[Any, Any]:
    """As persist loads: stamped, so only a change in memory can make it hash."""
    model, tok = provenance.load_model(d)[:2]
    return model, tok


def test_a_cast_or_quantized_model_is_not_the_files(
    model_dir: Any, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx
    import mlx.nn as nn

    d = model_dir("llama")
    files = persist.ModelIdentity.from_path(d)  # remembered for the files as loaded
    model, tok = _fresh(d)
    assert persist.ModelIdentity.of(model, tok, path=d) == files
    model.set_dtype(mx.float16)
    calls = counting(monkeypatch)
    cast = persist.ModelIdentity.of(model, tok, path=d)
    assert cast != files and cast == persist.ModelIdentity.of(model, tok)  # as if hashed
    assert persist.ModelIdentity.of(model, tok, path=d) == cast and len(calls) == 3
    assert len(list(memo.glob("*.json"))) == 1  # never remembered under the files' key
    monkeypatch.undo()
    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(memo))

    for bits in (4, 8):
        model, tok = _fresh(d)
        nn.quantize(model, group_size=32, bits=bits, class_predicate=_quantizable)
        q = persist.ModelIdentity.of(model, tok, path=d)
        assert q != files and q == persist.ModelIdentity.of(model, tok)


def _quantizable(_: str, m: Any) -> bool:
    import mlx.nn as nn

    return isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0


def test_an_adapter_applied_in_code_is_hashed_every_time(
    model_dir: Any, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    d = model_dir("llama")
    files = persist.ModelIdentity.from_path(d)
    seen = []
    for seed in (1, 2):  # two adapters of one shape: two identities
        model, tok = _fresh(d)
        linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
        for layer in model.model.layers:
            lora = layer.self_attn.q_proj
            if hasattr(lora, "lora_b"):
                lora.lora_b = mx.random.normal(lora.lora_b.shape, key=mx.random.key(seed))
        calls = counting(monkeypatch)
        ident = persist.ModelIdentity.of(model, tok, path=d)
        assert len(calls) == 1  # never looked up: the adapter's values are in no file
        assert ident != files and ident == persist.ModelIdentity.of(model, tok)
        seen.append(ident)
        monkeypatch.undo()
        monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(memo))
    assert seen[0] != seen[1]


def test_a_session_of_the_files_is_not_served_to_the_cast_model(
    model_dir: Any, memo: Path, tmp_path: Path
) -> None:
    import mlx.core as mx

    from tests.helpers import prefill, tokens_for

    d = model_dir("llama")
    model, tok = _fresh(d)
    ident = persist.ModelIdentity.of(model, tok, path=d)
    toks = tokens_for(80, seed=5)
    with persist.Store(tmp_path / "s") as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="bf")
        model.set_dtype(mx.float16)
        cast = persist.ModelIdentity.of(model, tok, path=d)
        assert store.lookup(toks, identity=cast) is None
        with pytest.raises(persist.IdentityMismatchError):
            store.restore("bf", identity=cast)


def test_a_replaced_or_added_array_or_another_folder_is_hashed(
    model_dir: Any, tmp_path: Path, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Load provenance holds only while every parameter is the very array loaded."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    d = model_dir("llama")
    other = tmp_path / "copy"
    shutil.copytree(d, other)
    model, tok = _fresh(d)
    files = persist.ModelIdentity.of(model, tok, path=d)
    calls = counting(monkeypatch)
    assert persist.ModelIdentity.of(model, tok, path=d) == files and not calls
    assert persist.ModelIdentity.of(model, tok, path=other) == files and len(calls) == 1
    name, arr = tree_flatten(model.parameters())[0]
    model.update(tree_unflatten([(name, arr * 1)]))  # the same values, another array
    assert persist.ModelIdentity.of(model, tok, path=d) == files and len(calls) == 2
    model, tok = _fresh(d)
    model.model.extra = mx.zeros((2,))  # a parameter added
    assert persist.ModelIdentity.of(model, tok, path=d) != files and len(calls) == 3


def test_an_in_place_write_into_a_weight_is_the_one_change_not_seen(
    model_dir: Any, memo: Path
) -> None:
    """As documented (persist/provenance.py, README): ``w[...] = x`` keeps the array
    object, so the files' digest stays; passing no path hashes what is there."""
    d = model_dir("llama")
    model, tok = _fresh(d)
    files = persist.ModelIdentity.of(model, tok, path=d)
    model.model.embed_tokens.weight[0] = 0.5
    assert persist.ModelIdentity.of(model, tok, path=d) == files  # not seen
    assert persist.ModelIdentity.of(model, tok) != files


def test_the_server_stamps_what_its_provider_loads(
    model_dir: Any, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """persist serve's wrapped loader: the identity of a freshly loaded local model
    is the files' (remembered), and what changes it later is hashed."""
    import types

    from mlx_lm import load

    from persist.serve.model_identity import track_identities

    d = model_dir("llama")
    files = persist.ModelIdentity.from_path(d)

    class Provider:
        cli_args = types.SimpleNamespace(kv_bits=None)
        draft_model = None

        def _load(self, path: Any, adapter: Any = None, draft: Any = None) -> None:
            self.model, self.tokenizer = load(path)[:2]
            self.model_key = (path, adapter, draft)

    server = types.SimpleNamespace(ModelProvider=Provider)
    identities = track_identities(server)
    provider = Provider()
    calls = counting(monkeypatch)
    provider._load(str(d))
    assert identities[(str(d), None, None)] == files and not calls
    assert provenance.remembered(provider.model, d, None) == files.weights
    provider.model.set_dtype(__import__("mlx.core").core.float16)
    assert provenance.remembered(provider.model, d, None) is None


def test_a_lora_adapter_fused_in_code_is_not_the_files_model(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """linear_to_lora_layers, trained (random lora_b), then fused back into plain
    Linear layers: same classes, dtypes and shapes as the files, other weights."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    d = model_dir("llama")
    model, tok = _fresh(d)
    base = persist.ModelIdentity.of(model, tok, path=d)  # remembered
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(1)) * 0.1
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    mx.eval(model.parameters())
    hashed = persist.ModelIdentity.of(model, tok)
    assert hashed.digest != base.digest
    assert persist.ModelIdentity.of(model, tok, path=d).digest == hashed.digest


def test_a_cast_and_back_is_not_the_files_model(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 -> fp16 -> bf16 rounds the weights: the files' digest no longer holds."""
    import mlx.core as mx

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    d = model_dir("llama")
    model, tok = _fresh(d)
    base = persist.ModelIdentity.of(model, tok, path=d)
    dtype = model.parameters()["model"]["embed_tokens"]["weight"].dtype
    model.set_dtype(mx.float16 if dtype != mx.float16 else mx.bfloat16)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    hashed = persist.ModelIdentity.of(model, tok)
    assert hashed.digest != base.digest
    assert persist.ModelIdentity.of(model, tok, path=d).digest == hashed.digest


def test_a_weight_file_rewritten_in_place_is_not_the_remembered_model(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same size, same inode, mtime restored (rsync --inplace -t, a tool that keeps
    times, a filesystem with a coarse clock): the files changed, the key did not."""
    import shutil

    from persist.provenance import load_model

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    d = tmp_path / "m"
    shutil.copytree(model_dir("llama"), d)
    base = persist.ModelIdentity.from_path(d)  # remembered
    f = d / "model.safetensors"
    st = os.stat(f)
    with open(f, "r+b") as g:  # new values for the last 4 KiB of weights, in place
        g.seek(st.st_size - 4096)
        data = bytearray(g.read(4096))
        data[::2] = bytes(b ^ 0x40 for b in data[::2])
        g.seek(st.st_size - 4096)
        g.write(data)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    model, tok = load_model(d)[:2]
    hashed = persist.ModelIdentity.of(model, tok)
    assert hashed.digest != base.digest  # the weights did change
    assert persist.ModelIdentity.from_path(d).digest == hashed.digest


def test_a_rope_changed_in_memory_is_another_identity(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Context extension done in code after loading (a new nn.RoPE per layer): the
    model computes other logits, so the unmodified model's caches are wrong for it."""
    import mlx.nn as nn

    from persist.provenance import load_model

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    d = model_dir("llama")
    model, tok = load_model(d)[:2]
    remembered = persist.ModelIdentity.of(model, tok, path=d)
    hashed = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=1)
    _, before = prefill(model, toks)
    for layer in model.model.layers:
        r = layer.self_attn.rope
        layer.self_attn.rope = nn.RoPE(r.dims, traditional=r.traditional, base=r.base * 4)
    _, after = prefill(model, toks)
    assert not mx.array_equal(before, after).item()  # another model now
    assert persist.ModelIdentity.of(model, tok).digest != hashed.digest
    assert persist.ModelIdentity.of(model, tok, path=d).digest != remembered.digest


def test_a_memo_folder_another_user_can_write_is_not_trusted(
    model_dir: Any, memo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside attack made $PERSIST_HOME/identity/ world-writable (the store
    refuses that mode on blobs/) and planted model A's digest under model B's
    files: B resumed A's session.  A folder another user can change is neither
    read nor written (the digest is computed again); nor is a linked memo file."""
    from persist import weights_memo
    from persist.apps.demo import make_model

    a, b = model_dir("llama"), make_model(tmp_path / "b", "llama", seed=1)
    mine = persist.ModelIdentity.from_path(a).weights
    theirs = persist.ModelIdentity.from_path(b).weights
    assert mine != theirs
    (key_b,) = [p for p in memo.iterdir() if p.read_text().count(theirs)]
    planted = key_b.read_text().replace(theirs, mine)
    os.chmod(memo, 0o777)
    key_b.write_text(planted)
    calls = counting(monkeypatch)
    assert persist.ModelIdentity.from_path(b).weights == theirs and calls == [1]
    assert weights_memo.recall(key_b.stem) is None
    os.chmod(memo, 0o700)
    key_b.unlink()
    elsewhere = memo.parent / "planted.json"
    elsewhere.write_text(planted)
    key_b.symlink_to(elsewhere)
    assert weights_memo.recall(key_b.stem) is None
    assert persist.ModelIdentity.from_path(b).weights == theirs
