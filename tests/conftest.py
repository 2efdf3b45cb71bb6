"""Fixtures: tiny random-weight mlx-lm models of every family, built once per run."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from persist.apps.demo import make_model

_loaded: dict[str, tuple[Any, Any]] = {}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "gemma3": ("gemma3", {}),
    "qwen3_next": ("qwen3_next", {}),
    "mamba2": ("mamba2", {}),
    "falcon_h1": ("falcon_h1", {}),
    "llama4": ("llama4", {}),
    # head_dim 64 so kv_bits group sizes 32 and 64 apply
    "llama_hd64": ("llama", {"head_dim": 64}),
    # head_dim 32 so its attention layers quantize with kv_bits group size 32
    "qwen3_next_hd32": ("qwen3_next", {"head_dim": 32}),
    # another hybrid model, as a speculative draft that disagrees with qwen3_next
    "qwen3_next_b": ("qwen3_next", {"rope_theta": 20000.0, "linear_conv_kernel_dim": 3}),
    # DeepSeek-V4 (deepseek_v41): with index layers, and without (a deterministic forward)
    "deepseek_v4": ("deepseek_v4", {}),
    "deepseek_v4_noindex": ("deepseek_v4_noindex", {}),
}


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_dir(model_root: Path) -> Any:
    def get(variant: str) -> Path:
        arch, overrides = VARIANTS[variant]
        d = model_root / variant
        if not (d / "config.json").exists():
            make_model(d, arch, overrides=overrides)
        return d

    return get


@pytest.fixture(scope="session")
def tiny(model_dir: Any) -> Any:
    """tiny(variant) -> (model, tokenizer, model_dir), loaded once per session."""

    def get(variant: str) -> tuple[Any, Any, Path]:
        d = model_dir(variant)
        if variant not in _loaded:
            _loaded[variant] = load(str(d))
        model, tok = _loaded[variant]
        return model, tok, d

    return get


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Any]:
    """A fresh store; every test's mutations must leave it consistent."""
    import persist
    from tests.store_helpers import clean

    with persist.Store(tmp_path / "store") as s:
        yield s
        clean(s)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(tool): the test runs a system tool (tests/tools.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests import tools

    tools.leave_out_missing(config, items)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests import tools

    tools.summary(terminalreporter)


@pytest.fixture
def python_ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler, for a test that sends this process a real SIGINT and
    expects KeyboardInterrupt; the one found is put back.  A process started with SIGINT
    ignored (a background job of a shell without job control) keeps it ignored, and the
    signal then does nothing: the one way found to fail the three such tests as CI's
    full run did while they passed alone (tests/reliability/test_interrupts.py)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def _sigint_handler_kept() -> Iterator[None]:
    """Every test leaves SIGINT's handler as it found it: code that installs one puts
    the old one back (``cli/interrupts.deferred_sigint`` does, in a finally), and a
    test that does not fails here, by name, instead of changing what later tests see.
    (It replaced a reset before and after every test, which hid that ignored SIGINT.)"""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    assert after == before, f"the test left SIGINT's handler {after!r}, it found {before!r}"
