"""The search's rules that reach past one process and one store (a mixin of Search).

- ``restore_in_fresh_process``: a named session restored by a new Python
  process (tests/search/child_restore.py) fed the same tokens, compared bit
  for bit with the oracle; the first ``processes`` of a test (a process start
  costs seconds), then in this process.
- ``pull_from_shared``: with a shared tier (``shared``, a real Redis), a new
  machine (a Store over an empty folder) looks a prompt up or restores a
  session by name, pulling from the tier.
- ``serve_insert`` / ``serve_fetch``: persist serve's prompt cache
  (``PersistentPromptCache``) driven as mlx_lm.server drives it: the answered
  request's cache inserted under its tokens, a later request's prompt fetched
  (memory, host tier or store), and the hit checked with the same oracle.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from typing import Any

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from persist.errors import SessionNotFoundError
from persist.serve.server import PersistentPromptCache
from tests.helpers import ROOT, assert_same_state, pythonpath, raw
from tests.search.child_restore import unhexed
from tests.search.oracle import comparable, state_of

MODEL_KEY = ("m", None, None)  # mlx_lm.server's key: model, adapter, draft


class FarRules:
    """Rules over a fresh process, a shared tier and persist serve's memory tier.
    Mixed into Search, whose attributes (model, store, tokens, ...) they use."""

    recipe: dict[str, Any] | None = None  # how a fresh process builds the model
    processes = 0  # restores in a fresh process allowed per test
    shared: str | None = None  # a shared tier's URL (a Redis the test started)

    def start_far(self) -> None:
        self.machines = 0
        self.served_lengths: list[int] = []
        self.pc: PersistentPromptCache | None = None
        self.pc_store: Any = None
        if self.shared is not None:  # every sequence starts with an empty fleet
            import redis

            redis.Redis.from_url(self.shared).flushall()

    def stop_far(self) -> None:
        if self.pc is not None:
            self.pc.close()
            self.pc_store.close()

    # -- a fresh process -----------------------------------------------------

    @precondition(lambda self: bool(self.named))
    @rule(name=st.sampled_from(["a", "b", "c"]))
    def restore_in_fresh_process(self, name: str) -> None:
        """A named session restored in a new Python process is what this one's oracle
        computes: the same state, then the same logits and state after each call.
        Past the test's ``processes`` (a start costs seconds) it restores here: a
        rule whose availability depended on earlier sequences would make Hypothesis's
        replays draw differently."""
        if name not in self.named:
            return
        self._reopen(False)
        if self.recipe is None or self.tally.processes >= self.processes:
            self._check_restore(name)
            return
        report = self._child_restore(name)
        self.tally.processes += 1
        if report.get("missing"):  # removed by the repair of a session sharing its blobs
            assert self.repaired, f"session {name!r} vanished without a repair"
            del self.named[name]
            return
        k = len(report["tokens"])
        assert k == self.named[name] or (self.repaired and k < self.named[name])
        assert report["tokens"] == self.tokens[:k]
        want = self.fresh(k)
        assert_same_state(unhexed(report["before"]), state_of(comparable(want)))
        for i, (t, step) in enumerate(zip([3, 5], report["steps"], strict=True)):
            b = self.model(mx.array([[t]]), cache=want)[0, -1]
            if self.quant is not None:
                self.quant.convert(want)
            mx.eval(b)
            assert raw(b).hex() == step["logits"], f"logits differ {i + 1} steps after"
            assert_same_state(unhexed(step["state"]), state_of(want))

    def _child_restore(self, name: str) -> dict[str, Any]:
        job, out = self.root / "job.json", self.root / "out.json"
        spec = {
            "recipe": self.recipe,
            "quant": self.quant.__dict__ if self.quant is not None else None,
            "store": str(self.root / "s"),
            "block_tokens": self.store.block_tokens,
            "session": name,
            "next": [3, 5],
        }
        job.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        cmd = [sys.executable, "-m", "tests.search.child_restore", str(job), str(out)]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=600)
        got: dict[str, Any] = json.loads(out.read_text())
        return got

    # -- a shared tier ---------------------------------------------------------

    @precondition(lambda self: self.shared is not None and bool(self.saved))
    @rule(
        name=st.sampled_from([None, "a", "b", "c"]),
        pick=st.integers(0, 1 << 16),
        frac=st.one_of(st.just(1.0), st.floats(0, 1)),
    )
    def pull_from_shared(self, name: str | None, pick: int, frac: float) -> None:
        """A new machine (an empty folder) with the same shared tier: a lookup (name
        None) or a restore by name pulls from the tier; the oracle checks it."""
        self.machines += 1
        with self._open(False, self.root / f"machine-{self.machines}") as other:
            if name is None:
                self.check_lookup(other, pick, frac)
            elif name in self.named:
                try:
                    r = other.restore(name, identity=self.identity)
                except SessionNotFoundError:  # removed here by a repair, and pushed so
                    assert self.repaired
                    return
                k = len(r.tokens)
                assert k <= len(self.tokens) and r.tokens == self.tokens[:k]
                assert k == self.named[name] or self.repaired
                self.continued(r.cache, k, [3, 5])
        self.tally.pulls += 1

    # -- persist serve's memory tier -----------------------------------------

    def identity_of(self, key: Any) -> Any:
        """The identity of the model mlx-lm's server loaded under ``key``: the
        session's for MODEL_KEY, with a draft's for serve_draft's keys."""
        return self.identity if key == MODEL_KEY else self.draft_identity_of(key)

    def _prompt_cache(self) -> PersistentPromptCache:
        if self.pc is None:
            self.pc_store = self._open(True, self.root / "s")
            self.pc = PersistentPromptCache(
                4, store=self.pc_store, identity=self.identity_of, host=self.pc_store.host
            )
        return self.pc

    @rule()
    def serve_insert(self) -> None:
        """mlx_lm.server inserts the cache of the request it answered under its
        tokens; persist keeps it in memory and writes it behind to the store."""
        pc = self._prompt_cache()
        before = pc.counters["persisted"]
        pc.insert_cache(MODEL_KEY, list(self.tokens), copy.deepcopy(self.cache))
        pc.flush()
        self.served_lengths.append(len(self.tokens))
        if pc.counters["persisted"] > before:  # the store now holds it too
            self.saved.append(len(self.tokens))

    @precondition(lambda self: bool(self.served_lengths))
    @rule(pick=st.integers(0, 1 << 16), frac=st.one_of(st.just(1.0), st.floats(0, 1)))
    def serve_fetch(self, pick: int, frac: float) -> None:
        """A later request's prompt sharing h tokens: the cache persist serve hands
        out (memory, host tier or store) continues like a fresh prefill."""
        prompt, h = self.prompt(pick, frac, self.served_lengths)
        cache, rest = self._prompt_cache().fetch_nearest_cache(MODEL_KEY, prompt)
        if cache is None:
            self.tally.misses += 1
            return
        k = len(prompt) - len(rest)
        assert k <= h and prompt[:k] == self.tokens[:k], (k, h)
        self.continued(cache, k, rest[:2])
        self.tally.served += 1
