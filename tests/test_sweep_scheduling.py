"""The sweeper's scheduling and resumption, with scripted launchers: trial lengths are set and time is simulated."""
from __future__ import annotations

import heapq
import math
import time
from typing import List, Sequence

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import OmegaConf

from conftest import one_line_error
from framework.errors import ConfigError
from framework.search.slots import TrialSlots
from framework.search.study import STOPPED, load_sweep_study
from framework.search.sweeper import StudySweeper, SweepError
from docs_pages import assert_in_page_order


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


def scripted_sweeper(tmp_path, lengths: List[float], n_jobs: int, failing: Sequence[int] = (),
                     space: str = "interval(0.001, 0.01)", n_trials: int = 0, direction: str = "maximize",
                     **config) -> StudySweeper:
    sampler = {"_target_": "optuna.samplers.RandomSampler", "seed": 0}
    sweeper = StudySweeper(sampler=optuna.samplers.RandomSampler(seed=0), pruner=None, direction=direction,
                           storage="", study_name="scripted", n_trials=n_trials or len(lengths), n_jobs=n_jobs,
                           max_failure_rate=0.0, params=OmegaConf.create({"lr": space}), custom_search_space=None,
                           export_dir="")
    sweeper.config = OmegaConf.create({"hydra": {"sweeper": {"pruner": None, "sampler": sampler}}, **config})
    sweeper.sweep_dir = tmp_path
    sweeper.launcher = ScriptedSlots(lengths, failing)
    return sweeper


def test_a_slot_freed_by_a_short_trial_gets_the_next_trial_at_once(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[10, 1, 1, 1], n_jobs=2)
    sweeper.sweep([])
    # Trials 2 and 3 run in the slot trial 1 freed, while trial 0 still runs.
    assert sweeper.launcher.events == ["start 0", "start 1", "end 1", "start 2", "end 2", "start 3", "end 3", "end 0"]
    assert sweeper.launcher.now == 10


def test_a_grace_period_no_longer_than_the_heartbeat_is_refused(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[1], n_jobs=1)
    sweeper.heartbeat_s, sweeper.grace_s = 10, 10  # every live driver's trial would look dead
    with pytest.raises(ConfigError, match="hydra.sweeper.heartbeat_s=10 and grace_s=10 are invalid"):
        sweeper.sweep([])


def test_never_more_than_n_trials_are_started(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[1, 2, 3], n_jobs=4)
    sweeper.sweep([])
    assert sweeper.launcher.events == ["start 0", "start 1", "start 2", "end 0", "end 1", "end 2"]


def test_a_sweep_stopped_by_failures_cancels_its_running_trials_and_runs_them_again_when_resumed(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[5, 1, 1, 1], n_jobs=2, failing=[1])
    with pytest.raises(SweepError, match="1 of 1 trials failed"):
        sweeper.sweep([])
    assert sweeper.launcher.events == ["start 0", "start 1", "end 1", "cancel 0"]
    trials = load_sweep_study(tmp_path).trials
    assert [t.state.name for t in trials] == ["RUNNING", "FAIL"]
    assert trials[0].user_attrs[STOPPED] == "the sweep stopped on too many failures"
    # Run again with a higher limit: the cancelled trial runs first, with its own number and parameters.
    again = scripted_sweeper(tmp_path, lengths=[5, 1, 1, 1], n_jobs=2, failing=[1])
    again.max_failure_rate = 0.5
    again.sweep([])
    assert again.launcher.events[:2] == ["start 0", "start 2"]
    resumed = load_sweep_study(tmp_path).trials
    assert [t.state.name for t in resumed] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert resumed[0].params == trials[0].params and not resumed[0].user_attrs.get(STOPPED)


class InterruptedSlots(ScriptedSlots):
    def next_finished(self, handles):
        raise KeyboardInterrupt


