import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from framework.errors import CheckpointError
from framework.checkpoint import (Checkpointer, atomic_link, EarlyStopping, MetricTracker, load_checkpoint, load_model,
                                  rng_state, save_checkpoint, set_rng_state)


def test_metric_tracker_respects_mode_and_min_delta():
    tracker = MetricTracker("val/acc", "max", min_delta=0.05)
    assert tracker.improved({"val/acc": 0.5})
    assert not tracker.improved({"val/acc": 0.52})
    assert tracker.improved({"val/acc": 0.6}) and tracker.best == 0.6
    low = MetricTracker("val/loss", "min")
    assert low.improved({"val/loss": 1.0}) and low.improved({"val/loss": 0.9}) and not low.improved({"val/loss": 0.95})


def test_early_stopping_counts_epochs_without_improvement():
    stopper = EarlyStopping("val/loss", "min", patience=2, min_delta=0.0, enabled=True)
    assert [stopper.update({"val/loss": v}) for v in (1.0, 0.9, 0.95, 0.97)] == [False, False, False, True]


def test_rng_state_round_trips_every_generator_through_a_checkpoint(tmp_path):
    save_checkpoint({"rng": rng_state()}, tmp_path / "c.pt")
    draws = (torch.rand(3), np.random.rand(3), random.random())
    state = load_checkpoint(tmp_path / "c.pt")["rng"]
    set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]
    # Checkpoints written before the generators' words were tensors hold Python's as a list.
    state["python"][1] = state["python"][1].tolist()
    set_rng_state(state)
    assert random.random() == draws[2]


def test_checkpoint_round_trips_through_weights_only_loading(tmp_path):
    save_checkpoint({"model": {"w": torch.ones(2)}, "rng": rng_state(), "step": 3}, tmp_path / "c.pt")
    state = load_checkpoint(tmp_path / "c.pt")
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.ones(2))


def test_corrupt_and_foreign_checkpoints_are_refused(tmp_path):
    save_checkpoint({"step": 3}, tmp_path / "whole.pt")
    (tmp_path / "corrupt.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:200])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(tmp_path / "corrupt.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a runlab checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_load_model_rebuilds_the_trained_network_from_the_file_alone(train):
    metrics, run_dir = train()
    model = load_model(run_dir / "checkpoints" / "last.pt")
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items())
    assert not model.training
    assert state["config"]["model"]["width"] == 32 and state["model_spec"]["num_classes"] == 10


KILL_MID_WRITE = textwrap.dedent("""
    import os, signal, sys, torch
    from framework.checkpoint import save_checkpoint
    path = sys.argv[1]
    save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    real_save = torch.save
    def dying_save(obj, target):
        with open(target, "wb") as handle:
            handle.write(b"PK\\x03\\x04 half a checkpoint")
            handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save = dying_save
    save_checkpoint({"step": 2, "w": torch.zeros(1000)}, path)
""")


def test_a_kill_during_a_checkpoint_write_leaves_the_last_good_one(tmp_path):
    path = tmp_path / "last.pt"
    result = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(path)], capture_output=True, timeout=120)
    assert result.returncode == -9
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(1000))
    assert any(name.startswith(".last.pt.tmp") for name in os.listdir(tmp_path))  # the torn write stayed aside


def test_a_failed_background_write_surfaces_on_the_training_thread(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint folder should be")
    checkpointer = Checkpointer(blocker, "val/acc", "max", enabled=True, is_writer=True)
    checkpointer.maybe_save(lambda: {"w": torch.ones(1)}, {"val/acc": 0.5})
    with pytest.raises(OSError):
        checkpointer.wait()


def test_the_snapshot_is_not_changed_by_later_training(tmp_path):
    weights = torch.zeros(3)
    checkpointer = Checkpointer(tmp_path, "val/acc", "max", enabled=True, is_writer=True)
    checkpointer.maybe_save(lambda: {"w": weights}, {"val/acc": 0.5})
    weights += 1  # the next step changes the live tensor while the write may still run
    checkpointer.wait()
    assert torch.equal(load_checkpoint(tmp_path / "last.pt")["w"], torch.zeros(3))
    assert (tmp_path / "best.pt").is_file()


def test_best_keeps_its_epoch_when_later_epochs_replace_last(tmp_path):
    """best.pt is a second name of the last.pt it was (no copy); replacing last.pt must leave it be."""
    checkpointer = Checkpointer(tmp_path, "val/acc", "max", enabled=True, is_writer=True)
    for epoch, accuracy in enumerate([0.5, 0.7, 0.6]):
        checkpointer.maybe_save(lambda: {"epoch": epoch, "w": torch.full((3,), float(epoch))}, {"val/acc": accuracy})
        checkpointer.wait()
    best, last = load_checkpoint(tmp_path / "best.pt"), load_checkpoint(tmp_path / "last.pt")
    assert best["epoch"] == 1 and torch.equal(best["w"], torch.ones(3))
    assert last["epoch"] == 2 and torch.equal(last["w"], torch.full((3,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "last.pt"]  # no temporary file left


def test_linking_best_to_the_same_last_twice_leaves_no_temporary_file(tmp_path):
    """rename() does nothing when both names already are the same file: the link's temporary name must still go."""
    save_checkpoint({"epoch": 1}, tmp_path / "last.pt")
    for _ in range(3):
        atomic_link(tmp_path / "last.pt", tmp_path / "best.pt")
    assert load_checkpoint(tmp_path / "best.pt")["epoch"] == 1
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "last.pt"]


def test_a_file_torch_did_not_write_is_called_what_it_is(tmp_path):
    import os
    import pickle

    (tmp_path / "raw.pkl").write_bytes(pickle.dumps({"model": {}}))
    with pytest.raises(CheckpointError, match="is not a checkpoint file: it is a raw Python pickle, not torch.save's "
                                              r"format, and was not unpickled \(a pickle can run code\)"):
        load_checkpoint(tmp_path / "raw.pkl")
    with pytest.raises(CheckpointError, match=r"/etc/passwd is not a checkpoint file: it is a text file \(it starts "
                                              "with 'root:"):
        load_checkpoint("/etc/passwd")
    torch.save({"format": "runlab-checkpoint", "run": os.system}, tmp_path / "code.pt")
    with pytest.raises(CheckpointError, match="was refused and not executed: it is a torch file whose pickle names "
                                              "code to run"):
        load_checkpoint(tmp_path / "code.pt")
    os.mkfifo(tmp_path / "pipe.pt")
    with pytest.raises(CheckpointError, match=r"'.*pipe.pt' is a named pipe \(FIFO\), not a checkpoint file"):
        load_checkpoint(tmp_path / "pipe.pt")
