"""The folder a model's name means: a model folder, or a Hugging Face repo id.

A repo id (``mlx-community/Llama-3.2-1B-Instruct-4bit``) is resolved as
mlx-lm resolves it, to a snapshot folder of the Hugging Face cache, with the
files mlx-lm downloads.  The cache is asked first (no network), so a cached
model works offline and ``HF_HUB_OFFLINE=1`` is honoured; only a model the
cache lacks is downloaded, and only when the hub allows it.  The snapshot's
path names its revision, and the weights memo keys by that path and the
blobs' content hashes, so another revision is another identity.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from .errors import ModelNotFoundError

__all__ = ["model_folder", "looks_like_repo", "check_model_folder"]

# owner/name or name, as the hub spells repo ids (no leading dot, no "..")
REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")


def looks_like_repo(text: str) -> bool:
    return REPO_ID.fullmatch(text) is not None and ".." not in text and not text.endswith(".")


def model_folder(model: str | os.PathLike[str], *, download: bool = True) -> Path:
    """The folder mlx-lm loads for ``model``: a folder as given, a repo id from the
    Hugging Face cache (downloaded if missing, allowed and ``download``; else
    ModelNotFoundError).  No mlx until a repo id is looked up."""
    text = os.fspath(model)
    path = Path(os.path.expanduser(text))
    if path.is_dir():
        return check_model_folder(path, text)
    if path.exists():
        raise ModelNotFoundError(f"--model {text}: not a folder (give the model's folder)")
    if not looks_like_repo(text):
        raise ModelNotFoundError(f"--model {text}: no such folder, and not a Hugging Face repo id")
    return _snapshot(text, download)


def check_model_folder(path: Path, given: str) -> Path:
    """``path``, unless mlx-lm could not read it: no ``config.json``, or a file in it
    that is not a regular file (a FIFO there made mlx-lm's plain open wait forever;
    attack 38d, finding G): ModelNotFoundError naming it.  Links are followed."""
    try:
        modes = [(entry.name, _mode(entry.path)) for entry in os.scandir(path)]
    except OSError as e:
        raise ModelNotFoundError(f"--model {given}: cannot read it ({e.strerror})") from None
    for name, mode in modes:
        if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ModelNotFoundError(
                f"--model {given}: {name} is not a regular file; mlx-lm would wait on it "
                "or fail to read it"
            )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"--model {given}: no config.json (not a model folder)")
    return path


def _mode(path: str) -> int | None:
    """The mode of what ``path`` leads to; None for a dangling link (mlx-lm says so if it
    needs the file: ``load_model``)."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        return None


def _snapshot(repo: str, download: bool = True) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, RevisionResolutionError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    misses = (OSError, ValueError, EntryNotFoundError, RevisionResolutionError)
    try:  # the cache first: no network for a model already here
        local = snapshot_download(
            repo, allow_patterns=DEFAULT_ALLOW_PATTERNS, local_files_only=True
        )
        return Path(local)
    except misses:
        pass
    where = constants.HF_HUB_CACHE
    if not download:
        raise ModelNotFoundError(
            f"--model {repo}: not a folder, and not in the Hugging Face cache ({where}); "
            "get it first (persist generate --model it, or huggingface-cli download)"
        )
    if constants.is_offline_mode():
        raise ModelNotFoundError(
            f"--model {repo}: not a folder, and not in the Hugging Face cache ({where}); "
            "HF_HUB_OFFLINE is set, so it is not downloaded"
        )
    try:
        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except misses as e:
        raise ModelNotFoundError(
            f"--model {repo}: not a folder, and the Hugging Face hub did not give it: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
