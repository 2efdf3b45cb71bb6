"""The operator key's tag on a persist file: who may hand this store a cache by file.

A persist file's checksums (``manifest_xxh3``, every tensor's xxh3-128) catch damage,
not edits: anyone can recompute them.  An outside attack relabelled model A's export
as model B's (and another one replaced its tokens), recomputed them, and
``persist import`` stored the cache and served it.  Under the operator key
(``PERSIST_TIER_KEY``, the key that already authenticates the shared and cold tiers)
an export carries ``persist_tag``: HMAC-SHA256 over the manifest's bytes (identity,
tokens, layers, tensor checksums) and the SHA-256 of every tensor byte as written;
an import under the key refuses a file without that tag or with a wrong one.
Without a key a file is trusted as written (docs/FORMAT.md).  No mlx.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Sequence

from ..errors import CorruptBlobError, UnauthenticatedFileError
from ..format.container import Header, Producer

__all__ = ["TAG_FIELD", "DataDigest", "file_key", "tag", "verify"]

TAG_FIELD = "persist_tag"
LABEL = b"persist-file"
PLACEHOLDER = "0" * 64  # the header is sized before the data is hashed: same length
CHUNK = 8 << 20


def file_key(explicit: bytes | None) -> bytes | None:
    """The operator key: ``explicit`` (``Store(tier_key=...)``, ``--tier-key-file``),
    else ``$PERSIST_TIER_KEY``, else None (files are trusted as written)."""
    from .tiers.records import check_key, tier_key_from_env

    return check_key(explicit) if explicit is not None else tier_key_from_env()


class DataDigest:
    """SHA-256 of the tensor bytes in the order they are written (the file's order)."""

    def __init__(self, tensors: int) -> None:
        self.hash = hashlib.sha256()
        self.left = tensors  # producers not yet called: the tag waits for all of them

    def wrap(self, produce: Producer) -> Producer:
        def hashed() -> Sequence[memoryview]:
            data = produce()
            parts = [data] if isinstance(data, memoryview) else list(data)
            for part in parts:
                self.hash.update(part)
            self.left -= 1
            return parts

        return hashed

    def tag(self, key: bytes, manifest: bytes) -> str:
        """The tag, once every tensor went by; before that the placeholder."""
        return PLACEHOLDER if self.left else tag(key, manifest, self.hash.digest())


def tag(key: bytes, manifest: bytes, data_sha256: bytes) -> str:
    h = hmac.new(key, LABEL + b"\0", hashlib.sha256)
    for part in (manifest, data_sha256):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def verify(fd: int, header: Header, key: bytes, where: str) -> None:
    """Refuse the file open as ``fd`` unless ``header`` carries this key's tag over its
    manifest and its data (``UnauthenticatedFileError``), before anything is parsed."""
    got = header.metadata.get(TAG_FIELD)
    if got is None:
        raise UnauthenticatedFileError(
            where,
            "carries no tag of the operator key (it was exported without the key, or by "
            "a persist before round 5); import it without the key only if you trust it",
        )
    try:
        manifest = base64.b64decode(header.metadata.get("manifest", ""), validate=True)
    except (binascii.Error, ValueError):
        raise CorruptBlobError(where, "manifest is not base64") from None
    data = hashlib.sha256()
    pos = header.data_start
    while pos < header.file_size:
        chunk = os.pread(fd, min(CHUNK, header.file_size - pos), pos)
        if not chunk:
            raise CorruptBlobError(where, f"file ends at byte {pos} of {header.file_size}")
        data.update(chunk)
        pos += len(chunk)
    if not hmac.compare_digest(got.encode(), tag(key, manifest, data.digest()).encode()):
        raise UnauthenticatedFileError(
            where,
            "its tag is not the operator key's: the file was changed after its export, "
            "or exported under another key",
        )
