"""Sweeps end to end: real `python run.py` multiruns of tiny digits runs (docs/search.md's own commands where the
page has one), typed in a fresh copy of the repository."""
from __future__ import annotations

import contextlib
import csv
import os
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, aids_on_path, one_line_error, read_metrics
from docs_pages import assert_in_page_order, typed_as_shown

# Sweeps write only under outputs/ (git-ignored): after each test, `git status` of its copy is clean.
pytestmark = pytest.mark.usefixtures("source_tree_stays_clean")

# Seconds-long trials: 2 epochs of a one-layer MLP, CSV logs (TensorBoard where a test needs it).
TINY = ["trainer.max_epochs=2", "trainer.progress_bar=false", "model.width=32", "model.depth=1", "batch_size=64",
        "logger=csv"]


def sweep(cli, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """A runlab sweep of tiny trials, typed in the user's copy of the repository."""
    return cli(*TINY, *args, **kwargs)


def sweep_dir(user, study: str) -> Path:
    return user.outputs / "train" / "multirun" / study


def trials_table(directory: Path):
    with open(directory / "trials.csv") as handle:
        return list(csv.DictReader(handle))


def study_states(directory: Path):
    with sqlite3.connect(directory / "study.db") as db:
        return dict(db.execute("select number, state from trials"))


def test_sweep_configs_compose_as_multiruns(tmp_path):
    from conftest import composed
    from hydra_plugins.runlab_sweeper.config import RunlabSweeperConf
    from hydra_plugins.runlab_sweeper.sweeper import checked

    grid = composed("search=grid")
    assert grid.hydra.mode.name == "MULTIRUN" and grid.hydra.sweeper.params["lr"] == "1e-3,3e-3"
    for name, sampler in (("random", "RandomSampler"), ("tpe", "TPESampler")):
        cfg = composed(f"search={name}")
        assert cfg.hydra.sweeper._target_.endswith("RunlabSweeper")
        assert cfg.hydra.sweeper.sampler._target_ == f"optuna.samplers.{sampler}"
        assert set(cfg.hydra.sweeper.params) == {"lr", "batch_size", "model.width", "model.depth", "optimizer.weight_decay"}
    # search=tpe is search=random (its one file) with TPE proposing the trials.
    sweepers = [{key: value for key, value in composed(f"search={name}").hydra.sweeper.items() if key not in
                 ("sampler", "study_name")} for name in ("random", "tpe")]
    assert sweepers[0] == sweepers[1]
    # Their budget is the sweeper schema's, not written again in the YAML.
    schema = OmegaConf.structured(RunlabSweeperConf)
    assert all(sweepers[0][key] == schema[key] for key in ("n_trials", "n_jobs", "max_failure_rate", "heartbeat_s"))
    # The stock plugins stay available.
    assert composed("search=tpe", "hydra/sweeper=optuna").hydra.sweeper._target_.endswith("OptunaSweeper")
    # The stock sweeper's settings: no space (then only the command line's sweeps), null storage and
    # study name, a direction per objective.
    cleared = composed("search=random", "~hydra.sweeper.params", "hydra.sweeper.storage=null",
                       "hydra.sweeper.study_name=null", "hydra.sweeper.direction=[maximize,minimize]")
    assert "params" not in cleared.hydra.sweeper and cleared.hydra.sweeper.storage is None
    settings = checked({key: value for key, value in cleared.hydra.sweeper.items() if key != "_target_"})
    assert settings["params"] is None and settings["study_name"] is None and list(settings["direction"]) == \
        ["maximize", "minimize"]


def test_a_sweeper_setting_of_the_wrong_type_is_one_line(cli):
    line = one_line_error(cli("search=random", "hydra.sweeper.n_trials=abc"), 2)
    assert line == "runlab: error: hydra.sweeper.n_trials='abc' is invalid: Value 'abc' of type 'str' could not be " \
                   "converted to Integer."


# docs/search.md's steps that tests/test_readme.py leaves to the tests below: each runs them verbatim, in
# the page's order where a step reads what the one before left (the TPE study, its report, its best trial).
DOCS_RANDOM = "python run.py search=random hydra.sweeper.n_trials=2 trainer.max_epochs=2"
DOCS_TPE = "python run.py search=tpe hydra.sweeper.n_trials=3 trainer.max_epochs=2"
DOCS_TPE_RESUMED = "python run.py search=tpe hydra.sweeper.n_trials=4 trainer.max_epochs=2"
DOCS_REPORT = "python -m framework.search.report outputs/train/multirun/train_tpe"
DOCS_BEST = "python run.py --config-dir outputs/train/multirun/train_tpe experiment=best"
DOCS_EXPORT = "python run.py search=tpe hydra.sweeper.n_trials=4 trainer.max_epochs=2 hydra.sweeper.export_dir=experiments"
DOCS_EXPORTED_BEST = "python run.py experiment=train_tpe_best"
DOCS_TWO_OBJECTIVES = """$ python run.py search=random 'optimized_metric=[val/acc,val/loss]' 'hydra.sweeper.direction=[maximize,minimize]' hydra.sweeper.storage=null hydra.sweeper.study_name=two_objectives hydra.sweeper.n_trials=3 trainer.max_epochs=2
...hydra.sweeper.storage is null: the study lives in memory only, so this sweep cannot be resumed...
Pareto front (...
number  state ... val/acc  val/loss  seconds ...
Trial #... as an experiment: python run.py --config-dir outputs/train/multirun/two_objectives experiment=best_..."""


@pytest.mark.timeout(240)
def test_the_docs_random_sweep_runs_n_trials_and_writes_its_report(user):
    result = user.run(DOCS_RANDOM)
    assert result.returncode == 0, result.stderr[-2000:]
    directory = sweep_dir(user, "train_random")
    rows = trials_table(directory)
    assert [row["state"] for row in rows] == ["COMPLETE"] * 2
    assert len({row["lr"] for row in rows}) == 2
    for number in range(2):
        assert float(rows[number]["value"]) == read_metrics(directory / str(number))["val/acc"]
    assert "Trials of study 'train_random'" in result.stdout
    results = OmegaConf.load(directory / "optimization_results.yaml")  # as hydra-optuna-sweeper writes it
    best = max(rows, key=lambda row: float(row["value"]))
    assert results.name == "optuna" and results.best_value == float(best["value"])
    assert results.best_params["lr"] == float(best["lr"])
    # Nothing left the sweep dir: source_tree_stays_clean (export_dir is opt-in: the TPE test below).


@pytest.mark.timeout(400)
def test_the_docs_tpe_study_resumes_reports_and_its_best_trial_reproduces_the_best_value(user):
    assert_in_page_order("docs/search.md", DOCS_TPE, DOCS_TPE_RESUMED, DOCS_REPORT, DOCS_BEST, DOCS_EXPORT,
                         DOCS_EXPORTED_BEST)
    # 3 trials: the fewest the report plots parameter importances for.
    first = user.run(DOCS_TPE)
    assert first.returncode == 0, first.stderr[-2000:]
    directory = sweep_dir(user, "train_tpe")
    for name in ("trials.csv", "optimization_history.png", "parallel_coordinates.png", "param_importances.png",
                 "experiment/best.yaml", "optimization_results.yaml"):
        assert (directory / name).stat().st_size > 0, name
    assert [row["state"] for row in trials_table(directory)] == ["COMPLETE"] * 3
    assert DOCS_BEST in first.stdout  # the sweep's own hint is the page's next step
    params_before = study_params(directory)

    resumed = user.run(DOCS_TPE_RESUMED)  # one more trial, a new configuration; the first three kept
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = trials_table(directory)
    assert [row["state"] for row in rows] == ["COMPLETE"] * 4
    params_after = study_params(directory)
    assert {n: params_after[n] for n in params_before} == params_before and len(set(params_after.values())) == 4

    (directory / "trials.csv").unlink()  # the report on demand comes from the study alone (as for a running sweep)
    report = user.run(DOCS_REPORT)
    assert report.returncode == 0, report.stderr[-2000:]
    assert trials_table(directory) == rows and "Best trial #" in report.stdout

    best = float(max(rows, key=lambda row: float(row["value"]))["value"])
    again = user.run(DOCS_BEST)
    assert again.returncode == 0, again.stderr[-2000:]
    assert read_metrics(user.runs("train")[-1])["val/acc"] == pytest.approx(best, abs=1e-9)
    assert_every_trial_in_hparams_tab(directory, rows)

    # The finished study again: no trial runs; writing into experiments/ is opt-in (hydra.sweeper.export_dir).
    exported_run = user.run(DOCS_EXPORT)
    assert exported_run.returncode == 0, exported_run.stderr[-2000:]
    assert trials_table(directory) == rows and len(study_states(directory)) == 4
    assert user.source_changes() == "?? experiments/train_tpe_best.yaml\n"  # nothing else left the sweep dir
    exported = user.repo / "experiments" / "train_tpe_best.yaml"
    assert exported.read_text() == (directory / "experiment" / "best.yaml").read_text()
    from_experiments = user.run(DOCS_EXPORTED_BEST)
    assert from_experiments.returncode == 0, from_experiments.stderr[-2000:]
    assert len(user.runs("train")) == 2
    assert read_metrics(user.runs("train")[-1])["val/acc"] == pytest.approx(best, abs=1e-9)
    exported.unlink()  # the copy's source tree is then clean again (source_tree_stays_clean)


def assert_every_trial_in_hparams_tab(directory: Path, rows) -> None:
    """One HPARAMS row per trial, named by its number and swept values, and no single-point hparam charts."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(directory))
    multiplexer.Reload()
    sessions = {}
    for run, tags in multiplexer.PluginRunToTagToContent("hparams").items():
        assert set(tags) == {"_hparams_/session_start_info"}  # no experiment summary, no copied metrics
        start = plugin_data_pb2.HParamsPluginData.FromString(tags["_hparams_/session_start_info"]).session_start_info
        assert run.endswith(f"/tensorboard/{start.group_name}")
        sessions[start.group_name] = start.hparams
    assert len(sessions) == len(rows)
    for row in rows:
        params = sorted(set(row) - {"number", "state", "value", "seconds", "best epoch", "error"})  # the param columns
        swept = " ".join(f"{name}={float(row[name]):.3g}" for name in params)
        hparams = sessions[f"trial {row['number']} {swept}"]
        assert hparams["optimizer.weight_decay"].number_value == pytest.approx(float(row["optimizer.weight_decay"]))
    scalars = [tag for tags in multiplexer.Runs().values() for tag in tags["scalars"]]
    assert scalars and not any(tag.startswith("hparam") for tag in scalars)


FAULTS = ["model._target_=faulty_model.FaultyMLP", "+model.trial=${search.trial}", "+model.faults={1:raise,2:nan_loss,3:oom}",
          "optimized_metric=val/loss", "hydra.sweeper.direction=minimize"]


@pytest.mark.timeout(400)
def test_failing_trials_are_recorded_failed_and_too_many_stop_the_sweep(cli, user):
    # Trial 1 raises, 2 diverges (NaN loss), 3 runs out of memory. With at most 1 failure allowed
    # the sweep stops after trial 2; the same command with a higher limit resumes and finishes.
    stopped = sweep(cli, "search=random", "hydra.sweeper.n_trials=5", "hydra.sweeper.max_failure_rate=0.2",
                    *FAULTS, env=aids_on_path(user))
    assert stopped.returncode == 5, stopped.stderr[-2000:]
    summary = [line for line in stopped.stderr.splitlines() if line.startswith("runlab: error:")]
    assert len(summary) == 1 and "Traceback" not in stopped.stderr
    assert "Stopped the sweep: 2 of 3 trials failed, more than max_failure_rate=0.2 of n_trials=5 allows (1)" in summary[0]
    assert "#1: ValueError: a deliberately failing trial; #2: DivergedError: training diverged at step 1 (epoch 1): " \
           "loss nan" in summary[0]
    directory = sweep_dir(user, "train_random")
    assert study_states(directory) == {0: "COMPLETE", 1: "FAIL", 2: "FAIL"}

    finished = sweep(cli, "search=random", "hydra.sweeper.n_trials=5", "hydra.sweeper.max_failure_rate=0.6",
                     *FAULTS, env=aids_on_path(user))
    assert finished.returncode == 0, finished.stderr[-2000:]
    rows = trials_table(directory)
    assert [row["state"] for row in rows] == ["COMPLETE", "FAIL", "FAIL", "FAIL", "COMPLETE"]
    assert rows[1]["error"] == "ValueError: a deliberately failing trial"
    assert "in forward" in (directory / "1" / "error.txt").read_text()
    assert rows[2]["error"].startswith("DivergedError: training diverged at step 1 (epoch 1): loss nan")
    # OOM recovery backs the trial off to micro-batch 1 first; only then is it a failed trial.
    assert rows[3]["error"].startswith("out of memory: DoesNotFitError: out of memory on cpu even at micro-batch 1")


@pytest.mark.timeout(300)
def test_the_docs_in_memory_sweep_of_two_objectives_reports_its_pareto_front(user):
    (result,) = typed_as_shown(user, DOCS_TWO_OBJECTIVES, "docs/search.md", one_terminal=True)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "the study lives in memory only, so this sweep cannot be resumed" in result.stdout
    directory = sweep_dir(user, "two_objectives")
    assert not (directory / "study.db").exists()
    rows = trials_table(directory)
    assert [row["state"] for row in rows] == ["COMPLETE"] * 3
    points = {int(row["number"]): (float(row["val/acc"]), float(row["val/loss"])) for row in rows}
    front = {n for n, (acc, loss) in points.items()
             if not any(a >= acc and l <= loss and (a, l) != (acc, loss) for a, l in points.values())}
    solutions = OmegaConf.load(directory / "optimization_results.yaml").solutions
    assert sorted(tuple(s["values"]) for s in solutions) == sorted(points[n] for n in front)
    assert f"Pareto front ({len(front)} trials)" in result.stdout and (directory / "pareto_front.png").stat().st_size
    assert sorted(p.name for p in (directory / "experiment").iterdir()) == sorted(f"best_{n}.yaml" for n in front)
    # Each file holds its own trial's config (the TPE test runs such a file again and gets its trial's value).
    for number in front:
        experiment = OmegaConf.load(directory / "experiment" / f"best_{number}.yaml")
        trial = OmegaConf.load(directory / str(number) / ".hydra" / "config.yaml")
        assert experiment.lr == trial.lr and experiment.model == trial.model
        assert all(trial[key] == value for key, value in experiment.items() if key != "defaults")


@pytest.mark.timeout(300)
def test_median_pruner_stops_hopeless_trials_early(cli, user):
    # Half the space cannot learn (lr=1e-7); after two full trials the median pruner stops those.
    result = sweep(cli, "search=random", "hydra.sweeper.n_trials=4", "hydra/sweeper/pruner=median",
                   "hydra.sweeper.pruner.n_startup_trials=2", "hydra.sweeper.pruner.n_warmup_steps=1",
                   "hydra.sweeper.params.lr='choice(0.03,1e-7)'", "trainer.max_epochs=3", "early_stopping.enabled=false")
    assert result.returncode == 0, result.stderr[-2000:]
    directory = sweep_dir(user, "train_random")
    rows = trials_table(directory)
    pruned = [row for row in rows if row["state"] == "PRUNED"]
    assert pruned and all(float(row["lr"]) == 1e-7 for row in pruned)
    for row in pruned:
        metrics = read_metrics(directory / row["number"])
        assert metrics["epoch"] < 3  # stopped early
        assert float(row["value"]) == metrics["val/acc"]  # recorded with its last value
    assert all(read_metrics(directory / row["number"])["epoch"] == 3 for row in rows if row["state"] == "COMPLETE")


@pytest.mark.timeout(400)
def test_a_killed_sweep_resumes_without_replay_and_reruns_its_interrupted_trial(cli, user, tmp_path):
    # The killed driver's trial is taken over once it has had no heartbeat for grace_s.
    args = ["search=random", "hydra.sweeper.n_trials=4", "trainer.max_epochs=4", "early_stopping.enabled=false",
            "hydra.sweeper.heartbeat_s=1", "hydra.sweeper.grace_s=3"]
    driver = user.start(shlex.join(["python", "run.py", *TINY, *args]), tmp_path / "driver.log")
    directory = sweep_dir(user, "train_random")
    try:  # kill -9 once 2 trials are done and a third is mid-way, past its first checkpoint
        deadline = time.monotonic() + 200
        while not (list(states_or_none(directory).values()).count("COMPLETE") >= 2 and checkpointed_running(directory)):
            assert driver.poll() is None and time.monotonic() < deadline, "the sweep ended before it could be killed"
            time.sleep(0.1)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    before, params_before = study_states(directory), study_params(directory)
    (interrupted,) = [number for number, state in before.items() if state == "RUNNING"]

    result = sweep(cli, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    after, params_after = study_states(directory), study_params(directory)
    # Exactly n_trials trials, every configuration a new one (no replay of the seed's first draws).
    assert after == {number: "COMPLETE" for number in range(4)}
    assert len(set(params_after.values())) == 4
    assert {n: params_after[n] for n in params_before} == params_before  # kept, and re-run with its own params
    log = (directory / str(interrupted) / "train.log").read_text()
    # From the last.pt of its interrupted run, in its own run dir; or, where the kill landed after the run's
    # last epoch but before its driver recorded it, the complete run's results as they are (nothing retrained).
    assert "Resumed from" in log or f"{interrupted}/metrics.json." in log.split("nothing left to train; its results are in")[-1]
    assert len(list(directory.glob("*/metrics.json"))) == 4
    assert f"Trial {interrupted} did not finish (no heartbeat from its driver for over 3 s)" in result.stdout


def drawn_running(directory: Path) -> bool:
    """Whether a RUNNING trial has its parameters (one killed between Optuna's ask and its draw
    never ran: the resumed sweep records it so and draws a new trial in its place)."""
    try:
        params = study_params(directory)
    except sqlite3.OperationalError:  # not created yet
        return False
    return any(state == "RUNNING" and params.get(number) for number, state in states_or_none(directory).items())


def checkpointed_running(directory: Path) -> bool:
    """Whether a RUNNING trial has written its first checkpoint."""
    return any(state == "RUNNING" and (directory / str(number) / "checkpoints" / "last.pt").is_file()
               for number, state in states_or_none(directory).items())


def study_params(directory: Path):
    """Each trial's parameters, as stored (categorical ones by index)."""
    with sqlite3.connect(directory / "study.db") as db:
        rows = db.execute("select number, param_name, param_value from trials join trial_params using (trial_id) "
                          "order by param_name").fetchall()
    return {number: tuple((name, value) for n, name, value in rows if n == number) for number, _, _ in rows}


def interrupted_trials(directory: Path) -> set:
    """The trials a killed driver left before their parameters were drawn."""
    with sqlite3.connect(directory / "study.db") as db:
        return {number for (number,) in db.execute(
            "select number from trials join trial_user_attributes using (trial_id) where key = 'interrupted'")}


def states_or_none(directory: Path):
    try:
        return study_states(directory)
    except sqlite3.OperationalError:  # not created yet
        return {}


NAN_IN_TRIAL_1 = ["model._target_=faulty_model.FaultyMLP", "+model.trial=${search.trial}", "+model.faults={1:nan_loss}"]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray cluster started with `ray start --head`, with token authentication on, for the tests
    that join it: (its address, the environment of the commands that do). Its token is the tests'
    own (~/.ray/auth_token of a HOME of their own), and so is Ray's temp dir, short enough for
    Ray's socket paths: no other Ray on this machine finds the cluster."""
    home, ray_dir = tmp_path_factory.mktemp("ray_home"), Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    log, port, ray = home / "head.log", free_port(), str(Path(sys.prefix) / "bin" / "ray")
    # Its workers import the testing aids (faulty models) from tests/, as a user's cluster would their code.
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO / "tests")}
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    with open(log, "w") as output:
        head = subprocess.Popen([ray, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={ray_dir}",
                                 "--include-dashboard=false", "--block"], cwd=home, env=env, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_head(head, port, log)
        assert "Token authentication is enabled for this Ray cluster" in log.read_text()
        yield f"127.0.0.1:{port}", {"HOME": str(home)}
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its cluster
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
        end_session(head.pid)
        shutil.rmtree(ray_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_head(head: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            if "--block" in log.read_text():  # ray start prints it once the cluster is up
                return
        if head.poll() is not None or time.monotonic() > deadline:
            pytest.skip(f"Ray cannot start a cluster here: {log.read_text()[-1500:]}")
        time.sleep(0.5)


def end_session(session: int) -> None:
    """SIGKILL every process left in the session a test started (its command was the session leader)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # stat's 6th field; [0] is the state after the command name
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


@pytest.mark.timeout(400)
def test_a_sweep_killed_on_a_token_ray_cluster_resumes_without_replay_and_records_its_diverged_trial(
        cli, user, tmp_path, ray_cluster):
    # launcher=ray_local joins the cluster ray start made (token authentication on): 3 trials on its 2
    # slots; trial 1 diverges (a NaN loss) and is FAIL, though optimized_metric is val/acc.
    address, env = ray_cluster
    args = ["search=random", "launcher=ray_local", f"+hydra.launcher.ray.init.address={address}",
            "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2", "hydra.sweeper.max_failure_rate=0.5",
            "trainer.max_epochs=4", "early_stopping.enabled=false", "hydra.sweeper.heartbeat_s=1",
            "hydra.sweeper.grace_s=3", *NAN_IN_TRIAL_1]
    driver = user.start(shlex.join(["python", "run.py", *TINY, *args]), tmp_path / "driver.log", env=env)
    directory = sweep_dir(user, "train_random")
    try:  # kill -9 once a trial has ended and another is running with its parameters drawn
        deadline = time.monotonic() + 200
        while not ({"COMPLETE", "FAIL"} & set(states_or_none(directory).values()) and drawn_running(directory)):
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.1)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    before, params_before = study_states(directory), study_params(directory)
    assert "RUNNING" in before.values()

    result = sweep(cli, *args, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    after = study_states(directory)
    # The kill may land between Optuna's ask and its draw: such a trial never ran, is recorded so, and a
    # new draw takes its place.
    never_ran = interrupted_trials(directory)
    assert never_ran <= {n for n, state in before.items()
                         if state == "RUNNING" and len(params_before.get(n, ())) < len(params_before[1])}
    ran = [n for n in sorted(after) if n not in never_ran]
    assert [after[n] for n in ran] == ["COMPLETE", "FAIL", "COMPLETE"]
    params_after = study_params(directory)
    assert len({params_after[n] for n in ran}) == 3
    assert {n: params_after[n] for n in params_before} == params_before
    rows = trials_table(directory)
    assert rows[1]["error"].startswith("DivergedError: training diverged at step 1 (epoch 1): loss nan")
    for number in (ran[0], ran[2]):
        assert "torch runs on 1 threads" in (directory / str(number) / "train.log").read_text()
        assert read_metrics(directory / str(number))["epoch"] == 4
    # The Ray workers reported every epoch to the shared study, which is what a pruner reads.
    with sqlite3.connect(directory / "study.db") as db:
        assert db.execute("select count(*) from trial_intermediate_values").fetchone() == (8,)


def test_a_ray_cluster_that_refuses_the_token_ends_the_sweep_in_one_line(cli, ray_cluster):
    address, env = ray_cluster
    refused = sweep(cli, "search=random", "launcher=ray_local", f"+hydra.launcher.ray.init.address={address}",
                    env={**env, "RAY_AUTH_TOKEN": "not-the-token"})
    assert f"The Ray cluster at {address} uses token authentication and refused the token in RAY_AUTH_TOKEN" in \
        one_line_error(refused, 5)


@pytest.mark.timeout(300)
def test_a_command_line_grid_runs_on_the_ray_launcher(cli, user, ray_cluster):
    # On the cluster the tests above started (a local instance starts in the test below, and in
    # test_sweep_drivers.py, where a Ray driver runs its trials to the end).
    address, env = ray_cluster
    result = cli("-m", *TINY, "lr=1e-3,3e-3", "launcher=ray_local", f"+hydra.launcher.ray.init.address={address}", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    (grid,) = (user.outputs / "train" / "multirun").iterdir()
    assert [read_metrics(grid / str(number))["epoch"] for number in (0, 1)] == [2, 2]
    # Hydra's basic sweeper on the Ray launcher ends with the multirun's summary too.
    assert "Best job #" in result.stdout and (grid / "jobs.csv").is_file()


def ray_processes(pid: int) -> set:
    """(pid, start time) of each Ray process under ``pid``."""
    import psutil

    found = set()
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ray" in " ".join(child.cmdline()) and "reaper.py" not in " ".join(child.cmdline()):
                found.add((child.pid, child.create_time()))
    return found


def alive(processes: set) -> set:
    import psutil

    def running(pid: int, started: float) -> bool:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            return process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE
        return False

    return {(pid, started) for pid, started in processes if running(pid, started)}


@pytest.mark.timeout(300)
def test_nothing_of_a_local_ray_instance_outlives_its_killed_sweep_driver(user, tmp_path):
    # Left alone, Ray's DashboardAgent and RuntimeEnvAgent live on for about a minute after a kill -9.
    command = ["python", "run.py", *TINY, "search=random", "launcher=ray_local", "trainer.max_epochs=200"]
    driver = user.start(shlex.join(command), tmp_path / "driver.log")
    try:
        deadline = time.monotonic() + 200
        while not list(sweep_dir(user, "train_random").glob("*/train.log")):  # a trial runs on a Ray worker
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()[-2000:]
            time.sleep(0.2)
        processes = ray_processes(driver.pid)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert len(processes) >= 4  # the GCS, the raylet, its two agents, the trial's worker
    deadline = time.monotonic() + 15
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(processes)
