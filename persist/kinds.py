"""The kind registry: every cache class has a stable kind string.

Routing by cache type (codec choice, capability predicates) compares kind
strings from this registry, never class names read from a file.  Lookups are
by *exact* class: a subclass is unknown until it is registered itself.

Grammar::

    kind := name | name "(" kind ("," kind)* ")"
    name := [a-z][a-z0-9-]*
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .errors import InvalidArgumentError, InvalidMetadataError, UnknownKindError
from .records import Record, RecordSpec, ResumeFacts

__all__ = [
    "Codec",
    "KindNode",
    "parse_kind",
    "register_kind",
    "register_lazy_kind",
    "kind_of",
    "codec_for",
    "class_for",
    "require_known",
    "has_capability",
    "is_recurrent",
    "is_rotating",
    "is_quantized",
    "is_batched",
    "is_wrapper",
    "registered_kinds",
]

NAME_RE = re.compile(r"[a-z][a-z0-9-]*")
MAX_KIND_LEN = 1024
MAX_KIND_DEPTH = 8


@runtime_checkable
class Codec(Protocol):
    """Turns one live cache of one kind into a Record and back.

    The registry binds a codec to a class and a kind name, so one codec can
    serve several classes (``register_kind(MyKV, "my-kv", codec_for("kv"))``):
    ``encode`` is told the kind string to record, ``decode`` the class to build.
    ``wrapper`` codecs hold inner caches (``children``) and report
    ``name(inner,...)``.  ``capabilities`` feed the predicates below.
    """

    version: int
    wrapper: bool
    capabilities: frozenset[str]

    def children(self, cache: Any) -> list[Any]: ...

    def encode(self, cache: Any, kind: str) -> Record: ...

    def check(self, spec: RecordSpec) -> None: ...

    def decode(self, record: Record, cls: type[Any]) -> Any: ...

    def facts(self, cache: Any) -> ResumeFacts: ...


@dataclass(frozen=True)
class KindNode:
    name: str
    args: tuple[KindNode, ...] = ()

    def __str__(self) -> str:
        if not self.args:
            return self.name
        return f"{self.name}({','.join(str(a) for a in self.args)})"

    def walk(self) -> list[KindNode]:
        out = [self]
        for a in self.args:
            out.extend(a.walk())
        return out


_lock = threading.Lock()
_by_class: dict[type, str] = {}
_codecs: dict[str, Codec] = {}
_by_name: dict[str, type] = {}
# Kinds whose class lives in a module persist does not import up front (a
# model file): kind name -> (module, class name, codec).  The class is taken
# from that module, never from a name read from a file.
_lazy: dict[str, tuple[str, str, Codec]] = {}


def parse_kind(text: str) -> KindNode:
    """Parse a kind string; raise UnknownKindError if it is not well formed."""
    if not isinstance(text, str) or not text or len(text) > MAX_KIND_LEN:
        raise UnknownKindError(str(text)[:80], "malformed kind string")
    return _parse_cached(text)


@functools.lru_cache(maxsize=1024)
def _parse_cached(text: str) -> KindNode:
    node, pos = _parse(text, 0, 0)
    if pos != len(text):
        raise UnknownKindError(text, f"malformed kind string at position {pos}")
    return node


def _parse(text: str, pos: int, depth: int) -> tuple[KindNode, int]:
    if depth > MAX_KIND_DEPTH:
        raise UnknownKindError(text, "kind nested too deeply")
    m = NAME_RE.match(text, pos)
    if not m:
        raise UnknownKindError(text, f"malformed kind string at position {pos}")
    name, pos = m.group(0), m.end()
    if pos < len(text) and text[pos] == "(":
        args = []
        while True:
            arg, pos = _parse(text, pos + 1, depth + 1)
            args.append(arg)
            if pos < len(text) and text[pos] == ",":
                continue
            if pos < len(text) and text[pos] == ")":
                return KindNode(name, tuple(args)), pos + 1
            raise UnknownKindError(text, f"malformed kind string at position {pos}")
    return KindNode(name), pos


def register_kind(cls: type, name: str, codec: Codec) -> None:
    """Register ``cls`` (exactly that class) under kind ``name`` with ``codec``.

    A subclass that stores exactly like its base registers in one line::

        persist.register_kind(MyKV, "my-kv", persist.codec_for("kv"))
    """
    if not isinstance(cls, type):
        raise InvalidMetadataError(f"register_kind needs a class, got {cls!r}")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidArgumentError(f"kind name {name!r} must match [a-z][a-z0-9-]*")
    if not isinstance(codec, Codec):
        raise InvalidMetadataError(f"{codec!r} is not a codec (encode, check, decode, facts, ...)")
    with _lock:
        old = _by_class.get(cls)
        if old is not None and old != name:
            raise InvalidArgumentError(f"{cls.__qualname__} is already registered as kind {old!r}")
        owner = _by_name.get(name)
        if owner is not None and owner is not cls:
            raise InvalidArgumentError(
                f"kind {name!r} is already registered to {owner.__qualname__}"
            )
        _by_class[cls] = name
        _by_name[name] = cls
        _codecs[name] = codec


def register_lazy_kind(name: str, module: str, attr: str, codec: Codec) -> None:
    """Register kind ``name`` for class ``module.attr`` once that module is in use."""
    with _lock:
        _lazy[name] = (module, attr, codec)


def _load_lazy(name: str, *, import_module: bool) -> None:
    entry = _lazy.get(name)
    if entry is None or name in _codecs:
        return
    module, attr, codec = entry
    mod = sys.modules.get(module)
    if mod is None and import_module:
        mod = importlib.import_module(module)
    if mod is not None:
        register_kind(getattr(mod, attr), name, codec)


def _lazy_for_class(cls: type) -> None:
    for name, (module, attr, _) in list(_lazy.items()):
        if cls.__module__ == module and cls.__qualname__ == attr:
            _load_lazy(name, import_module=False)


def kind_of(cache: Any) -> str:
    """The full kind string of a live cache, looked up by its exact class."""
    if type(cache) not in _by_class:
        _lazy_for_class(type(cache))
    name = _by_class.get(type(cache))
    if name is None:
        t = type(cache)
        raise UnknownKindError(
            f"{t.__module__}.{t.__qualname__}",
            "this class is not registered (subclasses are not their base's kind); "
            "register it with persist.register_kind(cls, name, codec)",
        )
    codec = _codecs[name]
    if not codec.wrapper:
        return name
    inner = [kind_of(c) for c in codec.children(cache)]
    if not inner:
        raise UnknownKindError(name, "a wrapper cache that holds no inner caches")
    return f"{name}({','.join(inner)})"


def codec_for(name: str) -> Codec:
    """The codec registered for kind ``name`` (the outer name of a wrapper kind)."""
    node = parse_kind(name)
    _load_lazy(node.name, import_module=True)
    codec = _codecs.get(node.name)
    if codec is None:
        raise UnknownKindError(name, "no codec is registered for it in this process")
    return codec


def class_for(name: str) -> type:
    """The class registered under the outer name of ``name``."""
    node = parse_kind(name)
    _load_lazy(node.name, import_module=True)
    cls = _by_name.get(node.name)
    if cls is None:
        raise UnknownKindError(name, "no class is registered for it in this process")
    return cls


def require_known(kind: str) -> KindNode:
    """Parse ``kind`` and check that every name in it has a codec of the right shape."""
    root = parse_kind(kind)
    for node in root.walk():
        _load_lazy(node.name, import_module=True)
        codec = _codecs.get(node.name)
        if codec is None:
            raise UnknownKindError(
                kind, f"no codec for {node.name!r} is registered in this process"
            )
        if codec.wrapper != bool(node.args):
            want = "inner kinds" if codec.wrapper else "no inner kinds"
            raise UnknownKindError(kind, f"{node.name!r} takes {want}")
    return root


def has_capability(kind: str, capability: str) -> bool:
    """True if any cache in ``kind`` (outer or inner) has ``capability``."""
    root = require_known(kind)
    return any(capability in _codecs[n.name].capabilities for n in root.walk())


def is_recurrent(kind: str) -> bool:
    return has_capability(kind, "recurrent")


def is_rotating(kind: str) -> bool:
    return has_capability(kind, "rotating")


def is_quantized(kind: str) -> bool:
    return has_capability(kind, "quantized")


def is_batched(kind: str) -> bool:
    return has_capability(kind, "batched")


def is_wrapper(kind: str) -> bool:
    return bool(require_known(kind).args)


def registered_kinds() -> dict[str, str]:
    """Kind name -> qualified class name, for diagnostics."""
    with _lock:
        return {n: f"{c.__module__}.{c.__qualname__}" for n, c in _by_name.items()}
