"""runlab: a Hydra-configured PyTorch experiment framework.

``main`` is what ``run.py`` calls; ``run`` composes the same config from Python or a
notebook and returns the metrics; ``load_model`` rebuilds a trained model from a checkpoint.
"""
from framework.checkpoint import load_model
from framework.entry import main, run

__all__ = ["main", "run", "load_model"]