def test_an_interrupted_driver_leaves_its_trials_to_the_next_driver_at_once(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[1, 1], n_jobs=2)
    sweeper.launcher = InterruptedSlots([1, 1])
    with pytest.raises(KeyboardInterrupt):
        sweeper.sweep([])
    assert [t.user_attrs[STOPPED] for t in load_sweep_study(tmp_path).trials] == ["its driver was interrupted"] * 2
    # Well within the grace period of their last heartbeat, the next driver runs them again.
    again = scripted_sweeper(tmp_path, lengths=[1, 1], n_jobs=2)
    again.grace_s = 3600
    started = time.monotonic()
    again.sweep([])
    assert time.monotonic() - started < 30
    assert again.launcher.events == ["start 0", "start 1", "end 0", "end 1"]
    assert [t.state.name for t in load_sweep_study(tmp_path).trials] == ["COMPLETE", "COMPLETE"]


def test_a_resumed_study_draws_new_configurations_instead_of_replaying_its_seed(tmp_path):
    scripted_sweeper(tmp_path, lengths=[1] * 6, n_jobs=1, n_trials=3).sweep([])
    scripted_sweeper(tmp_path, lengths=[1] * 6, n_jobs=1).sweep([])  # n_trials raised to 6, same seed
    trials = load_sweep_study(tmp_path).trials
    assert len(trials) == 6 and len({t.params["lr"] for t in trials}) == 6
    # Drawn again from scratch, the first three repeat: the seed alone does not replay a resumed study.
    fresh = scripted_sweeper(tmp_path / "fresh", lengths=[1] * 3, n_jobs=1)
    fresh.sweep_dir.mkdir()
    fresh.sweep([])
    assert [t.params for t in load_sweep_study(tmp_path / "fresh").trials] == [t.params for t in trials[:3]]


def test_a_tried_configuration_is_not_run_again_and_a_used_up_space_ends_the_sweep(tmp_path, caplog):
    sweeper = scripted_sweeper(tmp_path, lengths=[1] * 100, n_jobs=1, space="choice(1, 2, 3)", n_trials=5)
    sweeper.sweep([])
    study = load_sweep_study(tmp_path)
    run = [t for t in study.trials if "duplicate_of" not in t.user_attrs]
    assert sorted(t.params["lr"] for t in run) == [1, 2, 3] and all(t.state.name == "COMPLETE" for t in run)
    assert all(t.state.name == "FAIL" for t in study.trials if "duplicate_of" in t.user_attrs)
    assert "no untried configuration left" in caplog.text
    with open(tmp_path / "trials.csv") as table:  # the draws that never ran are not in the report
        assert len(table.readlines()) == 1 + 3


