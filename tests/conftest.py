"""Fixtures: tiny random-weight mlx-lm models of every family, built once per run."""

from __future__ import annotations

import signal
import threading
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


@pytest.fixture(autouse=True)
def _python_ctrl_c() -> Iterator[None]:
    """Every test starts with Python's own SIGINT handler and leaves it so: the tests
    that send a real SIGINT expect KeyboardInterrupt.  In CI's full run (round 5) an
    earlier test left another handler in place and three Ctrl-C tests saw no
    KeyboardInterrupt; which one was not found in runs of parts of the suite."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if main:
        signal.signal(signal.SIGINT, signal.default_int_handler)
