"""MkDocs hook: every page of docs/ is in the site's navigation.

Pages that mkdocs.yml's nav does not name (a page someone adds for a
feature) are placed by file name under a fitting section, else under
"More", so a new page appears without an edit of mkdocs.yml and no page is
built unreachable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# a page's file name -> the nav section it belongs to
SECTIONS = {
    "serving.md": "Serving",
    "tenants.md": "Serving",
    "tiers.md": "Tiers and fleet",
    "reliability.md": "Reliability",
}


def named(nav: Any) -> set[str]:
    """Every page file the nav names, at any depth."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(named(v) for v in nav.values()))
    if isinstance(nav, list):
        return set().union(*(named(v) for v in nav))
    return set()


def title(page: Path) -> str:
    """The page's first heading, else its name."""
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip().replace("`", "")  # the nav shows text, not code
    return page.stem.replace("-", " ").capitalize()


def section(nav: list[Any], name: str) -> list[Any]:
    """The nav's section ``name`` as a list of entries, made a list (or added) if needed."""
    for i, item in enumerate(nav):
        if isinstance(item, dict) and name in item:
            value = item[name]
            if not isinstance(value, list):  # a single page: the section's first entry
                value = [{name: value}]
                nav[i] = {name: value}
            return value
    nav.append({name: []})
    return nav[-1][name]


def on_config(config: Any) -> Any:
    nav = config.get("nav")
    if not nav:
        return config  # no nav: mkdocs lists every page itself
    docs = Path(config["docs_dir"])
    listed = named(nav)
    for page in sorted(docs.rglob("*.md")):
        rel = page.relative_to(docs).as_posix()
        if rel not in listed:
            section(nav, SECTIONS.get(rel, "More")).append({title(page): rel})
    return config
