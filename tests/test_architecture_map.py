"""ARCHITECTURE.md is a map: every module path and dotted name it shows in backticks
still exists, so a rename or a move fails here, in one named test, instead of
leaving the map pointing at nothing.

What counts: a span with a slash is a path in the checkout (``engine/saving``,
``persist/storage/index.py``, ``cuda/pinned.data_path``: relative to the
repository or to ``persist/``, ``.py`` optional, dotted names after the module
resolved in it; ``<kind>`` matches any name).  A dotted span (``Store.save``,
``policy.best_candidate``, ``persist.Store``) names a persist module (by its
full dotted path or its last part), a class or function defined in persist, or
an importable outside module (``mlx_lm.server``), followed by attributes of it.
A bare CamelCase span (``PersistentPromptCache``) must be defined in persist or
mlx-lm.  Other spans (commands, SQL, options, environment variables) are prose.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from functools import cache
from pathlib import Path

import mlx_lm

from tests.helpers import ROOT

MAP = ROOT / "ARCHITECTURE.md"
PACKAGE = ROOT / "persist"
IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"^{IDENT}(\.{IDENT})+$")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+[A-Z]\w*$")
PATH = re.compile(r"^[\w<>.-][\w<>./-]*/[\w<>.-]*$")  # not /health: a URL path


def spans() -> list[str]:
    text = re.sub(r"^```.*?^```", "", MAP.read_text(), flags=re.S | re.M)  # not code blocks
    return [s.removesuffix("()") for s in re.findall(r"`([^`\n]+)`", text)]


@cache
def modules() -> dict[str, list[Path]]:
    """Every persist module by dotted name and by its last part."""
    out: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        for key in {".".join(parts), ".".join(parts[1:]), parts[-1]}:
            if key:
                out.setdefault(key, []).append(path)
    return out


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def assigned(body: list[ast.stmt], name: str, *, selves: bool = False) -> ast.AST | None:
    """The definition of ``name`` in ``body``: def, class, assignment, import, or
    (in a class, ``selves``) an attribute its methods set on ``self``."""
    for node in body:
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if isinstance(node, defs) and node.name == name:
            return node
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return node
    if selves:
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)  # set, not only read
                and node.attr == name
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                return node
    return None


def in_module(path: Path, chain: list[str]) -> bool:
    """``chain`` (name, then attributes) is defined in the module at ``path``."""
    if not chain:
        return True
    if path.name == "__init__.py" and (path.parent / f"{chain[0]}.py").exists():
        return in_module(path.parent / f"{chain[0]}.py", chain[1:])
    if path.name == "__init__.py" and (path.parent / chain[0] / "__init__.py").exists():
        return in_module(path.parent / chain[0] / "__init__.py", chain[1:])
    if path == PACKAGE / "__init__.py":  # the lazy public names (PEP 562)
        lazy = importlib.import_module("persist")._LAZY
        if chain[0] in lazy:
            return in_module(modules()[f"persist.{lazy[chain[0]]}"][0], chain)
    body: list[ast.stmt] = tree(path).body
    owner: ast.ClassDef | None = None
    for i, name in enumerate(chain):
        node = assigned(body, name, selves=i > 0)
        if isinstance(node, ast.ImportFrom) and i == 0:  # a name imported: where it is from
            return imported(path, node, chain)
        if node is None:  # a class's attribute may come from a base class
            bases = [b.id for b in owner.bases if isinstance(b, ast.Name)] if owner else []
            return any(in_module(path, [b, *chain[i:]]) for b in bases)
        if not isinstance(node, ast.ClassDef):
            return i == len(chain) - 1
        body, owner = node.body, node
    return True


def imported(path: Path, node: ast.ImportFrom, chain: list[str]) -> bool:
    """``chain`` resolved where ``path`` imports its first name from."""
    alias = next(a for a in node.names if (a.asname or a.name) == chain[0])
    rest = [alias.name, *chain[1:]]
    if not node.level:
        return outside([*(node.module or "").split("."), *rest])
    pkg = path.parent
    for _ in range(node.level - 1):
        pkg = pkg.parent
    base = pkg.joinpath(*(node.module or "").split(".")) if node.module else pkg
    target = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return target.is_file() and in_module(target, rest)


def outside(chain: list[str]) -> bool:
    """An importable module outside persist, then attributes of it."""
    for n in range(len(chain), 0, -1):
        name = ".".join(chain[:n])
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if found and not name.startswith("persist"):
            if n == len(chain):
                return True  # a module is there: not imported (mlx_lm.server loads transformers)
            obj = importlib.import_module(name)
            try:
                for attr in chain[n:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                return False
            return True
    return False


def defined_anywhere(name: str, root: Path = PACKAGE) -> list[Path]:
    """Modules under ``root`` that define ``name`` at their top level (not import it)."""
    return [
        p
        for p in root.rglob("*.py")
        if not isinstance(assigned(tree(p).body, name), (type(None), ast.Import, ast.ImportFrom))
    ]


def dotted_exists(chain: list[str]) -> bool:
    for n in range(len(chain), 0, -1):
        for path in modules().get(".".join(chain[:n]), []):
            if in_module(path, chain[n:]):
                return True
    if any(in_module(p, chain) for p in defined_anywhere(chain[0])):
        return True
    return outside(chain)


def path_exists(span: str) -> bool:
    """A path of the checkout (from the root or from persist/), maybe with names after."""
    head, _, names = span.rpartition("/")
    file, *chain = names.split(".")
    if file in {"py", "md"} or names.endswith((".py", ".md")):  # a file name, not names
        file, chain = names, []
    for base in (ROOT, PACKAGE):
        pattern = re.sub(r"<[^>]+>", "*", f"{head}/{file}".strip("/"))
        found = [p for p in base.glob(pattern) if p.exists()]
        found += [p for p in base.glob(pattern + ".py") if p.is_file()]
        for p in found:
            target = p / "__init__.py" if p.is_dir() else p
            if not chain or (target.suffix == ".py" and in_module(target, chain)):
                return True
    return False


def camel_exists(name: str) -> bool:
    return bool(defined_anywhere(name) or defined_anywhere(name, Path(mlx_lm.__file__).parent))


def file_exists(name: str) -> bool:
    """A bare file name (``kinds.py``): some file of persist/ or the checkout has it."""
    return any(PACKAGE.rglob(name)) or (ROOT / name).exists()


def missing() -> list[str]:
    out = []
    for span in dict.fromkeys(spans()):
        if PATH.match(span):
            ok = path_exists(span)
        elif re.match(r"^[\w-]+\.(py|md)$", span):
            ok = file_exists(span)
        elif DOTTED.match(span):
            ok = dotted_exists(span.split("."))
        elif CAMEL.match(span):
            ok = camel_exists(span)
        else:
            continue
        if not ok:
            out.append(span)
    return out


def test_every_name_on_the_map_exists() -> None:
    gone = missing()
    assert not gone, "ARCHITECTURE.md names what no longer exists:\n" + "\n".join(gone)


def test_the_map_check_can_fail() -> None:
    """The resolver tells names that exist from names that do not."""
    assert dotted_exists(["Store", "save"]) and dotted_exists(["policy", "best_candidate"])
    assert dotted_exists(["persist", "Store"]) and dotted_exists(["mlx_lm", "server"])
    assert path_exists("engine/saving.write_and_commit") and path_exists("tests/test_layers.py")
    assert not dotted_exists(["Store", "no_such_method"])
    assert not dotted_exists(["policy", "choose"])  # renamed to best_candidate
    assert not path_exists("persist/store/index.py")  # the package became persist/storage
    assert not path_exists("engine/saving.no_such_step")
    assert camel_exists("PersistentPromptCache") and not camel_exists("NoSuchThingHere")
    assert file_exists("kinds.py") and not file_exists("tier_pull.py")


def layer_rules() -> dict[str, set[str]]:
    """tests/test_layers.py's ALLOWED table, read from its source (a test module is
    not imported by another): sets of names, ``BASE`` and unions of them."""
    source = tree(ROOT / "tests" / "test_layers.py")
    names: dict[str, ast.expr] = {}
    for node in source.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and node.value is not None:
                names[target.id] = node.value

    def value(e: ast.expr) -> set[str]:
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.BitOr):
            return value(e.left) | value(e.right)
        if isinstance(e, ast.Name):
            return value(names[e.id])
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "set":
            return set()
        return {ast.literal_eval(elt) for elt in e.elts} if isinstance(e, ast.Set) else set()

    table = names["ALLOWED"]
    assert isinstance(table, ast.Dict)
    base = value(names["BASE"])
    return {
        ast.literal_eval(k): value(v) - base
        for k, v in zip(table.keys, table.values, strict=True)
        if k is not None
    }


def mapped_rules() -> dict[str, set[str]]:
    """The map's import table: each row's layers -> the layers they may import
    (besides records and errors, which every layer may)."""
    out: dict[str, set[str]] = {}
    section = MAP.read_text().split("## Import rules", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        mine = {
            "__init__" if n == "persist/__init__.py" else n
            for n in re.findall(r"`([^`]+)`", cells[0])
        }
        may = set(re.findall(r"`([^`]+)`", cells[1])) - {"records", "errors"}
        for name in mine:
            out[name] = may - ({"errors"} if name == "records" else set())
    return out


def test_the_map_states_the_layer_rules_the_test_holds() -> None:
    """The import table of ARCHITECTURE.md is tests/test_layers.py's ALLOWED, row by row."""
    assert mapped_rules() == {k: v - {"errors", "records"} for k, v in layer_rules().items()}
