"""Where a sweep's Optuna study lives, and how its trials are counted; shared by driver and report."""
from __future__ import annotations

import contextlib
import fcntl
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from framework.private_apis import trial_id, uncached

STUDY_FILE = "study.db"
# A FAIL trial that never ran and does not count towards n_trials: a draw that repeated a tried
# configuration, or (studies of earlier runlab versions) a trial cut short by a dead driver.
NOT_RUN = ("duplicate_of", "interrupted")
# Why a RUNNING trial is not running any more (the sweep stopped); the next run of the sweep re-runs it.
STOPPED = "stopped"


def default_storage(sweep_dir: Path) -> str:
    return with_lock_timeout(f"sqlite:///{Path(sweep_dir).resolve() / STUDY_FILE}")


def with_lock_timeout(url: str) -> str:
    """sqlite waits up to a minute for a lock (not its default 5 s), so that drivers and their trials,
    in other processes, write alongside each other without "database is locked"."""
    if not url.startswith("sqlite:") or "timeout=" in url:
        return url
    return f"{url}{'&' if '?' in url else '?'}timeout=60"


@contextlib.contextmanager
def study_lock(url: Optional[str], study_name: Optional[str]) -> Iterator[None]:
    """Held by one driver of a study at a time, while it creates the storage (two drivers creating its
    tables at once collide on alembic_version) or picks its next trials (two drivers could draw the
    same configuration, or take over the same dead driver's trial). A dead driver's lock is freed
    with its connection (PostgreSQL's advisory lock) or its file descriptor (sqlite's lock file)."""
    if url is None:  # in memory: one driver
        yield
    elif url.startswith("postgresql"):
        with postgres_advisory_lock(url, zlib.crc32(f"runlab:{study_name}".encode())):
            yield
    elif url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        with open(f"{make_url(url).database}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield
    else:  # other databases: the drivers draw unserialized (the draws are still checked for repeats)
        yield


@contextlib.contextmanager
def postgres_advisory_lock(url: str, key: int) -> Iterator[None]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("select pg_advisory_lock(:key)"), {"key": key})
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text("select pg_advisory_unlock(:key)"), {"key": key})
    finally:
        engine.dispose()


def rdb_storage(url: str, heartbeat_s: int, grace_s: int):
    """The study's storage, recording the heartbeats of the trials this driver runs (call under study_lock:
    the first driver creates the tables)."""
    import optuna
    from optuna.exceptions import ExperimentalWarning

    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 2.10; stable since 3.0
        warnings.simplefilter("ignore", ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s)


class Heartbeat:
    """Records, every interval, that this driver still runs its trials: another driver takes over a
    trial whose heartbeat is older than the grace period (its driver died)."""

    def __init__(self, storage) -> None:
        self.storage, self.trials, self.stop = storage, {}, threading.Event()
        self.interval = None if storage is None else storage.get_heartbeat_interval()
        if self.interval:
            threading.Thread(target=self.beat_all, daemon=True, name="runlab-heartbeat").start()

    def add(self, trial) -> None:
        if self.interval:
            self.storage.record_heartbeat(trial_id(trial))  # at once: a new trial must never look dead
            self.trials[trial.number] = trial_id(trial)

    def discard(self, trial) -> None:
        self.trials.pop(trial.number, None)

    def beat_all(self) -> None:
        while not self.stop.wait(self.interval):
            for identity in list(self.trials.values()):
                with contextlib.suppress(Exception):  # a lost connection: the next beat tries again
                    self.storage.record_heartbeat(identity)

    def close(self) -> None:
        self.stop.set()


# What a study is for, stored with it when it is made: a sweep that reuses it must fit (``misfit``).
PURPOSE = "made_for"


def purpose(space: Dict[str, Any], custom_search_space: Optional[str], objectives: Optional[List[str]]) -> Dict[str, Any]:
    """A study's search space (each distribution as text), its space extension and its objectives."""
    return {"search_space": {name: short(distribution) for name, distribution in sorted(space.items())},
            "custom_search_space": custom_search_space, "optimized_metric": objectives}


def short(distribution) -> str:
    """``LogUniform(low=0.0001, high=0.03)``: a distribution as a message names it."""
    from optuna.distributions import distribution_to_json
    import json

    spec = json.loads(distribution_to_json(distribution))
    return f"{spec['name'].removesuffix('Distribution')}({', '.join(f'{k}={v}' for k, v in spec['attributes'].items())})"


def misfit(study, wanted: Dict[str, Any], directions: List[str]) -> List[str]:
    """How a stored study differs from what this sweep wants of it (empty: it fits, or it was made
    before runlab stored its purpose, and then it gets this one)."""
    differences = []
    stored_directions = [direction.name.lower() for direction in study.directions]
    if stored_directions != directions:
        differences.append(f"direction {'/'.join(stored_directions)} there, {'/'.join(directions)} here")
    stored = study.user_attrs.get(PURPOSE)
    if stored is None:
        return differences
    if stored["optimized_metric"] is not None and wanted["optimized_metric"] is not None \
            and stored["optimized_metric"] != wanted["optimized_metric"]:
        differences.append(f"optimized_metric {','.join(stored['optimized_metric'])} there, "
                           f"{','.join(wanted['optimized_metric'])} here")
    there, here = stored["search_space"], wanted["search_space"]
    for name in sorted({*there, *here}):
        if name not in here:
            differences.append(f"{name} searched there only")
        elif name not in there:
            differences.append(f"{name} searched here only")
        elif there[name] != here[name]:
            differences.append(f"{name} {there[name]} there, {here[name]} here")
    if stored["custom_search_space"] != wanted["custom_search_space"]:
        differences.append(f"custom_search_space {stored['custom_search_space']} there, {wanted['custom_search_space']} here")
    return differences


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


def running_trials(study) -> List:
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))


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
