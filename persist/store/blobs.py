"""Blob files behind a small interface, so a shared backend can replace them.

Layout::

    <root>/blobs/ab/<key>.<salt>.safetensors   immutable once renamed into place
    <root>/tmp/<pid>-<random>.tmp              partial writes; garbage after a crash

``key`` is the blob's namespace-salted content key; ``salt`` makes every
written file name unique, so a concurrent garbage collection that deletes an
unreferenced file can never delete another writer's fresh copy of the same
content.  Write protocol: tmp file, fsync, rename, fsync the directory.
No mlx here.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

import msgpack

from ..errors import CorruptBlobError
from ..stfile import CHECKSUM_BYTES, Header, Sink, fsync_dir

__all__ = ["BlobStore", "FileBlobs", "FILE_RE", "blob_metadata", "blob_manifest"]

BLOB_FORMAT = "persist-blob"

T = TypeVar("T")
FILE_RE = re.compile(r"[0-9a-f]{32}\.[0-9a-f]{12}")
DIR_MODE = 0o700
FILE_MODE = 0o600


class BlobStore(Protocol):
    def put(
        self, key: str, write: Callable[[Sink], T], size_hint: int = 0, salt: str | None = None
    ) -> tuple[str, int, T]: ...

    def open(self, file: str) -> BinaryIO: ...

    def exists(self, file: str) -> bool: ...

    def delete(self, file: str) -> None: ...

    def files(self) -> Iterator[str]: ...


class FileBlobs:
    """Blobs as files under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.tmp = root / "tmp"
        for d in (self.blobs, self.tmp):
            d.mkdir(mode=DIR_MODE, exist_ok=True)

    def path(self, file: str) -> Path:
        if not FILE_RE.fullmatch(file):
            raise ValueError(f"not a blob file name: {file!r}")
        return self.blobs / file[:2] / f"{file}.safetensors"

    def put(
        self, key: str, write: Callable[[Sink], T], size_hint: int = 0, salt: str | None = None
    ) -> tuple[str, int, T]:
        """Write a new blob; ``write`` streams into the sink and finishes (fsyncs) it.

        ``salt`` (12 hex digits) ends the file name: a save registers it as
        pending, so ``check`` does not take its uncommitted files for orphans.
        """
        file = f"{key}.{salt or secrets.token_hex(6)}"
        final = self.path(file)
        tmp = self.tmp / f"{os.getpid()}-{secrets.token_hex(8)}.tmp"
        sink = Sink(tmp, FILE_MODE, size_hint)
        try:
            result = write(sink)
            size = sink.size
            sink.close()
            if not final.parent.is_dir():
                final.parent.mkdir(mode=DIR_MODE, exist_ok=True)
                fsync_dir(self.blobs)
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            sink.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return file, size, result

    def open(self, file: str) -> BinaryIO:
        return open(self.path(file), "rb")

    def exists(self, file: str) -> bool:
        return self.path(file).is_file()

    def delete(self, file: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(file))

    def files(self) -> Iterator[str]:
        """Every well-formed blob file name on disk."""
        for sub in sorted(self.blobs.iterdir()):
            if sub.is_dir():
                for p in sorted(sub.iterdir()):
                    name = p.name.removesuffix(".safetensors")
                    if p.name != name and FILE_RE.fullmatch(name) and name[:2] == sub.name:
                        yield name

    def stray_files(self) -> Iterator[Path]:
        """Anything under blobs/ that is not a well-formed blob file name."""
        for sub in sorted(self.blobs.iterdir()):
            if not sub.is_dir():
                yield sub
                continue
            for p in sorted(sub.iterdir()):
                name = p.name.removesuffix(".safetensors")
                if p.name == name or not FILE_RE.fullmatch(name) or name[:2] != sub.name:
                    yield p

    def tmp_files(self) -> Iterator[Path]:
        yield from sorted(self.tmp.iterdir())


def blob_metadata(role: str, sums: dict[str, bytes]) -> dict[str, str]:
    body = msgpack.packb({"role": role, "tensors": sums}, use_bin_type=True)
    return {
        "format": BLOB_FORMAT,
        "format_version": "1",
        "manifest": base64.b64encode(body).decode("ascii"),
    }


def blob_manifest(header: Header, where: str) -> dict[str, bytes]:
    """Checksums per tensor from a blob's header (the header itself was verified)."""
    meta = header.metadata
    if meta.get("format") != BLOB_FORMAT or meta.get("format_version") != "1":
        raise CorruptBlobError(where, "not a persist blob")
    try:
        body = msgpack.unpackb(
            base64.b64decode(meta.get("manifest", ""), validate=True),
            raw=False,
            max_bin_len=1 << 24,
            max_str_len=1 << 20,
        )
        sums = body["tensors"]
        assert isinstance(sums, dict) and set(sums) == set(header.tensors)
        assert all(isinstance(v, bytes) and len(v) == CHECKSUM_BYTES for v in sums.values())
    except Exception:
        raise CorruptBlobError(where, "malformed blob manifest") from None
    return sums
