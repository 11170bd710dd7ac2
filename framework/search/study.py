"""Where a sweep's Optuna study lives, and how its trials are counted; shared by driver and report."""
from __future__ import annotations

from pathlib import Path
from typing import List

from framework.search.private_apis import uncached

STUDY_FILE = "study.db"
# A FAIL trial that never ran and does not count towards n_trials: a draw that repeated a tried
# configuration, or (studies of earlier runlab versions) a trial cut short by a dead driver.
NOT_RUN = ("duplicate_of", "interrupted")
# Why a RUNNING trial is not running any more (the sweep stopped); the next run of the sweep re-runs it.
STOPPED = "stopped"


def default_storage(sweep_dir: Path) -> str:
    # sqlite waits up to a minute for a lock, so trials in other processes can write alongside the driver.
    return f"sqlite:///{Path(sweep_dir).resolve() / STUDY_FILE}?timeout=60"


def never_ran(trial) -> bool:
    return any(trial.user_attrs.get(marker) is not None for marker in NOT_RUN)


def run_trials(study) -> List:
    """Every trial but the draws that never ran."""
    return [t for t in study.get_trials(deepcopy=False) if not never_ran(t)]


def finished_trials(study) -> List:
    """Complete, pruned and failed trials (those that count towards n_trials)."""
    from optuna.trial import TrialState

    return [t for t in run_trials(study) if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)]


def failed_trials(study) -> List:
    from optuna.trial import TrialState

    return [t for t in finished_trials(study) if t.state == TrialState.FAIL]


def load_sweep_study(sweep_dir: Path, study_name: str = ""):
    """The study of a sweep dir's sqlite storage (its only study unless study_name says which)."""
    import optuna

    path = Path(sweep_dir) / STUDY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give the sweep dir of a hydra/sweeper=runlab sweep "
                                "with a stored study (hydra.sweeper.storage=null keeps it in memory).")
    storage = default_storage(sweep_dir)
    if not study_name:
        names = [summary.study_name for summary in optuna.get_all_study_summaries(storage)]
        if len(names) != 1:
            raise ValueError(f"{path} holds the studies {names}; name one with --study.")
        study_name = names[0]
    return uncached(optuna.load_study(study_name=study_name, storage=storage))
