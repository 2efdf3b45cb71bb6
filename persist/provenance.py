"""Load provenance: when a remembered weights digest may stand for a model in memory.

Hashing every weight costs about 0.2 s per GiB, so the digest of a model's
files is remembered (``weights_memo``).  But a digest remembered by files is
only true of a model that still holds what was loaded from them: weights
fused with a LoRA adapter, cast and cast back, quantized, updated or loaded
over in memory are other weights of the same names.  So the memo is used
only for a model persist itself has just loaded (``load_model``, or
``stamp`` right after mlx-lm loaded it, before any other code could touch
it): that records on the model where it came from, its digest and a weak
reference to every parameter array.  ``remembered`` gives the digest back
only while every parameter is still the very same array object, nothing
added or removed, and every module's class and settings unchanged
(``structure``).  Casting, quantizing, fusing, ``update`` and
``load_weights`` all put new array objects in place, so they are seen.

Not seen: a write into a weight array in place (``w[...] = x``, ``w += x``),
which keeps the Python object.  Code that edits weights so should pass no
``path`` to ``ModelIdentity.of`` (every weight hashed).

What a module computes with is more than its parameters: RoPE's base and
frequencies, an attention scale, a layer's window are plain attributes or
arrays under private names, which ``parameters()`` leaves out.  Replaced in
code after loading (context extension, another RoPE), they change every
logit and no parameter.  ``modules_digest`` covers them, always computed
(cheap, never remembered): the identity's ``modules`` field.
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import Any

import xxhash

from . import weights_memo

__all__ = [
    "load_model",
    "stamp",
    "remembered",
    "weights_digest",
    "structure",
    "modules_digest",
    "versions",
]

ATTR = "_persist_provenance"  # a plain object: nn.Module keeps dicts/lists/arrays as parameters
MODULE_SETTINGS = ("group_size", "bits", "mode", "scale")  # what a layer computes with, not held


class Provenance:
    """Where a model came from, as ``stamp`` saw it.  Not a dataclass: the identity
    digests every dataclass a model holds as configuration (``config_digest``)."""

    __slots__ = ("arrays", "digest", "files", "structure")

    def __init__(
        self,
        files: tuple[str, str | None],  # the resolved model and adapter folders
        digest: str,
        structure: str,
        arrays: tuple[tuple[str, weakref.ref[Any]], ...],  # every parameter as loaded
    ) -> None:
        self.files, self.digest, self.structure, self.arrays = files, digest, structure, arrays


def load_model(
    path: str | os.PathLike[str], adapter_path: str | os.PathLike[str] | None = None, **kw: Any
) -> Any:
    """``mlx_lm.load(path, adapter_path=..., **kw)``, its model stamped (``stamp``): what
    it returns, so ``ModelIdentity.of(model, path=path)`` may use the memo.  Not
    stamped with a ``model_config``: overrides the memo's key does not hold."""
    from mlx_lm import load

    adapter = None if adapter_path is None else str(adapter_path)
    loaded = load(str(path), adapter_path=adapter, **kw)
    if not kw.get("model_config"):
        stamp(loaded[0], path, adapter)
    return loaded


def stamp(
    model: Any, path: str | os.PathLike[str], adapter: str | os.PathLike[str] | None = None
) -> None:
    """Record that ``model`` is what mlx-lm loaded from ``path`` (and ``adapter``).  Call
    only right after the load, before any other code could touch the model: its
    digest is remembered for those files (computed once, then looked up)."""
    if not Path(path).is_dir() or (adapter is not None and not Path(adapter).is_dir()):
        return  # no files to key the memo by: hashed when an identity is asked for
    shape = structure(model)
    dirs = [Path(path), None if adapter is None else Path(adapter)]
    key = weights_memo.files_key(dirs, versions(), shape)
    digest = weights_memo.recall(key)
    if digest is None:
        digest = weights_digest(model)
        weights_memo.remember(key, digest)
    arrays = tuple((name, weakref.ref(arr)) for name, arr in _params(model))
    setattr(model, ATTR, Provenance(_files(path, adapter), digest, shape, arrays))


def remembered(
    model: Any, path: str | os.PathLike[str], adapter: str | os.PathLike[str] | None
) -> str | None:
    """The digest ``stamp`` recorded, if ``model`` came from these files and still holds
    every array it was loaded with (and only those) in modules unchanged; else None."""
    prov = getattr(model, ATTR, None)
    if not isinstance(prov, Provenance) or prov.files != _files(path, adapter):
        return None
    params = _params(model)
    if len(params) != len(prov.arrays):
        return None
    loaded = dict(prov.arrays)
    for name, arr in params:
        ref = loaded.get(name)
        if ref is None or ref() is not arr:
            return None
    return prov.digest if structure(model) == prov.structure else None


