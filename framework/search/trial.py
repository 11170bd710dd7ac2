"""The trainer's link to its sweep (``Trainer.end_epoch`` calls it every epoch).

Outside a sweep it does nothing. Under ``hydra/sweeper=runlab`` the sweeper passes
``search.study_name/storage/trial``; the run then reports its validation metric each epoch to
that trial, and stops when the study's pruner says the trial is hopeless. Each run opens the
shared storage itself, so this works the same in the driver's process and on Ray workers.
Under Hydra's basic sweeper there is no study: the job only knows its number and swept values.
Either way the trial's number and swept values name the run in TensorBoard.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class NoTrial:
    """Not a trial of a runlab sweep: reports nothing and never stops the run."""

    number: Optional[int] = None  # the trial's (or job's) number in its sweep

    def report(self, metrics: Mapping[str, float], validation: int, where: str) -> str:
        return ""

    def hparams(self) -> Dict[str, Any]:
        return {}


def route_optuna_logging() -> None:
    """Optuna's own handler colours its lines with ANSI codes, also where they go to a file: its messages
    go through the process's logging (Hydra's, in a run) instead."""
    import optuna

    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()


class SweepTrial(NoTrial):
    def __init__(self, search: DictConfig, optimized_metric: Any):
        import optuna
        from hydra.utils import instantiate

        from framework.private_apis import trial_by_number

        route_optuna_logging()

        study = optuna.load_study(study_name=search.study_name, storage=search.storage)
        pruner_cfg = study.user_attrs.get("pruner")
        study.pruner = instantiate(pruner_cfg) if pruner_cfg else optuna.pruners.NopPruner()
        self.trial = trial_by_number(study, search.trial)
        self.number = search.trial
        self.pruner_name = type(study.pruner).__name__
        # best/<m> is not known per epoch; its per-epoch value is <m>. Several objectives: Optuna
        # cannot prune (the sweeper refuses a pruner then), so nothing is reported.
        self.metric = optimized_metric.removeprefix("best/") if isinstance(optimized_metric, str) else None

    def report(self, metrics: Mapping[str, float], validation: int, where: str) -> str:
        """Report the value of the run's ``validation``-th validation (its epoch, unless trainer.val_every_n_steps
        validates by steps), made at ``where``; returns why the run should stop, or ""."""
        if self.metric not in metrics:
            return ""
        with warnings.catch_warnings():
            # A trial run again from its start (its driver died, and this machine has no checkpoint of it)
            # reports its first epochs again; Optuna keeps the first values, and would warn about each.
            warnings.filterwarnings("ignore", message="The reported value is ignored")
            self.trial.report(float(metrics[self.metric]), validation)
        if not self.trial.should_prune():
            return ""
        self.trial.set_user_attr("pruned_at_epoch", validation)
        return f"pruned by the sweep's {self.pruner_name} after {where}"

    def hparams(self) -> Dict[str, Any]:
        # The searched values, so every trial shows them in TensorBoard's HPARAMS tab.
        return dict(self.trial.params)


class HydraSweepJob(NoTrial):
    """A job of Hydra's basic sweeper (``python run.py -m lr=1e-3,1e-4``, ``search=grid``): no study
    to report to, but a number and the values it was given for the keys the sweep varies."""

    def __init__(self, number: int, swept: Dict[str, Any]):
        self.number, self.swept = number, swept

    def hparams(self) -> Dict[str, Any]:
        return dict(self.swept)


def hydra_sweep_job(run_dir: Path) -> Optional[HydraSweepJob]:
    """The basic-sweeper job that runs in ``run_dir``, read from what Hydra wrote: the job's own
    overrides in .hydra/hydra.yaml, and the sweep as typed in the sweep dir's multirun.yaml."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    job_file = run_dir / ".hydra" / "hydra.yaml"
    sweep_file = next((d / "multirun.yaml" for d in run_dir.parents if (d / "multirun.yaml").is_file()), None)
    if not job_file.is_file() or sweep_file is None:
        return None
    job, sweep = OmegaConf.load(job_file).hydra, OmegaConf.load(sweep_file).hydra
    if job.mode != "MULTIRUN":
        return None
    parser = OverridesParser.create()
    params = OmegaConf.to_container(sweep.sweeper, resolve=False).get("params") or {}
    typed = parser.parse_overrides([*sweep.overrides.task, *(f"{key}={value}" for key, value in params.items())])
    varied = {override.key_or_group for override in typed if override.is_sweep_override()}
    given = parser.parse_overrides(list(job.overrides.task))
    return HydraSweepJob(job.job.num, {o.key_or_group: o.value() for o in given if o.key_or_group in varied})


def sweep_trial(cfg: DictConfig, run_dir: Path, is_main: bool) -> NoTrial:
    import torch  # here, not above: the sweeper imports this module, and sweeps apps that need no torch

    if cfg.search.num_threads:
        torch.set_num_threads(cfg.search.num_threads)
        log.info("torch runs on %d threads (search.num_threads).", cfg.search.num_threads)
    # Only rank 0 talks to the study (a multi-process trial is not pruned) and logs.
    if not is_main:
        return NoTrial()
    if cfg.search.trial < 0:
        return hydra_sweep_job(run_dir) or NoTrial()
    return SweepTrial(cfg.search, cfg.optimized_metric)
