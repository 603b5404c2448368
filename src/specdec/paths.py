"""Where shared data and models live (``SPECDEC_SHARED``, default ``<repo>/../shared``)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # src/specdec/paths.py
TARGET_MODEL = "code-target-53m"
DRAFT_MODEL = "code-draft-7m"


def shared_dir() -> Path:
    """The shared folder: ``$SPECDEC_SHARED`` if set, else ``<repo>/../shared``."""
    env = os.environ.get("SPECDEC_SHARED")
    return Path(env).expanduser().resolve() if env else (REPO_ROOT.parent / "shared").resolve()


def data_dir() -> Path:
    return shared_dir() / "data"


def model_path(name: str) -> Path:
    """A shared model folder; ``$SPECDEC_MODELS`` (set on the GPU machine) takes precedence."""
    env = os.environ.get("SPECDEC_MODELS")
    base = Path(env) if env else shared_dir() / "models"
    return base / name


def require(path: Path, what: str) -> Path:
    """Return ``path`` if it exists, else raise a FileNotFoundError that says how to fix it."""
    if not path.exists():
        raise FileNotFoundError(
            f"{what} not found at {path}; put the shared folder beside the repo or set SPECDEC_SHARED"
        )
    return path
