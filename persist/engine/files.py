"""One self-contained file per cache: a drop-in for mlx-lm's save/load_prompt_cache.

``save_file`` streams live tensors into a safetensors file with a msgpack
manifest in its header and writes atomically (tmp, fsync, rename, fsync the
directory).  ``load_file`` validates the header and the manifest, refuses
unknown kinds and newer codecs, then loads and verifies every tensor's
checksum before it builds a single cache object.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from ..codecs import capacity_of, check_spec
from ..codecs.base import dtype_name
from ..codecs.snapshot import capture, rebuild, require_covers
from ..errors import (
    AlreadyExistsError,
    CorruptBlobError,
    ExportTargetError,
    PersistError,
    StorageError,
)
from ..format.container import Header, Producer, read_header, write_tensors
from ..format.manifest import (
    Manifest,
    check_metadata,
    file_metadata,
    pack_manifest,
    tensor_keys,
    unpack_manifest,
)
from ..format.opening import open_regular, user_reads
from ..format.sink import atomic_write, tmp_beside
from ..format.tensors import allocate, as_bytes, read_piece
from ..identity import ModelIdentity
from ..records import Record, RecordSpec, TensorSpec
from . import file_tags

__all__ = ["save_file", "load_file", "read_manifest", "Loaded", "user_writes", "already_there"]

FILE_MODE = 0o600


@dataclass(frozen=True)
class Loaded:
    """What ``load_file`` returns: the live caches and what they cover."""

    cache: list[Any]
    tokens: list[int] | None
    metadata: dict[str, str] = field(default_factory=dict)
    identity: ModelIdentity | None = None


def save_file(
    path: str | os.PathLike[str],
    cache: Sequence[Any],
    tokens: Sequence[int] | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
    identity: ModelIdentity | None = None,
    key: bytes | None = None,
    replace: bool = True,
) -> None:
    """Save a model's cache list (and the tokens it covers) to one file.

    Only live data is written.  With ``tokens`` every layer's offset must
    equal ``len(tokens)`` (``NotResumableError`` otherwise).  ``key`` (the
    operator key): the file carries its tag (``file_tags``), which an import
    under that key requires.  ``replace`` False: a file at ``path``, even one
    made while this one was written, is AlreadyExistsError and stays as it was.
    """
    meta = check_metadata(metadata)
    snap = capture(list(cache), tokens)
    flat = list(tensor_keys(snap.records))
    specs = {k: TensorSpec(dtype_name(r.tensors[n]), tuple(r.tensors[n].shape)) for k, r, n in flat}
    ident = identity.to_dict() if identity is not None else None

    def manifest_meta(sums: dict[str, bytes]) -> dict[str, str]:
        body = pack_manifest(
            snap.records,
            specs,
            sums,
            tokens=snap.tokens,
            metadata=meta,
            identity=ident,
            created=created,
        )
        out = file_metadata(body)
        if key is not None:
            out[file_tags.TAG_FIELD] = data.tag(key, body)
        return out

    created = time.time()
    data = file_tags.DataDigest(len(flat))
    items: list[tuple[str, TensorSpec, Producer]]
    items = [(k, specs[k], partial(as_bytes, r.tensors[n])) for k, r, n in flat]
    if key is not None:  # hashed for the tag only under a key (SHA-256: ~1.5 GB/s)
        items = [(k, spec, data.wrap(produce)) for k, spec, produce in items]
    size = sum(s.nbytes for s in specs.values())
    with user_writes(path):
        tmp = tmp_beside(path)  # the container's one atomic write path
        write = partial(write_tensors, tensors=items, metadata=manifest_meta)
        atomic_write(tmp, path, write, size, FILE_MODE, replace=replace)


@contextlib.contextmanager
def user_writes(path: str | os.PathLike[str]) -> Iterator[None]:
    """Writes of a file the user named: what the system refuses (a folder that is not
    there, read-only or not ours, a name too long, a full disk) is StorageError."""
    try:
        yield
    except PersistError:
        raise
    except FileExistsError:  # only a writer told not to replace raises it
        raise already_there(path) from None
    except OSError as e:
        gone = isinstance(e, FileNotFoundError) and not os.path.isdir(_folder(path))
        # the user's name, never the temporary file's beside it (attack r13c)
        named = OSError(e.errno, e.strerror, os.fspath(path)) if e.errno else e
        raise StorageError(
            f"cannot write {path}{' (its folder does not exist)' * gone}", named
        ) from e


def already_there(path: str | os.PathLike[str]) -> AlreadyExistsError:
    """What a write told not to replace says of a file at ``path``."""
    return AlreadyExistsError(
        f"{path} exists; nothing was written (persist export --force, or replace=True, replaces it)"
    )


def _folder(path: str | os.PathLike[str]) -> str:
    return os.path.dirname(os.fspath(path)) or "."


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a folder",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


def check_export_target(
    store_root: str | os.PathLike[str], path: str | os.PathLike[str], replace: bool = True
) -> None:
    """ExportTargetError where an export to ``path`` would replace something by its
    rename: a file of the store (its index, a blob: every session, or one, lost), or
    whatever is there that is not a regular file (a FIFO, a device node: as root,
    ``/dev/null`` itself; a link, judged as refused rather than by where it leads).
    A regular file (an earlier export) is what --force may replace; without
    ``replace`` it is AlreadyExistsError (checked again as the file is placed)."""
    target = Path(os.path.abspath(path))
    root = Path(os.path.realpath(store_root))
    where = Path(os.path.realpath(target.parent)) / target.name  # the folder's links followed
    if where == root or root in where.parents:
        raise ExportTargetError(path, f"inside the store at {root}")
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as e:  # under a file, a loop of links, a name too long (attack 38c)
        raise ExportTargetError(path, f"cannot be written there: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ExportTargetError(path, f"{_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}")
    if not replace:
        raise already_there(path)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Validate a file's header and manifest (kinds included) without loading tensors."""
    where = str(path)
    with user_reads(where), _open(path) as f:
        header = read_header(f, where)
    return _checked_manifest(header, where)


