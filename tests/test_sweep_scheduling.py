"""The sweeper's scheduling, with scripted launchers: trial lengths are set and time is simulated."""
from __future__ import annotations

import heapq
import math
from typing import List, Sequence

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import OmegaConf

from framework.search.slots import TrialSlots
from framework.search.study import INTERRUPTED, load_sweep_study
from framework.search.sweeper import StudySweeper, SweepError


class ScriptedSlots(TrialSlots):
    """Trial n takes lengths[n] time units and returns n, or NaN if it is in `failing`;
    `events` records the order of things."""

    def __init__(self, lengths: List[float], failing: Sequence[int] = ()) -> None:
        self.lengths, self.failing, self.now, self.ends, self.events = lengths, failing, 0.0, [], []

    def submit(self, overrides, number: int) -> int:
        self.events.append(f"start {number}")
        heapq.heappush(self.ends, (self.now + self.lengths[number], number))
        return number

    def next_finished(self, handles):
        self.now, number = heapq.heappop(self.ends)
        assert number in handles
        self.events.append(f"end {number}")
        result = JobReturn()
        result.status, result.return_value = JobStatus.COMPLETED, math.nan if number in self.failing else float(number)
        return number, result

    def cancel(self, handles) -> None:
        self.events += [f"cancel {number}" for number in handles]


class RecordingLauncher(Launcher):
    """A Hydra launcher that records its launch calls; job n returns n."""

    def __init__(self) -> None:
        self.calls = []

    def setup(self, **kwargs) -> None:
        pass

    def launch(self, job_overrides, initial_job_idx: int):
        self.calls.append((initial_job_idx, len(job_overrides)))
        returns = [JobReturn() for _ in job_overrides]
        for number, result in enumerate(returns, start=initial_job_idx):
            result.status, result.return_value = JobStatus.COMPLETED, float(number)
        return returns


def scripted_sweeper(tmp_path, lengths: List[float], n_jobs: int, failing: Sequence[int] = ()) -> StudySweeper:
    sweeper = StudySweeper(sampler=optuna.samplers.RandomSampler(seed=0), pruner=None, direction="maximize",
                           storage="", study_name="scripted", n_trials=len(lengths), n_jobs=n_jobs,
                           max_failure_rate=0.0, params=OmegaConf.create({"lr": "interval(0.001, 0.01)"}),
                           export_dir=str(tmp_path / "experiments"))
    sweeper.config = OmegaConf.create({"hydra": {"sweeper": {"pruner": None}}})
    sweeper.sweep_dir = tmp_path
    sweeper.launcher = ScriptedSlots(lengths, failing)
    return sweeper


def test_a_slot_freed_by_a_short_trial_gets_the_next_trial_at_once(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[10, 1, 1, 1], n_jobs=2)
    sweeper.sweep([])
    # Trials 2 and 3 run in the slot trial 1 freed, while trial 0 still runs.
    assert sweeper.launcher.events == ["start 0", "start 1", "end 1", "start 2", "end 2", "start 3", "end 3", "end 0"]
    assert sweeper.launcher.now == 10


def test_never_more_than_n_trials_are_started(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[1, 2, 3], n_jobs=4)
    sweeper.sweep([])
    assert sweeper.launcher.events == ["start 0", "start 1", "start 2", "end 0", "end 1", "end 2"]


def test_a_sweep_stopped_by_failures_cancels_its_running_trials(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[5, 1, 1], n_jobs=2, failing=[1])
    with pytest.raises(SweepError, match="1 of 1 trials failed"):
        sweeper.sweep([])
    assert sweeper.launcher.events == ["start 0", "start 1", "end 1", "cancel 0"]
    trials = load_sweep_study(tmp_path).trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    # The cancelled trial does not count: running the sweep again replaces it.
    assert trials[0].user_attrs[INTERRUPTED] and not trials[1].user_attrs.get(INTERRUPTED)


def test_other_launchers_get_the_trials_in_flight_as_one_batch(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[1] * 5, n_jobs=2)
    sweeper.launcher = RecordingLauncher()
    sweeper.sweep([])
    assert sweeper.launcher.calls == [(0, 2), (2, 2), (4, 1)]
    assert [t.value for t in load_sweep_study(tmp_path).trials] == [0.0, 1.0, 2.0, 3.0, 4.0]
