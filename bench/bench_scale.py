"""A server's lifetime: one store grown to 1k, 10k and 100k sessions, measured at each size.

    python -m bench.bench_scale                          # 1,000, 10,000, 100,000
    python -m bench.bench_scale --sizes 1000,10000 --label quick
    python -m bench.bench_scale --sizes 100000 --keep /tmp/scale   # built once, then reused

Nine in ten sessions are chats: a 300-token system prompt every chat shares
plus 40 tokens of their own (named sessions, each its own tail blob: one
shared block, a tail written per save); one in ten is a distinct 340-token
prompt (an anonymous prefix entry, as ``persist serve`` keeps). Tiny 2-layer
KV caches, so that the disk does not hide the index. The bulk of each size
is saved without fsync (``os.fsync`` a no-op, ``synchronous=OFF``: the same
code and SQL, without waiting for the disk), the last 50 saves as persist
always saves. At each size, in one run: a save (median of those 50 new
chats, and the SQLite VM steps of one), lookups (``Store.find``: what a
lookup restores, from the index; median of 30) of a new chat, a returning
chat and a returning distinct prompt, with the hit against the best any
stored session offers, the time to the first row of ``persist ls --limit
20`` in a fresh process (and of the listing alone), a real gc of a tenth,
``check`` and the index bytes per session; then the store grows on.
Results in bench/results/scale-<label>.*

The bulk is saved on the caller's thread too (``serial_saves``: the same
index work, without starting a save's hashing and writing threads), about
3.6 ms a save here, so 100,000 sessions build in about 6 minutes.
``--keep DIR`` builds in DIR and leaves the store there with its corpus
(``corpus.pickle``): a later run with the same DIR grows it back to the size
asked (its gc took a tenth) instead of building from nothing.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mc

import persist
from bench.common import machine, write_results
from persist.storage import listing
from tests.golden.cases import IDENTITY, kvs

SYSTEM = list(range(1000, 1300))
OWN = 40
H, D = 2, 8
SHARED = [kvs(1, 340), kvs(3, 340)]  # the system prompt's keys and values, per layer


class Corpus:
    """What the store holds, kept beside it: the best hit any stored session offers."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.chats: dict[str, tuple[int, ...]] = {}  # name -> own tokens
        self.prompts: dict[int, list[int]] = {}  # entry id -> tokens of a distinct prompt
        self.n = 0

    def own(self) -> tuple[int, ...]:
        return tuple(self.rng.randrange(2000, 60000) for _ in range(OWN))

    def best_new_chat(self, own: tuple[int, ...]) -> int:
        """The longest prefix of SYSTEM + own any stored chat shares (sorted neighbours)."""
        ordered = self.sorted
        i = bisect.bisect_left(ordered, own)
        near = [ordered[j] for j in (i - 1, i) if 0 <= j < len(ordered)]
        return len(SYSTEM) + max((_shared(own, x) for x in near), default=0)

    def dump(self) -> bytes:
        return pickle.dumps((self.chats, self.prompts, self.n, self.rng.getstate()))

    @classmethod
    def load(cls, raw: bytes) -> Corpus:
        out = cls()
        out.chats, out.prompts, out.n, state = pickle.loads(raw)
        out.rng.setstate(state)
        return out

    def freeze(self) -> None:
        self.sorted = sorted(self.chats.values())


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cache_for(n_own: int, own_seed: int) -> list[Any]:
    """A chat's cache: the shared system prompt's positions, then its own."""
    out = []
    key = mx.random.key(own_seed)
    for k, v in SHARED:
        c = mc.KVCache()
        mine = mx.random.normal((1, H, n_own, D), key=key).astype(mx.bfloat16)
        c.update_and_fetch(
            mx.concatenate([k[..., :300, :], mine], axis=2),
            mx.concatenate([v[..., :300, :], mine], axis=2),
        )
        out.append(c)
    return out