def _checked_manifest(header: Header, where: str) -> Manifest:
    manifest = unpack_manifest(header, where)
    for i, spec in enumerate(manifest.layers):
        _check_layer(spec, i, where)
    return manifest


def _open(path: str | os.PathLike[str]) -> BinaryIO:
    return open_regular(path, user=True)  # never a wait on a FIFO; typed refusals


def _check_layer(spec: RecordSpec, i: int, where: str) -> None:
    try:
        check_spec(spec)
    except CorruptBlobError as e:
        raise CorruptBlobError(where, f"layer {i}: {e}") from None


def load_file(
    path: str | os.PathLike[str],
    *,
    identity: ModelIdentity | None = None,
    key: bytes | None = None,
) -> Loaded:
    """Load a file written by ``save_file``; every checksum is verified.

    With ``identity`` a file saved for another model is refused
    (``IdentityMismatchError`` naming the fields that differ).  With ``key``
    (the operator key) a file without that key's tag over its manifest and
    data is refused (``UnauthenticatedFileError``), before it is parsed.
    The header, the tag and the tensors are read from one open file.
    """
    where = str(path)
    with user_reads(where), _open(path) as f:  # a refused read: StorageError, one line
        header = read_header(f, where)
        if key is not None:
            file_tags.verify(f.fileno(), header, key, where)
        manifest = _checked_manifest(header, where)
        saved = _saved_identity(manifest, where)
        if identity is not None and saved is not None:
            saved.require_same(identity, f"file {where}")
        # One layer at a time, read straight into the buffers the caches keep:
        # peak memory is the restored cache itself.
        keys = iter(manifest.keys)
        cache = [
            rebuild([_read_layer(f.fileno(), s, keys, manifest, where)])[0] for s in manifest.layers
        ]
    if manifest.tokens is not None:
        # The snapshot rule, re-checked on the rebuilt cache: a file cannot
        # pair a cache with tokens it does not cover.
        require_covers(cache, manifest.tokens)
    return Loaded(cache, manifest.tokens, manifest.metadata, saved)


def _saved_identity(manifest: Manifest, where: str) -> ModelIdentity | None:
    if manifest.identity is None:
        return None
    try:
        return ModelIdentity.from_dict(manifest.identity)
    except (ValueError, TypeError) as e:
        raise CorruptBlobError(where, f"manifest: identity: {e}") from None


def _read_layer(fd: int, spec: RecordSpec, keys: Any, manifest: Manifest, where: str) -> Record:
    """Read one record of a persist file (and its inner records), verified."""
    mapping = next(keys)
    caps = capacity_of(spec)
    tensors = {}
    for name, key in mapping.items():
        stored = manifest.specs[key]
        out, view = allocate(stored, caps.get(name))
        read_piece(
            fd,
            manifest.offsets[key],
            stored,
            view,
            alloc_shape=tuple(out.shape),
            at=0,
            axis=2,
            want=manifest.checksums[key],
            where=f"{where}: tensor {key!r}",
        )
        tensors[name] = out
    kids = tuple(_read_layer(fd, c, keys, manifest, where) for c in spec.children)
    return Record(spec.kind, spec.version, spec.meta, tensors, kids)