def test_other_launchers_get_the_trials_in_flight_as_one_batch(tmp_path):
    sweeper = scripted_sweeper(tmp_path, lengths=[1] * 5, n_jobs=2)
    sweeper.launcher = RecordingLauncher()
    sweeper.sweep([])
    assert sweeper.launcher.calls == [(0, 2), (2, 2), (4, 1)]
    assert [t.value for t in load_sweep_study(tmp_path).trials] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_batch_of_trials_numbered_apart_is_launched_so_that_each_job_keeps_its_number(tmp_path):
    # Trial 0 was left running by an earlier run; trials 1 and 2 finished. Job numbers name run dirs,
    # so trial 0 and the new trial 3 go to launch() separately.
    study = optuna.create_study(study_name="scripted", storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize")
    left = study.ask({"lr": optuna.distributions.UniformDistribution(0.001, 0.01)})
    for _ in range(2):
        study.tell(study.ask({"lr": optuna.distributions.UniformDistribution(0.001, 0.01)}), 0.5)
    sweeper = scripted_sweeper(tmp_path, lengths=[1] * 4, n_jobs=2)
    sweeper.launcher = RecordingLauncher()
    sweeper.sweep([])
    assert sweeper.launcher.calls == [(0, 1), (3, 1)]
    trials = load_sweep_study(tmp_path).trials
    assert [t.value for t in trials] == [0.0, 0.5, 0.5, 3.0] and trials[0].params == left.params


WAYS_OUT = (r"start a new study with another hydra.sweeper.study_name \(or study_name=null for a new one every run\), "
            r"or sweep as that study was made to continue it.")


@pytest.mark.parametrize("change, difference", [
    (dict(space="interval(0.1, 1.0)"), r"lr Uniform\(low=0.001, high=0.01\) there, Uniform\(low=0.1, high=1.0\) here"),
    (dict(direction="minimize"), r"direction minimize here: Cannot overwrite study direction"),
    (dict(optimized_metric="val/loss"), r"optimized_metric val/acc there, val/loss here"),
])
def test_a_stored_study_made_for_another_sweep_is_refused(tmp_path, change, difference):
    scripted_sweeper(tmp_path, lengths=[1, 1], n_jobs=1, optimized_metric="val/acc").sweep([])
    other = scripted_sweeper(tmp_path, lengths=[1] * 4, n_jobs=1, **{"optimized_metric": "val/acc", **change})
    with pytest.raises(ConfigError, match=rf"^the stored study 'scripted' was made for another sweep \({difference}.*\); {WAYS_OUT}$"):
        other.sweep([])
    assert other.launcher.events == []
    assert len(load_sweep_study(tmp_path).trials) == 2


def test_a_stored_study_continues_with_more_trials_and_a_space_swept_on_the_command_line_alike(tmp_path):
    scripted_sweeper(tmp_path, lengths=[1, 1], n_jobs=1, optimized_metric="val/acc").sweep([])
    more = scripted_sweeper(tmp_path, lengths=[1] * 4, n_jobs=1, optimized_metric="val/acc")
    more.sweep([])
    assert more.launcher.events == ["start 2", "end 2", "start 3", "end 3"]
    # The same space given on the command line instead of in params is the same space.
    same = scripted_sweeper(tmp_path, lengths=[1] * 5, n_jobs=1, optimized_metric="val/acc")
    same.params = None
    same.sweep(["lr=interval(0.001, 0.01)"])
    assert len(load_sweep_study(tmp_path).trials) == 5
    # Another parameter swept, from the command line, is another space.
    wider = scripted_sweeper(tmp_path, lengths=[1] * 6, n_jobs=1, optimized_metric="val/acc")
    with pytest.raises(ConfigError, match=r"\(batch_size searched here only\)"):
        wider.sweep(["batch_size=choice(32,64)"])


# docs/search.md's spaces of one's own, which tests/test_readme.py leaves to the test below.
DOCS_NARROW_LR = ("python run.py search=random \"hydra.sweeper.params.lr='interval(1e-4,1e-2)'\" "
                  "hydra.sweeper.study_name=narrow_lr hydra.sweeper.n_trials=1 trainer.max_epochs=2")
DOCS_LR_ONLY = ("python run.py search=random '~hydra.sweeper.params' 'lr=tag(log, interval(1e-4, 1e-2))' "
                "hydra.sweeper.study_name=lr_only hydra.sweeper.n_trials=2 trainer.max_epochs=2")


@pytest.mark.timeout(300)
def test_the_docs_spaces_make_their_studies_and_the_same_command_with_another_space_is_refused_in_one_line(user):
    """The user's path: the docs' commands verbatim, then the first one typed again with a changed space."""
    assert_in_page_order("docs/search.md", DOCS_NARROW_LR, DOCS_LR_ONLY)
    for command in (DOCS_NARROW_LR, DOCS_LR_ONLY):
        done = user.run(command)
        assert done.returncode == 0, done.stderr[-3000:]
    multirun = user.outputs / "train" / "multirun"
    # One entry changed (the quotes make it a string for Hydra), the rest of the shipped space kept:
    (narrow,) = load_sweep_study(multirun / "narrow_lr").trials
    assert narrow.state.name == "COMPLETE" and narrow.distributions["lr"] == optuna.distributions.UniformDistribution(1e-4, 1e-2)
    assert set(narrow.distributions) == {"lr", "batch_size", "model.width", "model.depth", "optimizer.weight_decay"}
    # The whole space replaced by the command line's sweep:
    lr_only = load_sweep_study(multirun / "lr_only").trials
    assert [t.state.name for t in lr_only] == ["COMPLETE"] * 2
    assert all(t.distributions == {"lr": optuna.distributions.LogUniformDistribution(1e-4, 1e-2)} for t in lr_only)
    changed = DOCS_NARROW_LR.replace("interval(1e-4,1e-2)", "interval(1e-3,1e-1)").replace("n_trials=1", "n_trials=2")
    line = one_line_error(user.run(changed), 2)
    assert "the stored study 'narrow_lr' was made for another sweep (lr Uniform(low=0.0001, high=0.01) there, " \
           "Uniform(low=0.001, high=0.1) here)" in line
    assert "another hydra.sweeper.study_name" in line
