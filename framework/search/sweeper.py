"""The study loop behind ``hydra/sweeper=runlab``.

It is hydra-optuna-sweeper's loop (same samplers, same ``interval``/``choice``/``range``
search-space syntax) with what that one lacks:

- every trial is a normal run that can open the study and report each epoch, so the
  study's pruner can stop it (framework/search/trial.py);
- the study is stored (sqlite in the sweep dir by default), so re-running the same command
  continues it: finished trials are kept and the total reaches ``n_trials``;
- a trial that raises (OOM included) or returns NaN is recorded as failed with its error and
  the sweep goes on, until more than ``max_failure_rate * n_trials`` trials have failed;
- at the end a report is written to the sweep dir (framework/search/report.py).
"""
from __future__ import annotations

import functools
import logging
import math
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
from omegaconf import DictConfig, OmegaConf

from framework.entry import CONF_DIR
from framework.errors import SweepError
from framework.search.slots import BatchSlots, TrialSlots
from framework.search.study import INTERRUPTED, default_storage, failed_trials, finished_trials, uncached

log = logging.getLogger(__name__)

OOM_MARKERS = ("out of memory", "can't allocate memory")


def describe_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
    return f"out of memory: {text}" if any(m in str(error) for m in OOM_MARKERS) else text


def save_traceback(result: JobReturn) -> None:
    """The failed trial's traceback, in its run dir as error.txt (Hydra keeps only the exception)."""
    if result.hydra_cfg is None:  # the job never started (a Ray worker died)
        return
    error = result._return_value
    path = Path(result.hydra_cfg.hydra.runtime.output_dir) / "error.txt"
    path.write_text("".join(traceback.format_exception(type(error), error, error.__traceback__)))


