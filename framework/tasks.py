"""What ``run.py`` does, chosen by the top-level ``task`` key."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Dict

from omegaconf import DictConfig

from framework import parallel
from framework.evaluate import evaluate_checkpoint
from framework.export import export
from framework.trainer import Trainer

log = logging.getLogger(__name__)

Metrics = Dict[str, float]


def train(cfg: DictConfig, run_dir: Path) -> Metrics:
    trainer = Trainer(cfg, run_dir, parallel.setup(cfg))
    try:
        return trainer.fit()
    finally:
        trainer.close()


TASKS: Dict[str, Callable[[DictConfig, Path], Metrics]] = {"train": train, "eval": evaluate_checkpoint, "export": export}
