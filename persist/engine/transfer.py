"""Sessions in and out of single files: persist files, and mlx-lm's prompt caches.

mlx-lm's ``save_prompt_cache`` (and ``mlx_lm.cache_prompt``) writes a
safetensors file whose metadata names each layer's class and holds no tokens
and no model identity.  Reading one, persist validates the container first,
maps class names only to the mlx-lm cache classes it has codecs for (never a
name looked up anywhere else), and checks every layer through its codec; the
caller must say which tokens the cache covers and for which model, since
nothing in the file can vouch for either.  Writing one goes through mlx-lm's
own writer, so ``load_prompt_cache`` reads it, then the atomic rename.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptBlobError,
    NotResumableError,
    PersistError,
    UnknownKindError,
    UnsupportedFormatError,
)
from ..format.container import fsync_dir, read_header
from ..format.manifest import is_mlx_lm_metadata
from ..format.opening import open_regular
from ..identity import ModelIdentity
from .files import load_file, save_file

__all__ = [
    "Importable",
    "read_importable",
    "write_mlx_lm",
    "read_mlx_lm",
    "export_row",
    "FORMATS",
]

FORMATS = ("persist", "mlx-lm")


class Importable:
    """What a file holds that a Store can save as a session."""

    def __init__(
        self, cache: list[Any], tokens: list[int], identity: ModelIdentity, metadata: dict[str, str]
    ) -> None:
        self.cache, self.tokens, self.identity, self.metadata = cache, tokens, identity, metadata


def read_importable(
    path: str | os.PathLike[str],
    *,
    identity: ModelIdentity | None = None,
    tokens: Sequence[int] | None = None,
) -> Importable:
    """A persist file as it is, or an mlx-lm prompt cache with the caller's tokens and model."""
    if not _is_mlx_lm(path):
        loaded = load_file(path, identity=identity)
        if loaded.identity is None or loaded.tokens is None:
            raise NotResumableError(
                f"{path} records no model identity or no tokens; save it with "
                "persist.save_file(path, cache, tokens, identity=...) to import it"
            )
        return Importable(loaded.cache, loaded.tokens, loaded.identity, loaded.metadata)
    if identity is None or tokens is None:
        raise NotResumableError(
            f"{path} is an mlx-lm prompt cache: it records neither the tokens it covers nor "
            "the model; give both (persist import FILE --model DIR --prompt TEXT)"
        )
    cache, metadata = read_mlx_lm(path)
    return Importable(cache, [int(t) for t in tokens], identity, metadata)


def _is_mlx_lm(path: str | os.PathLike[str]) -> bool:
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
    with open_regular(path, user=True) as f:
        read_header(f, where)  # persist's bounded, validating reader before mx.load
    loaded: Any = mx.load(where, return_metadata=True)
    arrays, meta = loaded
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
    path: str | os.PathLike[str], cache: list[Any], metadata: dict[str, str] | None = None
) -> None:
    """A file mlx-lm's ``load_prompt_cache`` reads: its writer, then fsync and rename."""
    from mlx_lm.models.cache import save_prompt_cache

    foreign = sorted({type(c).__name__ for c in cache} - set(_classes()))
    if foreign:  # load_prompt_cache looks classes up in mlx_lm.models.cache alone
        raise UnsupportedFormatError(
            f"mlx-lm cannot load caches of {', '.join(foreign)} (not mlx-lm classes); "
            "export this session in the persist format"
        )
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp.safetensors")
    try:
        save_prompt_cache(str(tmp), cache, dict(metadata or {}))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        fsync_dir(target.parent if str(target.parent) else Path("."))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_file(
    path: str | os.PathLike[str],
    cache: list[Any],
    tokens: list[int],
    identity: ModelIdentity,
    metadata: dict[str, str],
    fmt: str = "persist",
) -> None:
    """``fmt`` persist (everything, verifiable) or mlx-lm (caches and metadata only)."""
    if fmt == "persist":
        save_file(path, cache, tokens, metadata=metadata, identity=identity)
    elif fmt == "mlx-lm":
        write_mlx_lm(path, cache, metadata)
    else:
        raise UnsupportedFormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def export_row(index: Any, blobs: Any, row: Any, path: str | os.PathLike[str], format: str) -> None:
    """``Store.export``: a stored snapshot, restored, written as one file."""
    from ..format.tokens import unpack_tokens
    from ..store.rows import entry_info
    from .loading import load_snapshot
    from .reading import saved_identity

    cache = load_snapshot(index, blobs, row)
    meta = entry_info(row).metadata
    write_file(path, cache, unpack_tokens(row.tokens), saved_identity(row), meta, format)
