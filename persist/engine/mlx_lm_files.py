"""mlx-lm's prompt-cache files: read (validated) and written.

mlx-lm's ``save_prompt_cache`` (and ``mlx_lm.cache_prompt``) writes a
safetensors file whose metadata names each layer's class and holds no tokens
and no model identity, only the model's name as it was given (``model``, where
``cache_prompt`` and ``persist export`` write it).  Reading one, persist
validates the container first, maps class names only to the mlx-lm cache
classes it has codecs for (never a name looked up anywhere else), and checks
every layer through its codec; the caller must say which tokens the cache
covers and for which model (``transfer``), and the model the file names must
be that one (``check_named_model``).  Writing one goes
through mlx-lm's own writer, so ``load_prompt_cache`` reads it, then the atomic
rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptBlobError,
    IdentityMismatchError,
    ModelNotFoundError,
    PersistError,
    UnknownKindError,
    UnsupportedFormatError,
)
from ..format.container import read_header
from ..format.manifest import is_mlx_lm_metadata
from ..format.opening import open_regular, user_reads
from ..format.sink import fsync_dir, place, tmp_beside
from ..model_folders import looks_like_repo, model_folder
from .files import user_writes

__all__ = [
    "is_mlx_lm",
    "read_mlx_lm",
    "check_named_model",
    "write_mlx_lm",
    "mlx_lm_classes_only",
    "mlx_lm_metadata",
    "MAX_KEY_DEPTH",
]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def is_mlx_lm(path: str | os.PathLike[str]) -> bool:
    try:
        with open_regular(path, user=True) as f:
            header = read_header(f, str(path))
    except OSError:
        return False  # load_file reports it
    return is_mlx_lm_metadata(header.metadata)


def _classes() -> dict[str, type]:
    from ..codecs import BUILTIN_KINDS

    return {
        cls.__name__: cls
        for cls, _ in BUILTIN_KINDS.values()
        if cls.__module__ == "mlx_lm.models.cache"
    }


def read_mlx_lm(path: str | os.PathLike[str]) -> tuple[list[Any], dict[str, str]]:
    """The caches and user metadata of an mlx-lm prompt-cache file, validated."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    from ..codecs.snapshot import capture

    where = str(path)
    with user_reads(where), open_regular(path, user=True) as f:
        read_header(f, where)  # persist's bounded, validating reader before mx.load
        try:  # by a path to the file checked (a file object: 6x slower reads in mlx)
            loaded: Any = mx.load(_held(f, where), format="safetensors", return_metadata=True)
        except (RuntimeError, ValueError) as e:  # mlx's words for a read that failed
            raise CorruptBlobError(where, f"mlx cannot load it: {e}") from None
    arrays, meta = loaded
    _check_keys(where, [*meta, *arrays])  # tree_unflatten would allocate what they claim
    try:
        user, names, scalars = tree_unflatten(list(meta.items()))
        assert isinstance(names, list) and all(isinstance(n, str) for n in names)
        states = tree_unflatten(list(_scalars(arrays, scalars).items()))
        assert isinstance(states, list) and len(states) == len(names)
    except (AssertionError, ValueError, TypeError, KeyError, IndexError):
        raise CorruptBlobError(where, "malformed mlx-lm prompt-cache metadata") from None
    known: dict[str, Any] = _classes()
    cache = []
    for i, (name, state) in enumerate(zip(names, states, strict=True)):
        cls = known.get(name)
        if cls is None:
            raise UnknownKindError(name, f"{where}: not an mlx-lm cache class persist stores")
        try:
            cache.append(cls.from_state(state))
        except Exception as e:  # mlx-lm's setters assume a well-formed state
            raise CorruptBlobError(where, f"layer {i} ({name}): malformed state: {e}") from None
    try:
        capture(cache)  # every layer through its codec: refused here, not at a later save
    except PersistError:
        raise
    except Exception as e:
        raise CorruptBlobError(where, f"a layer does not hold a valid cache: {e}") from None
    return cache, {str(k): str(v) for k, v in dict(user or {}).items()}


def _held(f: Any, where: str) -> str:
    """A path that opens the file ``f`` holds, never what was swapped in under its name
    since (a FIFO would make mx.load wait): ``/proc/self/fd/N`` on Linux; elsewhere the
    name, refused (CorruptBlobError) unless it still is that file."""
    by_fd = f"/proc/self/fd/{f.fileno()}"
    if os.path.exists(by_fd):
        return by_fd
    held, named = os.fstat(f.fileno()), os.stat(where)
    if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
        raise CorruptBlobError(where, "replaced by another file while it was read")
    return where


INDEX_RE = re.compile(r"0|[1-9][0-9]{0,8}")
MAX_KEY_DEPTH = 32  # levels of a key (a.b.c: 3); the states of mlx-lm caches nest 4 (CacheList)


