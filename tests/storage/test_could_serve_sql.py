"""The lookup's SQL filter is ``policy.could_serve``, checked on random rows."""

from __future__ import annotations

import sqlite3

from hypothesis import given
from hypothesis import strategies as st

from persist.policy import COULD_SERVE_SQL, Candidate, could_serve


@given(st.booleans(), st.integers(0, 600), st.integers(0, 600), st.integers(1, 600))
def test_sql_and_policy_agree(trimmable: bool, n_tokens: int, floor: int, prompt: int) -> None:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE snapshots(trimmable INTEGER, n_tokens INTEGER, min_resume INTEGER)")
    db.execute("INSERT INTO snapshots VALUES (?, ?, ?)", [int(trimmable), n_tokens, floor])
    sql = f"SELECT COUNT(*) FROM snapshots s WHERE {COULD_SERVE_SQL}"
    (hit,) = db.execute(sql, [prompt - 1, prompt - 1]).fetchone()
    assert bool(hit) == could_serve(Candidate(1, n_tokens, trimmable, floor), 0, prompt)
