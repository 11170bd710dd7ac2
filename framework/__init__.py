"""runlab: a Hydra-configured PyTorch experiment framework.

``main`` is what ``run.py`` calls; ``run`` trains with the same config from Python or a notebook
and returns a ``RunResult`` (metrics, run dir, checkpoints); ``sweep`` runs a search preset and
returns its trials table; ``load_model`` rebuilds a trained model from a checkpoint.
"""
from framework.checkpoint import load_model
from framework.entry import main, run, sweep
from framework.logger import find_tensorboard_from_notebooks
from framework.results import RunResult, SweepResult

find_tensorboard_from_notebooks()

__all__ = ["main", "run", "sweep", "load_model", "RunResult", "SweepResult"]