def _check_keys(where: str, keys: list[str]) -> None:
    """Every list index in an mlx-lm file's keys is a plain number no greater than the
    file's count of keys: ``tree_unflatten`` makes a list as long as its largest index
    (a key ``1.<N>`` allocated N slots, a MemoryError for N = 10**11). A real file's
    lists have an entry per index, each at least one key, but for empty states.
    No key nests deeper than MAX_KEY_DEPTH: ``tree_unflatten`` recurses once per level."""
    bound = len(keys)
    for key in keys:
        parts = key.split(".")
        if len(parts) > MAX_KEY_DEPTH:
            raise CorruptBlobError(
                where,
                f"mlx-lm prompt-cache key {key[:40]!r}... nests {len(parts)} levels; "
                f"persist reads at most {MAX_KEY_DEPTH}",
            )
        for part in parts:
            try:
                int(part)  # what tree_unflatten takes for a list index ("1_0", " 7", ...)
            except ValueError:
                continue
            if not INDEX_RE.fullmatch(part) or int(part) > bound:
                raise CorruptBlobError(
                    where, f"malformed mlx-lm prompt-cache key {key[:80]!r} (list index)"
                )


def _scalars(arrays: dict[str, Any], scalars: Any) -> dict[str, Any]:
    out = dict(arrays)
    for pos, kind in scalars[1:]:
        a = out[pos]
        if kind == "scalar":
            out[pos] = a.item()
        elif kind == "string":
            out[pos] = "".join(chr(i) for i in a.tolist())
        elif kind == "none":
            out[pos] = None
        else:
            raise ValueError(kind)
    return out


def write_mlx_lm(
    path: str | os.PathLike[str],
    cache: list[Any],
    metadata: dict[str, str] | None = None,
    *,
    replace: bool = True,
) -> None:
    """A file mlx-lm's ``load_prompt_cache`` reads: its writer, then fsync and rename
    (``replace`` False: a link, AlreadyExistsError where anything is, as save_file's)."""
    mlx_lm_classes_only(cache)
    target = Path(path)
    with user_writes(path):  # the system's refusal is StorageError, as save_file's
        tmp = tmp_beside(target, ".tmp.safetensors")
        _write_mlx_lm(target, tmp, cache, metadata, replace)


def _write_mlx_lm(target: Path, tmp: str, cache: list[Any], metadata: Any, replace: bool) -> None:
    from mlx_lm.models.cache import save_prompt_cache

    try:
        # made here first (0600): a folder that refuses it says so as the system does,
        # where mlx's writer would only raise its own RuntimeError
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o600))
        save_prompt_cache(tmp, cache, dict(metadata or {}))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        place(tmp, target, replace)
        fsync_dir(target.parent if str(target.parent) else Path("."))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def mlx_lm_classes_only(cache: list[Any]) -> None:
    """UnsupportedFormatError for a cache list mlx-lm's ``load_prompt_cache`` cannot
    read: it looks classes up in mlx_lm.models.cache alone."""
    foreign = sorted({type(c).__name__ for c in cache} - set(_classes()))
    if foreign:
        raise UnsupportedFormatError(
            f"mlx-lm cannot load caches of {', '.join(foreign)} (not mlx-lm classes); "
            "export this session in the persist format"
        )


def mlx_lm_metadata(user: dict[str, str], model: str) -> dict[str, str]:
    """What ``mlx_lm.cache_prompt`` writes and ``mlx_lm generate --prompt-cache-file``
    reads: ``model`` (compared as a string with its --model, or loaded when that is
    not given) and ``tokenizer_config`` (JSON); the session's own metadata beside."""
    return {**user, "model": model, "tokenizer_config": json.dumps({})}


def check_named_model(named: str | None, identity: Any, where: str) -> None:
    """The model an mlx-lm file names must be ``identity``'s (a ModelIdentity): the
    same folder here, or one of the same weights, config and tokenizer (cache
    settings aside: the file's caches carry them).  Outside attack r15: a file of
    model A imported for model B of the same shapes was served to B's prompts.  A
    file that names no model is the caller's word alone; one that names a model not
    on this machine is refused, ModelNotFoundError (``trust_model`` skips this)."""
    if not named:
        return
    folder = _named_folder(named)
    if folder is None:
        raise ModelNotFoundError(
            f"{where} was computed with the model {named!r}, which is not on this machine, "
            f"so nothing can check that it is the model given ({identity.display()}); if it "
            "is, import it with --trust-model (trust_model=True)"
        )
    mine = _named_folder(identity.source) if identity.source else None
    if mine is not None and mine.resolve() == folder.resolve():
        return
    from ..identity import ModelIdentity

    theirs = ModelIdentity.from_path(folder)
    fields = [f for f in theirs.diff(identity) if not f.startswith("cache_config")]
    if fields:
        raise IdentityMismatchError(
            f"{where} (computed with {named})", fields, theirs.display(), identity.display()
        )


def _named_folder(named: str) -> Path | None:
    """The folder a model's name means on this machine: the folder itself, or a repo
    id's snapshot in the Hugging Face cache (never downloaded); None where neither is."""
    path = Path(os.path.expanduser(named))
    if path.is_dir():
        return path
    if not looks_like_repo(named):
        return None
    try:
        return model_folder(named, download=False)
    except PersistError:
        return None
