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

import contextlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptBlobError,
    IdentityMismatchError,
    InvalidArgumentError,
    ModelNotFoundError,
    NotResumableError,
    PersistError,
    UnknownKindError,
    UnsupportedFormatError,
)
from ..format.container import read_header
from ..format.manifest import is_mlx_lm_metadata
from ..format.opening import open_regular, user_reads
from ..format.sink import fsync_dir, tmp_beside
from ..identity import ModelIdentity
from .cache_fit import check_fits, check_quantized
from .files import load_file, save_file, user_writes
from .unverified import UNVERIFIED_KEY

__all__ = [
    "Importable",
    "read_importable",
    "write_mlx_lm",
    "read_mlx_lm",
    "check_readable",
    "export_row",
    "FORMATS",
    "check_fits",
]

FORMATS = ("persist", "mlx-lm")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Importable:
    """What a file holds that a Store can save as a session."""

    def __init__(
        self,
        cache: list[Any],
        tokens: list[int],
        identity: ModelIdentity,
        metadata: dict[str, str],
        unverified: bool = False,
    ) -> None:
        self.cache, self.tokens, self.identity, self.metadata = cache, tokens, identity, metadata
        self.unverified = unverified  # the tokens are the caller's word (``Store.save``)


def read_importable(
    path: str | os.PathLike[str],
    *,
    identity: ModelIdentity | None = None,
    tokens: Sequence[int] | None = None,
    model: Any = None,
    unverified_tokens: bool = False,
    chat_tokens: Sequence[int] | None = None,
    key: bytes | None = None,
) -> Importable:
    """A persist file as it is, or an mlx-lm prompt cache with the caller's tokens and
    model (whose own caches it must fit, ``check_fits``, when ``model`` is given).
    A persist file's model must be ``identity``'s (its cache settings are the file's
    own), and under ``key`` (the operator key) it must carry that key's tag."""
    if not _is_mlx_lm(path):
        loaded = load_file(path, key=key)
        if loaded.identity is None or loaded.tokens is None:
            raise NotResumableError(
                f"{path} records no model identity or no tokens; save it with "
                "persist.save_file(path, cache, tokens, identity=...) to import it"
            )
        if identity is not None:
            _same_model(loaded.identity, identity, f"file {path}")
        # an export of an unverified session: its tokens are still nobody's check
        unverified = loaded.metadata.get(UNVERIFIED_KEY) == "true"
        return Importable(
            loaded.cache, loaded.tokens, loaded.identity, loaded.metadata, unverified=unverified
        )
    if identity is None or tokens is None:
        raise NotResumableError(
            f"{path} is an mlx-lm prompt cache: it records neither the tokens it covers nor "
            "the model; give both (persist import FILE --model DIR --prompt TEXT)"
        )
    cache, metadata = read_mlx_lm(path)
    _one_row(cache, str(path))
    check_quantized(cache, identity, str(path))
    if model is not None:
        window = dict(identity.cache_config).get("max_kv_size")
        check_fits(cache, model, str(path), window)
    from ..codecs.snapshot import common_offset, snapshot_facts

    ids = [int(t) for t in tokens]
    offset = common_offset(snapshot_facts(cache))
    if offset is None and not unverified_tokens:
        raise NotResumableError(
            f"{path}: no layer records how many positions it covers (a purely recurrent "
            f"model), so nothing can check that it covers the {len(ids)} tokens given; "
            "import it with --unverified-tokens (unverified_tokens=True) if you are sure: "
            "it is then restored by its name only and never serves another prompt"
        )
    if offset is not None and offset != len(ids):
        hint = ""
        if chat_tokens is not None and len(chat_tokens) == offset:
            hint = (
                f"; with the chat template (as mlx_lm.cache_prompt applies it) the text is "
                f"{offset} tokens: import it with --chat"
            )
        raise NotResumableError(
            f"{path}: the cache covers {offset} positions but {len(ids)} tokens were given{hint}"
        )
    return Importable(cache, ids, identity, metadata, unverified=offset is None)


def _one_row(cache: list[Any], where: str) -> None:
    """A file of a batch (a row axis other than 1) is no one prompt's cache: refused
    before ``check_fits``, which sets the batch axis aside."""
    from ..codecs import encode_cache, kind_of
    from ..codecs.snapshot import require_one_row

    require_one_row([kind_of(c) for c in cache], [encode_cache(c) for c in cache], where)