def grow(store: persist.Store, corpus: Corpus, to: int) -> list[float]:
    """Save sessions until the store holds ``to``; the seconds of each save."""
    times = []
    while len(corpus.chats) + len(corpus.prompts) < to:
        i = corpus.n
        if i % 10 == 9:  # a distinct prompt
            toks = [corpus.rng.randrange(60000, 120000) for _ in range(340)]
            cache = [_whole(2 * i), _whole(2 * i + 1)]
            t0 = time.perf_counter()
            e = store.save(cache, toks, identity=IDENTITY)
            times.append(time.perf_counter() - t0)
            corpus.prompts[e.id] = toks
        else:
            own = corpus.own()
            cache = cache_for(OWN, i)
            t0 = time.perf_counter()
            store.save(cache, SYSTEM + list(own), identity=IDENTITY, session=f"chat{i}")
            times.append(time.perf_counter() - t0)
            corpus.chats[f"chat{i}"] = own
        corpus.n += 1
    return times


def _whole(seed: int) -> Any:
    out = mc.KVCache()
    k = mx.random.normal((1, H, 340, D), key=mx.random.key(seed)).astype(mx.bfloat16)
    out.update_and_fetch(k, k)
    return out


@contextlib.contextmanager
def no_fsync(store: persist.Store) -> Iterator[None]:
    """The build's bulk: every write as persist makes it, no wait for the disk."""
    real = os.fsync
    os.fsync = lambda fd: None
    store.index.db.execute("PRAGMA synchronous=OFF")
    try:
        yield
    finally:
        os.fsync = real
        store.index.db.execute("PRAGMA synchronous=FULL")