def _files(
    path: str | os.PathLike[str], adapter: str | os.PathLike[str] | None
) -> tuple[str, str | None]:
    return str(Path(path).resolve()), None if adapter is None else str(Path(adapter).resolve())


def _params(model: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    out: Any = tree_flatten(model.parameters())
    return list(out)


def weights_digest(model: Any) -> str:
    """Every parameter's name, dtype, shape and bytes, hashed (the weights digest)."""
    from .format.tensors import as_bytes  # mlx: only when weights are hashed

    h = xxhash.xxh3_128()
    for name, arr in sorted(_params(model), key=lambda kv: kv[0]):
        h.update(f"{name}|{arr.dtype}|{tuple(arr.shape)}|".encode())
        h.update(as_bytes(arr))
    return h.hexdigest()


def structure(model: Any) -> str:
    """What the model in memory is, without reading a weight: every parameter's
    name, dtype and shape, every module's class and settings (quantization's
    group size, bits and mode; a LoRA layer's scale)."""
    h = xxhash.xxh3_128()
    for name, arr in sorted(_params(model), key=lambda kv: kv[0]):
        h.update(f"{name}|{arr.dtype}|{tuple(arr.shape)}\n".encode())
    modules = model.named_modules() if hasattr(model, "named_modules") else []
    for where, mod in sorted(modules, key=lambda kv: kv[0]):
        settings = [
            (k, v)
            for k in MODULE_SETTINGS
            if isinstance(v := getattr(mod, k, None), (int, float, str))
        ]
        h.update(f"{where}|{class_name(mod)}|{settings}\n".encode())
    return h.hexdigest()


PLAIN = (bool, int, float, str, type(None))
# A class attribute naming the class a module computes as: persist's own subclasses that
# only observe (caches/gated_delta's recording layers) are digested as their base.
SAME_AS = "_persist_same_as"


def class_name(module: Any) -> str:
    cls = type(module)
    same = vars(cls).get(SAME_AS)  # the class's own: a subclass of it computes as itself
    cls = same if isinstance(same, type) and issubclass(cls, same) else cls
    return f"{cls.__module__}.{cls.__qualname__}"


SKIP = object()  # a value that is no module state (a function, an object) or a parameter


def modules_digest(model: Any) -> str:
    """Every module (sorted by path): its class and its state that is not a parameter:
    plain scalars (int, float, bool, str, None) and lists/tuples of them, in its
    attributes and its dict, and every array it holds that ``parameters()`` leaves
    out (private names such as RoPE's ``_freqs``, tuples): dtype, shape and bytes.
    Child modules are visited at their own paths; parameters are the weights
    digest's.  No object ids, addresses or reprs: two loads digest alike."""
    params = {id(a) for _, a in _params(model)}  # membership only, never hashed
    h = xxhash.xxh3_128()
    modules = model.named_modules() if hasattr(model, "named_modules") else [("", model)]
    for where, mod in sorted(modules, key=lambda kv: kv[0]):
        found: list[Any] = [where, class_name(mod)]
        own = vars(mod) if hasattr(mod, "__dict__") else {}
        items = dict(mod) if isinstance(mod, dict) else {}
        for source, entries in (("attr", own), ("item", items)):
            for key in sorted(entries, key=str):
                state = _state(entries[key], params)
                if state is not SKIP:
                    found.append([source, str(key), state])
        h.update(json.dumps(found, separators=(",", ":")).encode() + b"\n")
    return h.hexdigest()


def _state(value: Any, params: set[int]) -> Any:
    """A JSON-able, deterministic encoding of one value's module state, or SKIP."""
    import mlx.core as mx

    if type(value) in PLAIN:
        return ["float", value.hex()] if type(value) is float else value
    if isinstance(value, mx.Dtype):
        return ["dtype", str(value)]
    if isinstance(value, mx.array):
        if id(value) in params:
            return SKIP
        from .format.tensors import as_bytes

        digest = xxhash.xxh3_128(as_bytes(value)).hexdigest()
        return ["array", str(value.dtype), list(value.shape), digest]
    if hasattr(value, "named_modules"):
        return SKIP  # a child module: visited at its own path
    if isinstance(value, (list, tuple)):
        inner = [_state(v, params) for v in value]
        if all(v is SKIP for v in inner):
            return SKIP
        return [type(value).__name__, [None if v is SKIP else v for v in inner]]
    if isinstance(value, dict):
        kept = {str(k): _state(v, params) for k, v in value.items()}
        kept = {k: v for k, v in sorted(kept.items()) if v is not SKIP}
        return ["dict", kept] if kept else SKIP
    return SKIP


def versions() -> dict[str, str]:
    """The mlx, mlx-lm and persist versions (recorded in identities, part of memo keys)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("mlx", "mlx-lm", "mlx-persist"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out
