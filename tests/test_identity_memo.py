"""The weights digest is remembered by the files a model was loaded from: the same
digest, computed once; any change to a file computes it again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import persist
import persist.identity as identity_mod


@pytest.fixture
def memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "memo"
    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(d))
    return d


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = identity_mod._weights_digest

    def spy(model: Any) -> str:
        calls.append(1)
        return real(model)

    monkeypatch.setattr(identity_mod, "_weights_digest", spy)
    return calls


def test_from_path_hashes_once_and_agrees_with_of(
    tiny: Any, model_dir: Any, memo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, d = tiny("llama")
    want = persist.ModelIdentity.of(model, tok)  # no path: hashed, never remembered
    calls = counting(monkeypatch)
    first = persist.ModelIdentity.from_path(d)
    second = persist.ModelIdentity.from_path(d)
    again = persist.ModelIdentity.of(model, tok, path=d)
    assert first == second == again == want and first.digest == want.digest
    assert len(calls) == 1 and len(list(memo.glob("*.json"))) == 1


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
