"""The O_DIRECT sink's staging buffers: kept across files and threads, never shared."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from persist.format import sink as sink_module
from persist.format.sink import DIRECT_MIN_BYTES, KEEP_STAGES, STAGE_BYTES, Sink


@pytest.fixture
def stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every staging buffer mapped from here on (an empty free list to start from)."""
    probe = Sink(tmp_path / "probe", size_hint=DIRECT_MIN_BYTES)
    probe.close()
    if not probe.direct:
        pytest.skip("this filesystem refuses O_DIRECT: no staging buffers")
    monkeypatch.setattr(sink_module, "_free_stages", [])
    made: list[int] = []
    real = sink_module.mmap.mmap

    def counting(fileno: int, length: int, *a: Any, **k: Any) -> Any:
        if length == STAGE_BYTES:
            made.append(length)
        return real(fileno, length, *a, **k)

    monkeypatch.setattr(sink_module.mmap, "mmap", counting)
    return made


def _write(path: Path) -> None:
    sink = Sink(path, size_hint=DIRECT_MIN_BYTES)
    try:
        sink.write(b"x" * 100)
        sink.finish()
    finally:
        sink.close()


def test_files_written_on_new_threads_reuse_one_staging_buffer(
    tmp_path: Path, stages: list[int]
) -> None:
    """A save's writer threads are new every save: the buffer the last one filled
    serves the next, instead of STAGE_BYTES of fresh pages per writer per save."""
    for i in range(4):
        t = threading.Thread(target=_write, args=(tmp_path / f"f{i}",))
        t.start()
        t.join()
    assert len(stages) == 1
    assert [(tmp_path / f"f{i}").read_bytes() for i in range(4)] == [b"x" * 100] * 4


def test_sinks_open_at_once_never_share_a_buffer_and_few_are_kept(
    tmp_path: Path, stages: list[int]
) -> None:
    sinks = [Sink(tmp_path / f"f{i}", size_hint=DIRECT_MIN_BYTES) for i in range(KEEP_STAGES + 2)]
    assert len({id(s._stage) for s in sinks}) == len(sinks) == len(stages)
    for s in sinks:
        s.close()
    assert len(sink_module._free_stages) == KEEP_STAGES  # the others are unmapped
    again = [Sink(tmp_path / f"g{i}", size_hint=DIRECT_MIN_BYTES) for i in range(KEEP_STAGES)]
    assert len(stages) == KEEP_STAGES + 2  # served from the kept ones
    for s in again:
        s.close()
