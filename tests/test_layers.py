"""The package's import arrows, from an AST pass over every module (imports in
functions and under TYPE_CHECKING count too): each layer imports only the
layers listed for it, and no two modules import each other, directly or round
a longer circle.

    cli -> {serve, apps} -> engine -> {codecs, storage, remote, cuda, policy, format, identity}
        serve -> apps;  codecs -> {format, policy, kinds, caches, cuda}
        storage -> {format, policy}
        remote, cuda, format -> {records, errors};  everything -> {records, errors}

Runtime guarantees (what ``import persist`` really loads) live in test_imports.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "persist"

# layer -> the layers it may import (besides itself).  One place, read top-down.
BASE = {"errors", "records"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "records": {"errors"},
    "policy": BASE,
    # which prefix lengths a layer's recorded facts serve: one pure rule per kind
    "servable": BASE,
    "kinds": BASE,
    # which cache objects came from an unverified session (no mlx): codecs and engine ask
    "marks": set(),
    # background work that gives way to requests (no mlx): its loops call pause()
    "yielding": set(),
    # folders only their owner may change (the store and the digest memo share it)
    "private_files": set(),
    # where a model's name leads: a folder, or a repo id in the Hugging Face cache
    "model_folders": BASE,
    "weights_memo": {"private_files"},
    # weights hashed as the format stores them; the memo only for models persist loaded
    "provenance": BASE | {"format", "weights_memo"},
    "identity": BASE | {"provenance"},
    "caches": BASE,
    "format": BASE,
    "codecs": BASE
    | {"format", "policy", "servable", "kinds", "caches", "marks", "cuda", "yielding"},
    # CUDA transport (driver, kernels, pinned staging, reader processes)
    "cuda": BASE | {"yielding"},
    "storage": BASE | {"format", "policy", "servable", "private_files"},
    # clients of the tiers beyond one machine (Redis, S3)
    "remote": BASE,
    "engine": BASE
    | {
        "format",
        "policy",
        "servable",
        "kinds",
        "identity",
        "codecs",
        "storage",
        "remote",
        "cuda",
        "marks",
        "yielding",
        "model_folders",
    },
    "apps": BASE
    | {
        "format",
        "policy",
        "kinds",
        "identity",
        "provenance",
        "codecs",
        "storage",
        "engine",
        "caches",
        "model_folders",
    },
    # persist serve: mlx-lm's server over the engine
    "serve": BASE | {"identity", "provenance", "codecs", "storage", "engine", "apps", "yielding"},
    "cli": BASE | {"identity", "storage", "engine", "apps", "serve"},
    "__main__": {"cli"},
    # re-exports by name (PEP 562); its TYPE_CHECKING block names every layer
    "__init__": BASE | {"policy", "kinds", "identity", "codecs", "storage", "engine", "apps"},
}
NEVER_MLX = {
    "errors",
    "records",
    "policy",
    "servable",
    "kinds",
    "storage",
    "remote",
    "weights_memo",
    "private_files",
    "marks",
    "yielding",
}  # numpy neither


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports(path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports, anywhere in it."""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            # "from . import policy" imports a module, not a name
            out |= {f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")}
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of that same package it imports."""
    prefix = package.name + "."
    edges: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        mod = module_name(path)
        found = imports(path)
        edges[mod] = {i for i in found if i.startswith(prefix) and _is_module(i) and i != mod}
    return edges


def test_every_arrow_points_down() -> None:
    bad = []
    for mod, targets in graph().items():
        for t in targets:
            src, dst = layer(mod), layer(t)
            if src != dst and dst not in ALLOWED[src]:
                bad.append(f"{mod} -> {t}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def circles(edges: dict[str, set[str]]) -> list[str]:
    """Every circle a depth-first walk of ``edges`` closes, written a -> b -> a."""
    # a module's package __init__ runs before it: parent packages are not arrows
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if seen.get(t) == 1:
                found.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in seen:
                visit(t)
        stack.pop()
        seen[m] = 2

    for m in sorted(edges):
        if m not in seen:
            visit(m)
    return found


def test_no_import_circles() -> None:
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(found)


def test_no_import_circles_in_bench() -> None:
    """The benchmarks import each other too (shared cache shapes, servers, results)."""
    found = circles(graph(ROOT / "bench"))
    assert not found, "import circles in bench/:\n" + "\n".join(found)


def test_low_layers_never_import_mlx() -> None:
    for path in PACKAGE.rglob("*.py"):
        mod = module_name(path)
        if layer(mod) in NEVER_MLX:
            heavy = {i for i in imports(path) if i.split(".")[0] in {"mlx", "mlx_lm", "numpy"}}
            assert not heavy, (mod, heavy)


def test_the_graph_sees_real_arrows() -> None:
    """The test can fail: it finds the arrows it forbids when they are there."""
    edges = graph()
    assert "persist.engine.saving" in edges["persist.engine.store"]
    assert "persist.storage.index" in edges["persist.engine.store"]
    assert "persist.kinds" in edges["persist.codecs"]
    assert "persist.codecs" not in edges["persist.kinds"]


def test_the_circle_search_finds_circles() -> None:
    """A circle through three modules, and one through a function-level import, are found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    bench = graph(ROOT / "bench")
    assert "bench.common" in bench["bench.bench_throughput"]
    assert "bench.shapes" in bench["bench.default_path"]  # imported inside its child's function


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in helper modules (tests/helpers.py, tests/serve/servers.py,
    tests/engine/host_checks.py, ...) or fixtures: a test module imported by another
    runs its module-level code twice and ties two behaviours' files together."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        found = {i for i in imports(path) if i.startswith("tests.") and _is_module(i)}
        bad += [f"{module_name(path)} -> {t}" for t in sorted(found) if _is_test_module(t)]
    assert not bad, "test modules importing test modules:\n" + "\n".join(bad)


def _is_test_module(name: str) -> bool:
    return name.split(".")[-1].startswith("test_")


def test_no_test_file_is_named_after_an_issue() -> None:
    """A test module says what behaviour it guards (where a case came from goes in a
    comment); a tracker's numbers mean nothing in a checkout without the tracker."""
    numbered = re.compile(r"test_(attack|issue|round)_?\d")
    bad = [
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py") if numbered.match(p.name)
    ]
    assert not bad, f"name these by the behaviour they guard: {sorted(bad)}"