class _Serial:
    """A ThreadPoolExecutor's face that runs each call at once, on the caller's thread."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        pass

    def map(self, fn: Callable[[Any], Any], items: Any) -> Iterator[Any]:
        return map(fn, items)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        f: Future[Any] = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:
            f.set_exception(e)
        return f

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


@contextlib.contextmanager
def serial_saves() -> Iterator[None]:
    """The build's bulk without a save's threads: for tiny caches starting them is
    most of a save (the index work, the SQL and the files are the same)."""
    from persist.engine import blob_writes

    real = blob_writes.ThreadPoolExecutor
    blob_writes.ThreadPoolExecutor = _Serial  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        blob_writes.ThreadPoolExecutor = real  # type: ignore[misc]


def vm_steps(store: persist.Store, run: Any) -> int:
    n = [0]
    store.index.db.conn.set_progress_handler(lambda: n.__setitem__(0, n[0] + 1) or 0, 1)
    try:
        run()
    finally:
        store.index.db.conn.set_progress_handler(None, 1)
    return n[0]


def lookups(store: persist.Store, corpus: Corpus) -> dict[str, Any]:
    corpus.freeze()
    kinds: dict[str, list[tuple[list[int], int, str | None]]] = {
        "new chat": [],
        "returning chat": [],
        "distinct prompt": [],
    }
    names = sorted(corpus.chats)
    for _ in range(30):
        own = corpus.own()
        kinds["new chat"].append((SYSTEM + list(own), corpus.best_new_chat(own), None))
        name = corpus.rng.choice(names)
        kinds["returning chat"].append((SYSTEM + list(corpus.chats[name]) + [7, 8], 340, name))
        sid = corpus.rng.choice(sorted(corpus.prompts))
        kinds["distinct prompt"].append((corpus.prompts[sid] + [7, 8], 340, None))
    out = {}
    for kind, probes in kinds.items():
        times, best_hits, own_hits = [], 0, 0
        for prompt, best, want in probes:
            t0 = time.perf_counter()
            found = store.find(prompt, identity=IDENTITY)
            times.append(time.perf_counter() - t0)
            hit = 0 if found is None else found[1]
            best_hits += hit == best
            own_hits += want is None or (found is not None and found[0].session == want)
        out[kind] = {
            "ms": statistics.median(times) * 1e3,
            "best": f"{best_hits}/{len(probes)}",
            "own session": f"{own_hits}/{len(probes)}",
        }
    return out


CLI_CASES = {  # result key -> the command's arguments after the store
    "ls first row s": ("ls", "--limit", "20"),
    "ls --sort used first row s": ("ls", "--limit", "20", "--sort", "used"),
    "ls --sort size first row s": ("ls", "--limit", "20", "--sort", "size"),
    "ls --prefix first row s": ("ls", "--limit", "20", "--prefix", "chat99"),
    "show first row s": ("show", "{name}"),  # a chat the store holds
}


def first_rows(root: Path, name: str, reps: int = 5) -> dict[str, float]:
    """Seconds from starting each ``persist`` command of CLI_CASES in a fresh process to
    its first line of output: the minimum of ``reps`` interleaved runs (noise on a shared
    machine only ever adds), children starting from bytecode as an installed persist does."""
    best = dict.fromkeys(CLI_CASES, float("inf"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # set on the shared machine: compiles every run
    env["PYTHONPYCACHEPREFIX"] = "/tmp/persist-bench-pyc"
    for _ in range(reps):
        for key, argv in CLI_CASES.items():
            t0 = time.perf_counter()
            p = subprocess.Popen(
                [sys.executable, "-m", "persist", *(a.format(name=name) for a in argv)]
                + ["--store", str(root)],
                stdout=subprocess.PIPE,
                env=env,
            )
            assert p.stdout is not None
            p.stdout.readline()
            best[key] = min(best[key], time.perf_counter() - t0)
            p.communicate()
            if p.returncode != 0:
                raise SystemExit(f"persist {' '.join(argv)} exited {p.returncode}")
    return best


def measure(store: persist.Store, corpus: Corpus, saves: list[float]) -> dict[str, Any]:
    r: dict[str, Any] = {"sessions": len(corpus.chats) + len(corpus.prompts)}
    r["load average"] = os.getloadavg()[0]  # other work on the machine while measured
    r["save ms"] = statistics.median(saves[-50:]) * 1e3
    own = corpus.own()
    r["save VM steps"] = vm_steps(
        store,
        lambda: store.save(
            cache_for(OWN, 7), SYSTEM + list(own), identity=IDENTITY, session="probe"
        ),
    )
    store.delete("probe")
    r["lookup"] = lookups(store, corpus)
    t0 = time.perf_counter()
    with persist.Store(store.root) as again:  # the listing itself, without a fresh process
        next(listing.stream(again.index, limit=20))
    r["ls first row in process s"] = time.perf_counter() - t0
    r.update(first_rows(store.root, min(corpus.chats)))
    t0 = time.perf_counter()
    store.stats()
    r["stats s"] = time.perf_counter() - t0
    store.index.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = sum(
        (store.root / f).stat().st_size
        for f in ("index.sqlite", "index.sqlite-wal")
        if (store.root / f).exists()
    )
    r["index bytes per session"] = size / r["sessions"]
    t0 = time.perf_counter()
    first: list[float] = []  # when check's progress first reports (what a bar can show)
    problems = store.check(progress=lambda d, t: first or first.append(time.perf_counter()))
    r["check s"] = time.perf_counter() - t0
    r["check first progress s"] = (first[0] - t0) if first else float("nan")
    r["check problems"] = len(problems)
    budget = int(store.stats().unique_bytes * 0.9)
    t0 = time.perf_counter()
    report = store.gc(budget)
    r["gc s"] = time.perf_counter() - t0
    r["gc evicted"] = len(report.evicted)
    for e in report.evicted:
        corpus.chats.pop(e.session or "", None)
        corpus.prompts.pop(e.id, None)
    return r


def markdown(results: list[dict[str, Any]], info: dict[str, Any]) -> str:
    nan = float("nan")
    cols = [f"{r['sessions']:,}" for r in results]
    rows = [
        ("save (ms, median of 50)", [f"{r['save ms']:.2f}" for r in results]),
        ("save, SQLite VM steps", [str(r["save VM steps"]) for r in results]),
    ]
    for kind in ("new chat", "returning chat", "distinct prompt"):
        rows.append((f"lookup, {kind} (ms)", [f"{r['lookup'][kind]['ms']:.3f}" for r in results]))
        rows.append((f"hit = best, {kind}", [r["lookup"][kind]["best"] for r in results]))
    rows.append(
        (
            "returning chat from its own session",
            [r["lookup"]["returning chat"]["own session"] for r in results],
        )
    )
    rows += [
        ("`persist ls --limit 20`, first row (s)", [f"{r['ls first row s']:.3f}" for r in results]),
        (
            "the listing alone (open + first row, s)",
            [f"{r['ls first row in process s']:.4f}" for r in results],
        ),
        *(
            (f"`... {opt}`, first row (s)", [f"{r.get(key, float('nan')):.3f}" for r in results])
            for opt, key in (
                ("--sort used", "ls --sort used first row s"),
                ("--sort size", "ls --sort size first row s"),
                ("--prefix chat99", "ls --prefix first row s"),
            )
        ),
        (
            "`persist show NAME`, first row (s)",
            [f"{r.get('show first row s', float('nan')):.3f}" for r in results],
        ),
        ("`Store.stats()` (s)", [f"{r.get('stats s', float('nan')):.4f}" for r in results]),
        ("gc of a tenth (s)", [f"{r['gc s']:.2f} ({r['gc evicted']:,} evicted)" for r in results]),
        (
            "check (s; its first progress report at)",
            [f"{r['check s']:.1f} ({r.get('check first progress s', nan):.1f})" for r in results],
        ),
        ("index bytes per session", [f"{r['index bytes per session']:,.0f}" for r in results]),
        ("load average when measured", [f"{r.get('load average', nan):.1f}" for r in results]),
    ]
    head = f"| sessions | {' | '.join(cols)} |\n|---|{'---|' * len(cols)}\n"
    body = "".join(f"| {name} | {' | '.join(v)} |\n" for name, v in rows)
    first = results[0]["save ms"]
    ratio = results[-1]["save ms"] / first if first else float("nan")
    return (
        f"`python -m bench.bench_scale` on {info['platform']} ({info['cpus']} CPUs): one store "
        "grown to each size (9 in 10 sessions chats sharing a 300-token system prompt, 1 in 10 "
        "distinct 340-token prompts; 2-layer KV caches), measured there, then a tenth gc'd.\n\n"
        + head
        + body
        + f"\nSave at {results[-1]['sessions']:,} / at {results[0]['sessions']:,}: {ratio:.2f}x.\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--label", default="full")
    ap.add_argument("--root", default=None, help="Where to build (default: a temporary folder).")
    ap.add_argument("--keep", type=Path, default=None, help="Build in DIR, keep it, reuse it.")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            d = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.root)))
        else:
            d = args.keep
            d.mkdir(parents=True, exist_ok=True)
        results = run(d, sizes)
    info = machine()
    write_results(
        f"scale-{args.label}", {"machine": info, "results": results}, markdown(results, info)
    )
    print(markdown(results, info))


def run(d: Path, sizes: list[int]) -> list[dict[str, Any]]:
    """Grow the store in ``d`` to each size and measure it there.  The corpus is written
    beside the store after each step, so that a kept store is reused where it stands."""
    kept = d / "corpus.pickle"
    corpus = Corpus.load(kept.read_bytes()) if kept.exists() else Corpus()
    results = []
    with persist.Store(d / "s") as store:
        for size in sizes:
            have = len(corpus.chats) + len(corpus.prompts)
            if have > size - 50:
                print(f"skipped {size:,}: the kept store holds {have:,} sessions", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                with no_fsync(store), serial_saves():
                    grow(store, corpus, size - 50)
                saves = grow(store, corpus, size)  # fsynced, as every save is
            finally:
                kept.write_bytes(corpus.dump())
            built = time.perf_counter() - t0
            r = measure(store, corpus, saves)
            kept.write_bytes(corpus.dump())
            r["build s"] = built
            results.append(r)
            print(r, flush=True)
    return results


if __name__ == "__main__":
    main()
