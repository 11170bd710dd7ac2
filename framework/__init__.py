"""runlab: a Hydra-configured PyTorch experiment framework.

``main`` is what ``run.py`` calls; ``run`` trains with the same config from Python or a notebook
and returns a ``RunResult`` (metrics, run dir, checkpoints); ``sweep`` runs a search preset and
returns its trials table; ``load_model`` rebuilds a trained model from a checkpoint.
"""
import importlib.util
import os
import sys
from pathlib import Path

from framework import config  # noqa: F401  (registers runlab's resolvers, runlab.*, before any config is resolved)

# Each public name is imported from its module on first use: importing framework loads no torch,
# so composing and printing a config (run.py --help, --cfg job) starts in a fraction of a second.
_EXPORTS = {"main": "framework.entry", "cli": "framework.entry", "run": "framework.entry", "sweep": "framework.entry",
            "load_model": "framework.checkpoint", "RunResult": "framework.results", "SweepResult": "framework.results"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    # Submodules too (framework.checkpoint.load_checkpoint), as when they were imported with the package.
    if importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


def find_tensorboard_from_notebooks() -> None:
    """Point %tensorboard at this environment's tensorboard.

    The notebook magic starts ``$TENSORBOARD_BINARY``, else the ``tensorboard`` on PATH: a kernel
    started from a virtual environment that was never activated has no .venv/bin there."""
    binary = Path(sys.executable).with_name("tensorboard")
    if binary.is_file():
        os.environ.setdefault("TENSORBOARD_BINARY", str(binary))


find_tensorboard_from_notebooks()
