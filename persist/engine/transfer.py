"""Sessions in and out of single files: persist files, and mlx-lm's prompt caches.

An mlx-lm prompt-cache file (``mlx_lm_files``: read, validated, and written)
records no tokens and no model identity: importing one, the caller says which
tokens it covers and for which model, and the cache is checked against both
here; exporting to one, the session is checked against the model it will claim.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import (
    IdentityMismatchError,
    InvalidArgumentError,
    ModelNotFoundError,
    NotResumableError,
    UnsupportedFormatError,
)
from ..format.opening import open_regular, user_reads
from ..identity import ModelIdentity
from .cache_fit import check_fits, check_quantized
from .files import load_file, save_file
from .mlx_lm_files import (
    check_named_model,
    is_mlx_lm,
    mlx_lm_classes_only,
    mlx_lm_metadata,
    read_mlx_lm,
    write_mlx_lm,
)
from .unverified import UNVERIFIED_KEY

__all__ = [
    "Importable",
    "read_importable",
    "check_readable",
    "export_row",
    "FORMATS",
    "check_fits",
]

FORMATS = ("persist", "mlx-lm")


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
    trust_model: bool = False,
) -> Importable:
    """A persist file as it is, or an mlx-lm prompt cache with the caller's tokens and
    model (whose own caches it must fit, ``check_fits``, when ``model`` is given).
    A persist file's model must be ``identity``'s (its cache settings are the file's
    own), and under ``key`` (the operator key) it must carry that key's tag.  The model
    an mlx-lm file names must be ``identity``'s unless ``trust_model``
    (``check_named_model``)."""
    if not is_mlx_lm(path):
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
    if not trust_model:
        check_named_model(metadata.get("model"), identity, str(path))
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


def write_file(
    path: str | os.PathLike[str],
    cache: list[Any],
    tokens: list[int],
    *,
    identity: ModelIdentity,
    metadata: dict[str, str],
    fmt: str = "persist",
    key: bytes | None = None,
    replace: bool = True,
) -> None:
    """``fmt`` persist (everything, verifiable; tagged under ``key``) or mlx-lm
    (caches and metadata only: mlx-lm reads no tag); ``replace`` as save_file's."""
    if fmt == "persist":
        save_file(path, cache, tokens, metadata=metadata, identity=identity, key=key,
                  replace=replace)  # fmt: skip
    elif fmt == "mlx-lm":
        write_mlx_lm(path, cache, metadata, replace=replace)
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
    replace: bool = True,
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
    write_file(path, cache, toks, identity=identity, metadata=meta, fmt=format, key=key,
               replace=replace)  # fmt: skip


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
