"""What ``--model`` names: a model folder, a Hugging Face repo id, or nothing (the demo).

The folder and the repo id are ``model_folders``' (the engine reads a file's
named model through it too); nothing is the demo model, made on first use.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..model_folders import check_model_folder, looks_like_repo, model_folder

__all__ = ["resolve_model", "looks_like_repo", "check_model_folder"]


def resolve_model(model: str | os.PathLike[str] | None, *, download: bool = True) -> Path:
    """The folder mlx-lm loads for ``model``: the demo model when None, else
    ``model_folders.model_folder``."""
    if model is None:
        from .demo import demo_model_dir

        return demo_model_dir()
    return model_folder(model, download=download)
