"""Contract tests: fail in one place, by name, if mlx-lm's server changes what
``persist serve`` relies on.

persist serve runs ``mlx_lm.server.main`` after replacing names of that module
(``LRUPromptCache``, ``ResponseGenerator``, ``BatchGenerator``, ``stream_generate``,
``scan_cache_dir``, ``run``, ``_run_http_server``, ``ModelProvider._load``) and
subclasses or calls others (``APIHandler``, ``ResponseGenerator``,
``_make_sampler``...), several of them private.  Each is pinned here: it exists,
is the kind of object persist takes it for, takes the parameters persist passes,
sets the attributes persist reads, and is called by mlx-lm the way persist's
replacement expects (read from mlx-lm's source with ``ast``).  A last test finds
every name persist's serve modules touch and fails on one this file does not pin.
mlx-lm's ``LRUPromptCache.CacheOrder`` internals (``_lrus``, ``_ordering``, its
``pop`` rule), which ``serve/memory_order.py`` reads, are pinned by a property
test in tests/serve/test_memory_hints.py: without hints, the same victims.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import mlx_lm.server as server
import pytest
from mlx_lm.models import cache

from tests.helpers import ROOT

# the module, not the function mlx_lm's package exports under the same name
generate = importlib.import_module("mlx_lm.generate")


def params(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


def tree_of(fn: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def self_assigned(fn: Any) -> set[str]:
    """The attributes ``fn`` assigns on ``self``."""
    return {
        t.attr
        for node in ast.walk(tree_of(fn))
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def calls_to(fn: Any, name: str) -> list[ast.Call]:
    """The calls in ``fn`` of the plain name (or ``self.`` attribute) ``name``."""
    out = []
    for node in ast.walk(tree_of(fn)):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            if called == name:
                out.append(node)
    return out


# name in mlx_lm.server -> what persist does with it (the tests below check each)
PINNED = {
    "APIHandler": "subclassed: serve/handler.py PersistHandler",
    "ResponseGenerator": "subclassed (serve/generation.py) and replaced",
    "_make_sampler": "called: serve/generation.py check_sampling",
    "_make_logits_processors": "called: serve/generation.py check_sampling",
    "ModelProvider": "its _load replaced, its reset called: serve/model_identity.py",
    "stream_generate": "replaced: serve/prefill_rates.py, serve/penalty_context.py",
    "BatchGenerator": "subclassed and replaced: serve/prefill_rates.py",
    "LRUPromptCache": "replaced by a factory of PersistentPromptCache: serve/server.py",
    "scan_cache_dir": "wrapped: serve/handler.py models_without_hf_cache",
    "run": "wrapped: serve/server.py",
    "_run_http_server": "replaced by serve/http_edge.py serve_until_signal",
    "get_system_fingerprint": "called: serve/http_edge.py",
    "main": "called: serve/server.py serve",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_every_name_persist_touches_exists(name: str) -> None:
    assert hasattr(server, name), f"mlx_lm.server.{name} is gone ({PINNED[name]})"


def test_the_handler_persist_subclasses() -> None:
    h = server.APIHandler
    assert inspect.isclass(h) and issubclass(h, BaseHTTPRequestHandler)
    # serve_until_signal builds it as handler_class(response_generator, *a, system_fingerprint=)
    assert params(h.__init__)[:2] == ["self", "response_generator"]
    assert "system_fingerprint" in params(h.__init__)
    assert "response_generator" in self_assigned(h.__init__)
    for method in ("do_GET", "do_POST", "_set_cors_headers", "handle_models_request"):
        assert callable(getattr(h, method, None)), f"APIHandler.{method}"
    assert params(h._set_completion_headers) == ["self", "status_code"]
    # the models listing asks the module's scan_cache_dir, which persist wraps
    assert calls_to(h.handle_models_request, "scan_cache_dir")


def test_the_response_generator_persist_subclasses() -> None:
    g = server.ResponseGenerator
    assert inspect.isclass(g)
    assert params(g.__init__) == ["self", "model_provider", "prompt_cache"]
    assert {"model_provider", "requests", "_stop", "_generation_failed"} <= self_assigned(
        g.__init__
    )
    assert params(g._next_request) == ["self", "timeout"]
    assert params(g._tokenize) == ["self", "tokenizer", "request", "args"]
    assert params(g.generate) == ["self", "request", "generation_args", "progress_callback"]
    for method in ("_run_generate", "_generate", "generation_available", "stop_and_join"):
        assert params(getattr(g, method)) == ["self"], f"ResponseGenerator.{method}"
    # run() builds it as ResponseGenerator(model_provider, prompt_cache)
    (made,) = calls_to(server.run, "ResponseGenerator")
    assert len(made.args) == 2 and not made.keywords


def test_the_sampling_helpers_persist_calls() -> None:
    assert params(server._make_sampler) == ["args", "tokenizer"]
    assert params(server._make_logits_processors) == ["args"]


def test_the_model_provider_load_persist_replaces() -> None:
    p = server.ModelProvider
    # persist's _load calls the real one as real_load(self, model_path, adapter_path, draft)
    assert params(p._load)[:4] == ["self", "model_path", "adapter_path", "draft_model_path"]
    assert {"model", "tokenizer", "draft_model", "model_key"} <= self_assigned(p._load)
    # a load persist refuses is undone with it (serve/model_identity.py)
    assert params(p.reset) == ["self"] and "model_key" in self_assigned(p.reset)
    assert {"cli_args", "is_distributed"} <= self_assigned(p.__init__)


def test_the_generation_functions_persist_measures() -> None:
    # the server calls stream_generate with model=, prompt_cache= and logits_processors=
    # keywords, which prefill_rates and penalty_context read; each response carries
    # prompt_tokens and prompt_tps
    (call,) = calls_to(server.ResponseGenerator._serve_single, "stream_generate")
    assert {"model", "prompt_cache", "logits_processors"} <= {k.arg for k in call.keywords}
    fields = {f.name for f in dataclasses.fields(generate.GenerationResponse)}
    assert {"prompt_tokens", "prompt_tps"} <= fields
    b = server.BatchGenerator
    assert inspect.isclass(b) and b is generate.BatchGenerator
    assert params(b.next) == ["self"]
    assert {"model", "_counters"} <= self_assigned(b.__init__)
    counters = {f.name for f in dataclasses.fields(generate.BatchCounters)}
    assert {"prompt_tokens", "prompt_time"} <= counters


def test_the_prompt_cache_persist_replaces_and_subclasses() -> None:
    lru = cache.LRUPromptCache
    assert server.LRUPromptCache is lru
    assert params(lru.__init__) == ["self", "max_size", "max_bytes"]
    assert params(lru.fetch_nearest_cache) == ["self", "model", "tokens"]
    assert params(lru.insert_cache)[:4] == ["self", "model", "tokens", "prompt_cache"]
    assert "cache_type" in params(lru.insert_cache)
    for method in ("trim_to", "stats_by_type"):
        assert callable(getattr(lru, method, None)), f"LRUPromptCache.{method}"
    assert isinstance(inspect.getattr_static(lru, "nbytes"), property)
    # run() makes it with at most (max_size, max_bytes): what persist's factory takes
    (made,) = calls_to(server.run, "LRUPromptCache")
    assert len(made.args) <= 2 and {k.arg for k in made.keywords} <= {"max_size", "max_bytes"}
    # PersistentPromptCache sees evictions by wrapping _trie: they all go through _trie.pop
    assert callable(lru()._trie.pop)
    for evicting in (lru.insert_cache, lru.trim_to):
        assert calls_to(evicting, "pop"), f"LRUPromptCache.{evicting.__name__} evicts otherwise"


def test_the_server_entry_points_persist_wraps() -> None:
    # persist's run(host, port, model_provider, *args, **kwargs) calls the real one so
    assert params(server.run)[:3] == ["host", "port", "model_provider"]
    # run() calls _run_http_server(host, port, response_generator): serve_until_signal's
    # three positional parameters after the module
    assert params(server._run_http_server)[:3] == ["host", "port", "response_generator"]
    (call,) = calls_to(server.run, "_run_http_server")
    assert len(call.args) == 3 and not call.keywords
    assert params(server.get_system_fingerprint) == []
    # main() reads sys.argv (persist sets it) and calls run
    assert params(server.main) == []
    assert calls_to(server.main, "parse_args") and calls_to(server.main, "run")
    assert callable(server.scan_cache_dir)


def touched_names() -> dict[str, set[str]]:
    """Each name of mlx_lm.server that persist's serve modules import or use as an
    attribute of the module (bound to ``server`` or ``server_module``), by file."""
    files = [*(ROOT / "persist" / "serve").glob("*.py"), ROOT / "persist" / "cli" / "serve.py"]
    out: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.ImportFrom) and node.module == "mlx_lm.server":
                for alias in node.names:
                    out.setdefault(alias.name, set()).add(path.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("server", "server_module")
            ):
                name = node.attr
            if name is not None:
                out.setdefault(name, set()).add(path.name)
    return out


def test_every_name_persist_touches_is_pinned_here() -> None:
    touched = touched_names()
    assert {"APIHandler", "ModelProvider", "run", "main"} <= set(touched)  # the scan works
    unpinned = {n: sorted(f) for n, f in touched.items() if n not in PINNED}
    assert not unpinned, f"pin these mlx_lm.server names in this file: {unpinned}"
