"""Checkpoints and validation on a schedule of steps or minutes (checkpoint.every_n_steps,
checkpoint.every_minutes, checkpoint.keep_last, trainer.val_every_n_steps): long epochs lose
little to a kill -9, and early stopping, best.pt, the pruner and the logs follow validations."""
import csv
import itertools
import os
import shlex
import signal
import sqlite3
from pathlib import Path
from typing import List

import pytest

from conftest import read_metrics
from framework import checkpoint as checkpoint_module
from framework.checkpoint import load_checkpoint
from framework.errors import ConfigError
from test_faults import trained_in_process, wait_for
from test_parallel import gone, worker_pids
from test_training import assert_same_weights, final_weights

RUN = ["trainer.max_epochs=2", "model.dropout=0.2", "early_stopping.enabled=false", "logger=csv"]  # 19 steps an epoch


def validation_steps(run_dir: Path) -> List[int]:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row["metric"] == "val/loss"]


def kept(run_dir: Path) -> List[str]:
    return sorted((path.name for path in (run_dir / "checkpoints").glob("step-*.pt")),
                  key=lambda name: int(name[5:-3]))


def test_validation_every_n_steps_is_logged_and_saved_mid_epoch(train):
    metrics, run_dir = train(*RUN, "trainer.val_every_n_steps=5", "checkpoint.every_n_steps=3", "checkpoint.keep_last=2")
    # Every 5 steps, and at each epoch's end (step 19, 38) where a validation on the step schedule is not.
    assert validation_steps(run_dir) == [5, 10, 15, 19, 20, 25, 30, 35, 38]
    assert metrics["epoch"] == 2 and metrics["step"] == 38
    assert kept(run_dir) == ["step-36.pt", "step-38.pt"]  # written at 36 (every 3 steps), then at the epoch's end
    assert load_checkpoint(run_dir / "checkpoints" / "step-36.pt")["batch_in_epoch"] == 17


def test_patience_counts_validations(train):
    # Nothing improves by min_delta after the first validation: the run stops at the third, mid-epoch.
    metrics, run_dir = train(*RUN, "trainer.val_every_n_steps=5", "early_stopping.enabled=true",
                             "early_stopping.patience=2", "early_stopping.min_delta=1e9", "checkpoint.monitor=val/loss")
    assert validation_steps(run_dir) == [5, 10, 15] and metrics["step"] == 15 and metrics["epoch"] == 0
    assert "did not improve for 2 validations" in (run_dir / "train.log").read_text()
    saved = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert (saved["step"], saved["batch_in_epoch"], saved["validations"]) == (15, 15, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_from_a_mid_epoch_checkpoint_ends_where_the_uninterrupted_run_ends(train, workers):
    schedule = ["checkpoint.every_n_steps=4", "checkpoint.keep_last=20", "trainer.val_every_n_steps=7",
                f"data.num_workers={workers}"]
    _, whole = train(*RUN, *schedule)
    mid_epoch = whole / "checkpoints" / "step-24.pt"
    assert load_checkpoint(mid_epoch)["batch_in_epoch"] == 5
    _, resumed = train(*RUN, *schedule, f"resume={mid_epoch}")
    assert_same_weights(final_weights(whole), final_weights(resumed))
    assert validation_steps(resumed) == [28, 35, 38]  # the schedule goes on where it was


def test_minutes_schedule_writes_mid_epoch(train, monkeypatch):
    clock = itertools.count(step=20.0)  # each look at the clock: 20 s later
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: next(clock))
    _, run_dir = train(*RUN, "checkpoint.every_minutes=1", "checkpoint.keep_last=100")
    steps = [int(name[5:-3]) for name in kept(run_dir)]
    assert any(step % 19 for step in steps)  # some written mid-epoch
    assert steps[-1] == 38


