"""The extras a user installs: the CUDA backend beside the default CPU one."""

from __future__ import annotations

import tomllib

from tests.helpers import ROOT


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_cuda_extra_brings_mlx_cuda_in_the_base_range() -> None:
    """``pip install "mlx-persist[cuda]"``: mlx[cuda13] within the base's MLX range, on
    Linux only (macOS wheels carry Metal), and nothing else changes."""
    p = project()
    (cuda,) = p["optional-dependencies"]["cuda"]
    base = next(d for d in p["dependencies"] if d.startswith("mlx[cpu]"))
    assert cuda.startswith("mlx[cuda13]") and "sys_platform == 'linux'" in cuda
    assert cuda.split(";")[0].removeprefix("mlx[cuda13]") == base.split(";")[0].removeprefix(
        "mlx[cpu]"
    )
