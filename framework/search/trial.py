"""The trainer's link to its sweep (``Trainer.end_epoch`` calls it every epoch).

Outside a sweep, or under Hydra's basic sweeper, it does nothing. Under
``hydra/sweeper=runlab`` the sweeper passes ``search.study_name/storage/trial``; the run then
reports its validation metric each epoch to that trial, and stops when the study's pruner
says the trial is hopeless. Each run opens the shared storage itself, so this works the
same in the driver's process and on Ray workers.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Mapping

import torch
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class NoTrial:
    """Not a trial of a runlab sweep: reports nothing and never stops the run."""

    def report(self, metrics: Mapping[str, float], epoch: int) -> str:
        return ""

    def hparams(self) -> Dict[str, Any]:
        return {}


class SweepTrial(NoTrial):
    def __init__(self, search: DictConfig, optimized_metric: str, run_dir: Path):
        import optuna
        from hydra.utils import instantiate

        study = optuna.load_study(study_name=search.study_name, storage=search.storage)
        pruner_cfg = study.user_attrs.get("pruner")
        study.pruner = instantiate(pruner_cfg) if pruner_cfg else optuna.pruners.NopPruner()
        trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, search.trial)
        self.trial = optuna.trial.Trial(study, trial_id)
        self.pruner_name = type(study.pruner).__name__
        # best/<m> is not known per epoch; its per-epoch value is <m>.
        self.metric = optimized_metric.removeprefix("best/")
        self.trial.set_user_attr("run_dir", str(run_dir))

    def report(self, metrics: Mapping[str, float], epoch: int) -> str:
        """Report this epoch's value; returns why the run should stop, or ""."""
        if self.metric not in metrics:
            return ""
        self.trial.report(float(metrics[self.metric]), epoch)
        if not self.trial.should_prune():
            return ""
        self.trial.set_user_attr("pruned_at_epoch", epoch)
        return f"pruned by the sweep's {self.pruner_name} after epoch {epoch}"

    def hparams(self) -> Dict[str, Any]:
        # The searched values, so every trial shows them in TensorBoard's HPARAMS tab.
        return dict(self.trial.params)


def sweep_trial(cfg: DictConfig, run_dir: Path, is_main: bool) -> NoTrial:
    if cfg.search.num_threads:
        torch.set_num_threads(cfg.search.num_threads)
        log.info("torch runs on %d threads (search.num_threads).", cfg.search.num_threads)
    # Only rank 0 talks to the study; a multi-process trial is not pruned.
    if cfg.search.trial < 0 or not is_main:
        return NoTrial()
    return SweepTrial(cfg.search, cfg.optimized_metric, run_dir)