@pytest.mark.parametrize("key, value, allowed", [
    ("checkpoint.every_n_steps", -1, "use 0 (off) or a positive count"),
    ("checkpoint.keep_last", -2, "use 0 (off) or a positive count"),
    ("checkpoint.every_minutes", "-0.5", "use 0 (off) or a positive number of minutes"),
    ("trainer.val_every_n_steps", -3, "use 0 (once per epoch) or a positive count"),
])
def test_a_negative_schedule_is_refused_before_any_work(train, key, value, allowed):
    with pytest.raises(ConfigError) as error:
        train(f"{key}={value}")
    assert f"{key}={value} is invalid; {allowed}" in str(error.value)


def test_the_pruner_hears_every_validation(cli, user):
    result = cli("-m", "search=random", "hydra.sweeper.n_trials=1", "trainer.max_epochs=1", "trainer.val_every_n_steps=4",
                 "trainer.progress_bar=false", "logger=csv", "model.width=16")
    assert result.returncode == 0, result.stderr[-2000:]
    (study,) = user.outputs.glob("train/multirun/*/study.db")
    with sqlite3.connect(study) as db:
        steps = [step for (step,) in db.execute("select step from trial_intermediate_values order by step")]
    validations = validation_steps(study.parent / "0")  # every 4 steps, and at the epoch's end
    assert "\x1b[" not in result.stdout + result.stderr + (study.parent / "0" / "train.log").read_text()  # no colour codes
    assert "search.storage" not in result.stdout and "RUNLAB_" not in result.stdout  # nor plumbing in the override lines
    assert len(validations) > 3 and steps == list(range(1, len(validations) + 1))


# --- kill -9 right after a mid-epoch checkpoint --------------------------------------------------

KILLED = ["batch_size=32", "model.width=32", "early_stopping.enabled=false", "logger=none",
          "trainer.progress_bar=false", "checkpoint.every_n_steps=6", "model.dropout=0.2"]


def saved_mid_epoch(run_glob) -> bool:
    for path in run_glob():
        try:
            state = load_checkpoint(path)
        except Exception:  # noqa: BLE001 - renamed into place between the glob and the read
            return False
        return state["epoch"] >= 1 and state["batch_in_epoch"] > 0
    return False


# Epochs enough that the run is still going when the test sees its first checkpoint of epoch 1 and kills
# it: 3 epochs of the tiny MLP took about 0.15 s in one process, and that run sometimes ended first.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel, epochs", [("none", 40), ("ddp", 4)])
def test_kill_9_after_a_mid_epoch_checkpoint_then_resume_auto_gives_the_uninterrupted_weights(
        train, user, tmp_path, parallel, epochs):
    killed = [*KILLED, f"trainer.max_epochs={epochs}"]
    args = [f"parallel={parallel}", "name=killed", *killed]
    log = tmp_path / "first.log"
    process = user.start(shlex.join(["python", "run.py", *args]), log)
    wait_for(lambda: saved_mid_epoch(lambda: user.outputs.glob("killed/*/checkpoints/last.pt")), process, log)
    workers = worker_pids(process.pid) if parallel == "ddp" else []
    assert len(workers) == (2 if parallel == "ddp" else 0)
    os.killpg(process.pid, signal.SIGKILL)  # the run; ddp's workers, in groups of their own, follow their parent
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert all(gone(pid) for pid in workers), "a ddp worker outlived its launcher"
    (first,) = user.runs("killed")
    assert not (first / "metrics.json").exists()
    # The resume in-process (one process start fewer; test_faults.py types resume=auto), under ddp spawning its workers.
    trained_in_process(user, *args, "resume=auto")
    second = user.runs("killed")[-1]
    assert "Resumed from" in (second / "train.log").read_text()
    assert read_metrics(second)["step"] == epochs * 39  # 1,257 train samples: 39 batches of 32
    # In-process (one process start fewer); under ddp, as each rank draws its own dropout masks, an
    # uninterrupted ddp run, whose launch spawns the same 2 workers.
    _, reference = train(f"parallel={parallel}", *(arg for arg in killed if not arg.startswith("trainer.progress_bar")))
    assert_same_weights(final_weights(reference), final_weights(second))
