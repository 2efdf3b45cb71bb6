"""Write bench/results/state-space-search.md from the long search run's JSON.

    PERSIST_LONG=1 python -m pytest tests/search tests/tiers/test_shared_search.py
    python -m bench.search_report --note "at COMMIT, N min on the 2-core machine"

The JSON (written by tests/search/results.py) holds one tally per family (the
tiny families, with and without kv_bits), per shared-tier family and per
mlx-lm architecture; the skipped architectures and their reasons come from
tests/search/arch_args.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
COLUMNS = [
    "sequences",
    "states",
    "hits",
    "served",
    "batches",
    "drafted",
    "restores",
    "processes",
    "pulls",
    "repairs",
    "imports",
    "conversions",
    "misses",
    "by_length",
]


def table(rows: dict[str, dict[str, Any]], first: str, extra: tuple[str, ...] = ()) -> list[str]:
    head = [first, *COLUMNS, *extra]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in sorted(rows.items()):
        cells = [name, *(str(r.get(c, 0)) for c in COLUMNS)]
        cells += [_cell(r.get(e)) for e in extra]
        out.append("| " + " | ".join(cells) + " |")
    total = {c: sum(int(r.get(c, 0)) for r in rows.values()) for c in COLUMNS}
    blanks = " |" * len(extra)
    out.append("| **all** | " + " | ".join(str(total[c]) for c in COLUMNS) + " |" + blanks)
    return out


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return " + ".join(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    return "" if v is None else str(v)


def render(got: dict[str, Any], skipped: dict[str, str], note: str) -> str:
    out = [
        "# State-space search (issue 36), long budget",
        "",
        f"`PERSIST_LONG=1`, {note}.  Every hit, restore, pull and memory-tier hit is",
        "compared with a fresh prefill of its own tokens (tests/search/oracle.py):",
        "logits and state bit for bit after every continued call.  Counts include",
        "every sequence Hypothesis ran.  `served`: persist serve memory-tier hits;",
        "`processes`: restores in a fresh Python process; `pulls`: lookups and",
        "restores by a new machine from a real Redis; `conversions`: sessions",
        "quantized by kv_bits mid-session; `by_length`: distinct hit lengths.",
        "",
        "## Tiny families (with and without kv_bits)",
        "",
        *table(got.get("families", {}), "family"),
        "",
        "## Shared tier (a real redis-server)",
        "",
        *table(got.get("shared", {}), "family"),
        "",
        "## Every mlx-lm architecture that builds",
        "",
        "`lead`: the first architecture of its cache signature, searched deeper;",
        "`exact calls`: no (a position's bits depend on what shares its call), the",
        "oracle replays the session's own calls, rejected drafts included.",
        "",
        *table(
            got.get("architectures", {}),
            "architecture",
            ("signature", "lead", "exact_calls"),
        ),
        "",
        "## Skipped",
        "",
        "| module | why |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(skipped.items())),
        "",
    ]
    return "\n".join(out)


def main() -> None:
    from tests.search.arch_args import SKIPPED

    ap = argparse.ArgumentParser()
    ap.add_argument("--note", required=True, help="commit, wall time, machine")
    args = ap.parse_args()
    got = json.loads((RESULTS / "state-space-search.json").read_text())
    (RESULTS / "state-space-search.md").write_text(render(got, SKIPPED, args.note))


if __name__ == "__main__":
    main()
