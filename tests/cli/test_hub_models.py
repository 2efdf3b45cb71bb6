"""``--model`` takes Hugging Face repo ids, resolved as mlx-lm resolves them: from the
local Hugging Face cache first, so ``HF_HUB_OFFLINE=1`` works with a cached model.
Offline: the tiny model is laid out as the hub's cache lays out a download."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import ROOT

REPO = "tiny-org/tiny-llama"


def as_hf_cache(model: Path, hub: Path, repo: str, revision: str) -> Path:
    """Lay ``model`` out as ``huggingface_hub`` caches a download of ``repo`` at ``revision``:
    blobs named by their hash, a snapshot folder of links to them, refs/main."""
    base = hub / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / revision
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(model.iterdir()):
        data = f.read_bytes()
        if f.suffix == ".safetensors":  # LFS files are named by their sha256
            name = hashlib.sha256(data).hexdigest()
        else:  # the others by their git blob hash
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (base / "blobs" / name).write_bytes(data)
        (snap / f.name).symlink_to(Path("../../blobs") / name)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(revision)
    return snap


def persist(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "persist", *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_repo_id_from_the_cache_offline(tmp_path: Path, model_dir: Any) -> None:
    hub, home = tmp_path / "hf" / "hub", tmp_path / "home"
    rev = "a" * 40
    snap = as_hf_cache(model_dir("llama"), hub, REPO, rev)
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "PERSIST_HOME": str(home),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PERSIST_IDENTITY_CACHE", None)
    turn = ["generate", "--session", "s", "-m", "3", "--json"]
    first = persist(env, *turn, "--model", REPO, "--prompt", "Hello there")
    assert first.returncode == 0, first.stderr
    r = json.loads(first.stdout)
    assert r["source"] == "none" and r["generated_tokens"] == 3
    ls = json.loads(persist(env, "ls", "--json").stdout)
    assert [e["model"] for e in ls] == [REPO]  # named as the user named it
    memos = sorted((home / "identity").iterdir())  # under PERSIST_HOME
    assert len(memos) == 1
    # the snapshot folder and the repo id are the same model: the session continues
    again = persist(env, *turn, "--model", str(snap), "--prompt", " more")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["reused_tokens"] == r["session_tokens"]
    assert sorted((home / "identity").iterdir()) == memos  # the memo served it
    # another revision is another memo key (its path names the revision)
    rev2 = "b" * 40
    shutil.rmtree(hub / f"models--{REPO.replace('/', '--')}" / "refs")
    as_hf_cache(model_dir("llama"), tmp_path / "hf2", REPO, rev2)
    env2 = {**env, "HF_HUB_CACHE": str(tmp_path / "hf2")}
    third = persist(env2, *turn, "--model", REPO, "--prompt", " and more")
    assert third.returncode == 0, third.stderr
    assert len(list((home / "identity").iterdir())) == 2
    # not cached and offline: one line saying so, exit 1
    miss = persist(env, *turn, "--model", "tiny-org/not-here", "--prompt", "x")
    assert miss.returncode == 1, miss.stderr
    err = json.loads(miss.stdout)  # --json: the error as JSON
    assert err["type"] == "ModelNotFoundError"
    assert "not in the Hugging Face cache" in err["error"] and "HF_HUB_OFFLINE" in err["error"]
    typo = persist(env, *turn[:-1], "--model", "./no-such-model", "--prompt", "x")
    assert typo.returncode == 1 and "no such folder" in typo.stderr, typo.stderr
