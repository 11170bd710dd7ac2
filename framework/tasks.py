"""What ``run.py`` does, chosen by the top-level ``task`` key."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Dict

from omegaconf import DictConfig

from framework import parallel
from framework.evaluate import evaluate_checkpoint
from framework.export import export
from framework.finetune import pretrain_if_missing
from framework.paths import RunLock, discard_new_run_dirs
from framework.signals import StopRequest
from framework.trainer import Trainer
from framework.troubleshoot.doctor import doctor

log = logging.getLogger(__name__)

Metrics = Dict[str, float]


def train(cfg: DictConfig, run_dir: Path) -> Metrics:
    pretrain_if_missing(cfg)
    # The lock says "live" to resume=auto for as long as this process (the one the user started) runs.
    # Ranks started outside runlab can share the run dir (the tasks of a SLURM job): rank 0 holds it.
    lock = RunLock(run_dir) if parallel.launched_rank(cfg) == 0 else contextlib.nullcontext()
    with lock:
        metrics = parallel.launch(fit, cfg, run_dir)
    # resume= of a run with nothing left to train: this run wrote nothing, and its dir goes.
    discard_new_run_dirs()
    return metrics


def fit(cfg: DictConfig, run_dir: Path, env: parallel.Environment) -> Metrics:
    """One process's share of a training run (every process of a ddp run calls it)."""
    stop = StopRequest()
    with stop.installed():
        trainer = Trainer(cfg, run_dir, env, stop)
        try:
            return trainer.fit()
        finally:
            trainer.close()


TASKS: Dict[str, Callable[[DictConfig, Path], Metrics]] = {"train": train, "eval": evaluate_checkpoint, "export": export,
                                                         "doctor": doctor}