class StudySweeper(Sweeper):
    def __init__(self, sampler: Any, pruner: Any, direction: str, storage: str, study_name: str, n_trials: int,
                 n_jobs: int, max_failure_rate: float, params: Optional[DictConfig], export_dir: str) -> None:
        if isinstance(sampler, functools.partial):  # GridSampler needs the space up front
            raise ValueError("hydra/sweeper/sampler=grid is not supported by hydra/sweeper=runlab; use search=grid "
                             "(Hydra's basic sweeper) or hydra/sweeper=optuna.")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(f"hydra.sweeper.max_failure_rate={max_failure_rate} is invalid; use a fraction from 0 to 1.")
        self.sampler, self.pruner, self.direction = sampler, pruner, direction
        self.storage, self.study_name = storage, study_name
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, max(1, n_jobs), max_failure_rate
        self.params = params
        self.export_dir = export_dir or str((CONF_DIR / "experiment").resolve())

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(config=config, hydra_context=hydra_context,
                                                                task_function=task_function)
        self.sweep_dir = Path(config.hydra.sweep.dir)

    def sweep(self, arguments: List[str]) -> None:
        from framework.search.report import write_report

        space_args = [f"{key}={value}" for key, value in (self.params or {}).items()]
        space, fixed = create_params_from_overrides(space_args + list(arguments))
        for name in fixed:
            space.pop(name, None)
        study = self.open_study()
        self.mark_interrupted(study, "the previous sweep driver stopped during this trial")
        slots = self.launcher if isinstance(self.launcher, TrialSlots) else BatchSlots(self.launcher)
        allowed_failures = math.floor(self.max_failure_rate * self.n_trials)
        running: Dict[Any, Any] = {}  # launcher handle -> Optuna trial
        while True:
            # Keep n_jobs trials in flight: a slot freed by a short (pruned, failed) trial gets the
            # next one at once instead of waiting for the slowest trial of a batch.
            unstarted = self.n_trials - len(finished_trials(study)) - len(running)
            for _ in range(min(self.n_jobs - len(running), unstarted)):
                trial = study.ask()
                running[slots.submit(self.trial_overrides(trial, space, fixed), trial.number)] = trial
            if not running:
                break
            handle, result = slots.next_finished(list(running))
            self.record(study, running.pop(handle), result)
            if len(failed_trials(study)) > allowed_failures:
                slots.cancel(list(running))
                self.mark_interrupted(study, "the sweep stopped on too many failures")
                write_report(study, self.sweep_dir, self.export_dir)
                raise SweepError(self.failure_summary(study, allowed_failures))
        write_report(study, self.sweep_dir, self.export_dir)

    # --- the study ---------------------------------------------------------------------

    def open_study(self):
        import optuna

        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        self.storage = self.storage or default_storage(self.sweep_dir)
        study = uncached(optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                             pruner=self.pruner, direction=self.direction, load_if_exists=True))
        # Trials run in their own processes and build the pruner from this attribute.
        pruner_cfg = self.config.hydra.sweeper.pruner
        study.set_user_attr("pruner", OmegaConf.to_container(pruner_cfg, resolve=True) if pruner_cfg else None)
        done = len(finished_trials(study))
        log.info("Study %r in %s: %d of %d trials done; sampler %s, pruner %s.", study.study_name, self.storage,
                 done, self.n_trials, type(self.sampler).__name__, type(self.pruner).__name__ if self.pruner else "none")
        return study

    @staticmethod
    def mark_interrupted(study, why: str) -> None:
        """Fail the trials still RUNNING, flagged interrupted: they do not count towards n_trials,
        so the next run of the sweep command replaces them."""
        from optuna.trial import TrialState

        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study._storage.set_trial_user_attr(trial._trial_id, INTERRUPTED, True)
            study._storage.set_trial_user_attr(trial._trial_id, "error", f"interrupted: {why}")
            study._storage.set_trial_state(trial._trial_id, TrialState.FAIL)
            log.warning("Trial %d was interrupted (%s); a new trial replaces it when the sweep runs again.",
                        trial.number, why)

    def trial_overrides(self, trial, space: Dict[str, Any], fixed: Dict[str, str]) -> Sequence[str]:
        for name, distribution in space.items():
            trial._suggest(name, distribution)
        # The trial finds its study through these, to report epochs and ask whether to stop.
        identity = [f"search.study_name='{trial.study.study_name}'", f"search.storage='{self.storage}'",
                    f"search.trial={trial.number}"]
        return (*(f"{name}={value}" for name, value in trial.params.items()),
                *(f"{name}={value}" for name, value in fixed.items()), *identity)

    def record(self, study, trial, result: JobReturn) -> None:
        from optuna.trial import TrialState

        if result.status == JobStatus.FAILED:
            save_traceback(result)
            return self.fail(study, trial, describe_error(result._return_value))
        value = result.return_value
        if value is None or not math.isfinite(float(value)):
            return self.fail(study, trial, f"the run returned {value} for its optimized_metric")
        if study._storage.get_trial(trial._trial_id).user_attrs.get("pruned_at_epoch") is not None:
            study.tell(trial, state=TrialState.PRUNED)
            log.info("Trial %d pruned: %s", trial.number, trial.params)
        else:
            study.tell(trial, float(value))
            log.info("Trial %d finished with %s: %s", trial.number, value, trial.params)

    @staticmethod
    def fail(study, trial, error: str) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("error", error)
        study.tell(trial, state=TrialState.FAIL)
        log.warning("Trial %d failed: %s", trial.number, error)

    def failure_summary(self, study, allowed: int) -> str:
        failed = failed_trials(study)
        lines = [f"#{t.number}: {t.user_attrs.get('error', '?')}" for t in failed]
        return (f"Stopped the sweep: {len(failed)} of {len(finished_trials(study))} trials failed, more than "
                f"max_failure_rate={self.max_failure_rate} of n_trials={self.n_trials} allows ({allowed}). "
                f"The report is in {self.sweep_dir}. Failures: " + "; ".join(lines))