def check_readable(path: str | os.PathLike[str]) -> None:
    """Refuse, typed and before anything is made, a path no import can read: missing, a
    folder, a FIFO (never waited on), a device (``open_regular``), or a file whose
    first read the system refuses (``/proc/self/mem``: StorageError)."""
    with user_reads(str(path)), open_regular(path, user=True) as f:
        f.read(8)  # a safetensors header's length: what every reader reads first


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
    path: str | os.PathLike[str], cache: list[Any], metadata: dict[str, str] | None = None
) -> None:
    """A file mlx-lm's ``load_prompt_cache`` reads: its writer, then fsync and rename."""
    mlx_lm_classes_only(cache)
    target = Path(path)
    with user_writes(path):  # the system's refusal is StorageError, as save_file's
        _write_mlx_lm(target, tmp_beside(target, ".tmp.safetensors"), cache, metadata)


def _write_mlx_lm(target: Path, tmp: str, cache: list[Any], metadata: Any) -> None:
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
        os.replace(tmp, target)
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


def write_file(
    path: str | os.PathLike[str],
    cache: list[Any],
    tokens: list[int],
    *,
    identity: ModelIdentity,
    metadata: dict[str, str],
    fmt: str = "persist",
    key: bytes | None = None,
) -> None:
    """``fmt`` persist (everything, verifiable; tagged under ``key``) or mlx-lm
    (caches and metadata only: mlx-lm reads no tag)."""
    if fmt == "persist":
        save_file(path, cache, tokens, metadata=metadata, identity=identity, key=key)
    elif fmt == "mlx-lm":
        write_mlx_lm(path, cache, metadata)
    else:
        raise UnsupportedFormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def export_row(
    index: Any,
    blobs: Any,
    row: Any,
    *,
    refs: list[Any] | None = None,
    path: str | os.PathLike[str],
    format: str,
    model: str | None = None,
    model_dir: str | os.PathLike[str] | None = None,
    key: bytes | None = None,
) -> None:
    """``Store.export``: a stored snapshot, restored, written as one file (a persist
    file tagged under the operator ``key``, ``file_tags``).  An mlx-lm
    file claims ``model`` (mlx-lm loads it when not told another): the session is
    checked against the files of ``model_dir``, or of ``model`` when it is a folder.
    Without ``model`` it claims the folder the session's model was loaded from
    (``ModelIdentity.source``), checked alike; a session that records none is
    refused (InvalidArgumentError naming --model): never a name mlx-lm cannot load."""
    from ..format.tokens import unpack_tokens
    from ..storage.rows import entry_info
    from .loading import load_snapshot
    from .reading import saved_identity

    cache = load_snapshot(index, blobs, row, refs=refs)  # refs: read with the row
    meta = entry_info(row).metadata
    identity = saved_identity(row)
    if format == "mlx-lm":
        mlx_lm_classes_only(cache)
        model = model if model is not None else _recorded_model(identity)
        # the file will claim this model: it must be the session's
        folder = model_dir if model_dir is not None else model
        if not Path(folder).is_dir():
            raise ModelNotFoundError(
                f"model {model}: not a folder, so the session cannot be checked against "
                "it; give the folder that holds it (model_dir=, or persist export "
                "--model, which finds a repo id in the Hugging Face cache)"
            )
        given = ModelIdentity.from_path(folder)
        _same_model(identity, given, f"this session (exported for {model})")
        meta = mlx_lm_metadata(meta, model)
    toks = unpack_tokens(row.tokens)
    write_file(path, cache, toks, identity=identity, metadata=meta, fmt=format, key=key)


def _recorded_model(identity: ModelIdentity) -> str:
    """The folder the session's model was loaded from, which the file will claim."""
    if not identity.source:
        raise InvalidArgumentError(
            f"this session records no folder for its model ({identity.display()}), and an "
            "mlx-lm file must name one mlx-lm can load: give it with --model (model=)"
        )
    return identity.source


def _same_model(saved: ModelIdentity, given: ModelIdentity, what: str) -> None:
    """The session's model is ``given`` (its cache settings aside: mlx-lm takes those
    as options, and the file's caches carry them); else the fields that differ are
    named (weights, config, model_type, tokenizer, chat_template, modules, draft)."""
    fields = [f for f in saved.diff(given) if not f.startswith("cache_config")]
    if fields:
        raise IdentityMismatchError(what, fields, saved.display(), given.display())


def mlx_lm_metadata(user: dict[str, str], model: str) -> dict[str, str]:
    """What ``mlx_lm.cache_prompt`` writes and ``mlx_lm generate --prompt-cache-file``
    reads: ``model`` (compared as a string with its --model, or loaded when that is
    not given) and ``tokenizer_config`` (JSON); the session's own metadata beside."""
    return {**user, "model": model, "tokenizer_config": json.dumps({})}
