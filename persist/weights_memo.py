"""Remember a model's weights digest, keyed by the files it was loaded from.

Hashing every weight costs about 0.2 s per GiB, in every process.  The digest
is of the weights as mlx-lm loads them (sanitized, adapters applied), so it
can only be remembered, not read from the files: the first load by persist
(``provenance.stamp``: ``from_path``, the CLI, ``persist serve``) computes it
and writes it here; later ones look it up by a key of every weight file
(name, size, mtime, ctime, inode and device; or the sha256 that a Hugging Face cache
path names, ``blobs/<sha256>``), the adapter files, the config, the mlx /
mlx-lm versions, and the structure of the model as loaded (every parameter's
dtype and shape, every layer's class and quantization settings).  Anything
that changes a file changes the key.  Whether a model in memory still is what
was loaded is ``provenance``'s to say, not this key's.  No mlx.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from .private_files import group_mode, private_mkdir, unsafe, unsafe_above, unsafe_path

__all__ = ["files_key", "recall", "remember", "memo_dir"]

HF_BLOB = re.compile(r"[0-9a-f]{64}")
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf", ".bin", ".json")


def memo_dir() -> Path:
    """Where digests are kept: ``PERSIST_IDENTITY_CACHE``, else ``$PERSIST_HOME/identity``
    (a persist home keeps everything persist writes), else the user cache dir."""
    for env, sub in (("PERSIST_IDENTITY_CACHE", ""), ("PERSIST_HOME", "identity")):
        value = os.environ.get(env)
        if value:
            return Path(os.path.expandvars(os.path.expanduser(value))) / sub
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("persist")) / "identity"


def _file_facts(path: Path) -> list[object]:
    real = path.resolve()
    if real.parent.name == "blobs" and HF_BLOB.fullmatch(real.name):
        return [path.name, "sha256", real.name]  # the content hash the HF cache names
    st = real.stat()
    # ctime too: a file rewritten in place with its mtime set back (rsync --inplace -t,
    # os.utime) keeps size, mtime and inode, but no user can set its ctime back
    return [path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def files_key(dirs: Iterable[Path | None], versions: dict[str, str], structure: str = "") -> str:
    """The key of every file a load reads from ``dirs`` (weights, configs, adapters),
    and of the model's structure as loaded (``provenance.structure``)."""
    facts: list[object] = [sorted(versions.items()), structure]
    for d in dirs:
        if d is None:
            facts.append(None)
            continue
        files = sorted(p for p in Path(d).iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
        facts.append([str(Path(d).resolve()), [_file_facts(p) for p in files]])
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()


_warned: set[Path] = set()
READ_LIMIT = 4096  # a memo file is ~50 bytes: anything larger is not one


def _trusted(d: Path) -> bool:
    """Only a folder no other user can change, nor rename away (every folder above it
    checked, ``private_files``), is read or written: a digest planted there would
    make another model's caches this model's."""
    why = unsafe_path(d)
    above = unsafe_above(d) if why is None else None
    if above is not None:
        why = f"lies in {above[0]}, which {above[2]}"
    if why is not None and d not in _warned:
        _warned.add(d)
        logging.getLogger("persist").warning(
            "persist: the weights-digest memo %s %s: not used (every load hashes the "
            "weights again); chmod go-w it, or remove it",
            d,
            why,
        )
    return why is None


@contextlib.contextmanager
def _opened(d: Path) -> Iterator[int | None]:
    """The checked folder's descriptor, or None: the path is resolved first, checked,
    then opened without following a link and judged by ``fstat`` of what was opened,
    so a folder swapped after the check is never the one read or written."""
    real = os.path.realpath(d)
    if not _trusted(d):
        yield None
        return
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        yield fd if unsafe(os.fstat(fd), group_mode()) is None else None
    finally:
        os.close(fd)


def _read(dir_fd: int, name: str) -> bytes | None:
    """The file ``name`` in the folder ``dir_fd``: a regular file of this user no one
    else can write, never through a link, never a FIFO's wait; else None."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or unsafe(st, group_mode()) is not None:
            return None
        return os.read(fd, READ_LIMIT + 1)
    finally:
        os.close(fd)


def recall(key: str) -> str | None:
    """The remembered digest, or None (missing, unreadable, or in a folder another
    user can change: computed again)."""
    try:
        with _opened(memo_dir()) as dir_fd:
            raw = None if dir_fd is None else _read(dir_fd, f"{key}.json")
        data = json.loads(raw) if raw is not None and len(raw) <= READ_LIMIT else None
    except (OSError, ValueError):
        return None
    digest = data.get("weights") if isinstance(data, dict) else None
    ok = isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{32}", digest) is not None
    return digest if ok else None


def remember(key: str, digest: str) -> None:
    """Write the digest atomically; a cache that cannot be written is only slower.
    Folders 0700 and the file 0600 whatever the umask: it often makes ``PERSIST_HOME``."""
    d = memo_dir()
    with contextlib.suppress(OSError):
        private_mkdir(d)
        with _opened(d) as dir_fd:
            if dir_fd is None:
                return  # never read either (recall): computed in every process
            tmp = f".{key}.{secrets.token_hex(4)}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            with os.fdopen(os.open(tmp, flags, 0o600, dir_fd=dir_fd), "w") as f:
                f.write(json.dumps({"weights": digest}))
            os.replace(tmp, f"{key}.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
