"""Sweeps end to end: real `python run.py` multiruns of tiny digits runs, outputs under tmp_path."""
from __future__ import annotations

import csv
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, read_metrics

# Seconds-long trials: 2 epochs of a one-layer MLP, CSV logs (TensorBoard where a test needs it).
TINY = ["trainer.max_epochs=2", "trainer.progress_bar=false", "model.width=32", "model.depth=1", "batch_size=64",
        "logger=csv"]
WITH_AIDS = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


def sweep_dir(tmp_path: Path, study: str) -> Path:
    return tmp_path / "outputs" / "train" / "multirun" / study


def trials_table(directory: Path):
    with open(directory / "trials.csv") as handle:
        return list(csv.DictReader(handle))


def study_states(directory: Path):
    with sqlite3.connect(directory / "study.db") as db:
        return dict(db.execute("select number, state from trials"))


def test_sweep_configs_compose_as_multiruns(tmp_path):
    from conftest import composed

    grid = composed("search=grid")
    assert grid.hydra.mode.name == "MULTIRUN" and grid.hydra.sweeper.params["lr"] == "1e-3,3e-3"
    for name, sampler in (("random", "RandomSampler"), ("tpe", "TPESampler")):
        cfg = composed(f"search={name}")
        assert cfg.hydra.sweeper._target_.endswith("RunlabSweeper")
        assert cfg.hydra.sweeper.sampler._target_ == f"optuna.samplers.{sampler}"
        assert set(cfg.hydra.sweeper.params) == {"lr", "batch_size", "model.width", "model.depth", "optimizer.weight_decay"}
    # The stock plugins stay available.
    assert composed("search=tpe", "hydra/sweeper=optuna").hydra.sweeper._target_.endswith("OptunaSweeper")


@pytest.mark.timeout(240)
def test_command_line_grid_runs_one_complete_job_per_value(tmp_path):
    command = [sys.executable, "run.py", "-m", "lr=1e-3,3e-3", *TINY, f"paths.output_dir={tmp_path / 'outputs'}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted((tmp_path / "outputs" / "train" / "multirun").glob("*/*/metrics.json"))
    assert len(runs) == 2
    lrs = sorted(float(p.parent.joinpath(".hydra/overrides.yaml").read_text().split("lr=")[1].split()[0]) for p in runs)
    assert lrs == [1e-3, 3e-3]
    assert all(read_metrics(p.parent)["epoch"] == 2 for p in runs)


@pytest.mark.timeout(240)
def test_random_sweep_runs_n_trials_and_writes_its_report(cli, tmp_path):
    result = cli("search=random", "hydra.sweeper.n_trials=3", *TINY, f"hydra.sweeper.export_dir={tmp_path / 'exp'}")
    assert result.returncode == 0, result.stderr[-2000:]
    directory = sweep_dir(tmp_path, "train_random")
    rows = trials_table(directory)
    assert [row["state"] for row in rows] == ["COMPLETE"] * 3
    assert len({row["lr"] for row in rows}) == 3
    for number in range(3):
        assert float(rows[number]["value"]) == read_metrics(directory / str(number))["val/acc"]
    assert "Trials of study 'train_random'" in result.stdout


@pytest.mark.timeout(300)
def test_tpe_sweep_report_and_best_experiment_reproduces_the_best_value(cli, tmp_path):
    export = tmp_path / "search_path" / "experiment"
    result = cli("search=tpe", "hydra.sweeper.n_trials=4", *TINY, "logger=tensorboard",
                 f"hydra.sweeper.export_dir={export}")
    assert result.returncode == 0, result.stderr[-2000:]
    directory = sweep_dir(tmp_path, "train_tpe")
    for name in ("trials.csv", "optimization_history.png", "parallel_coordinates.png", "param_importances.png",
                 "best.yaml"):
        assert (directory / name).stat().st_size > 0, name
    rows = trials_table(directory)
    assert len(rows) == 4 and all(row["state"] == "COMPLETE" for row in rows)
    best = max(rows, key=lambda row: float(row["value"]))
    assert (export / "train_tpe_best.yaml").read_text() == (directory / "best.yaml").read_text()

    again = cli(f"hydra.searchpath=[file://{export.parent}]", "experiment=train_tpe_best",
                f"hydra.run.dir={tmp_path / 'again'}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert read_metrics(tmp_path / "again")["val/acc"] == pytest.approx(float(best["value"]), abs=1e-9)
    assert_every_trial_in_hparams_tab(directory, rows)


def assert_every_trial_in_hparams_tab(directory: Path, rows) -> None:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(directory))
    multiplexer.Reload()
    sessions = {}
    for run, tags in multiplexer.PluginRunToTagToContent("hparams").items():
        for content in tags.values():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                sessions[run] = data.session_start_info.hparams
    assert len(sessions) == len(rows)
    for row in rows:
        hparams = sessions[f"{row['number']}/tensorboard"]
        assert hparams["optimizer.weight_decay"].number_value == pytest.approx(float(row["optimizer.weight_decay"]))
