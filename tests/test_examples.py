"""The three examples that show runlab trains more than classifiers, each run as a user types it
(a fresh copy of the repository, a subprocess, no override of a default path):

- regression on scikit-learn's diabetes data (experiment=diabetes_regression);
- a character-level language model that defines its own loss (experiment=char_lm);
- a user's own package, examples/user_project: its Dataset of dict samples, model and loss.

Each trains to better than a trivial predictor, resumes exactly after an interruption, trains
under parallel=ddp as it does in one process, and runs as a random search on its own metric.
The pages' commands for these examples run here, verbatim, and nowhere else (tests/test_readme.py
leaves them to these tests): each is the uninterrupted run that a resume must end as, or the
one-process run of a ddp comparison; the other runs compared with run in-process.
"""
import csv
import math
import re
import shlex
import signal

import pytest
import torch
import yaml

from conftest import read_metrics
from framework.checkpoint import load_checkpoint
from test_faults import wait_for
from test_logging import read_events
from test_parallel import running_losses

QUICK = ["trainer.progress_bar=false"]
USER_PROJECT = "PYTHONPATH=examples/user_project python run.py --config-dir examples/user_project/conf"
# command, a small budget, the metric best.pt follows
EXAMPLES = {
    "diabetes_regression": ("python run.py experiment=diabetes_regression",
                            ["trainer.max_epochs=40", "early_stopping.enabled=false"], "val/rmse"),
    "char_lm": ("python run.py experiment=char_lm", ["data.max_chars=30000", "batch_size=16", "model.width=48",
                                                     "trainer.max_epochs=3"], "val/loss"),
    "waves": (f"{USER_PROJECT} experiment=waves", ["data.num_samples=1536", "trainer.max_epochs=4"], "val/mae"),
}
# The pages' commands for the examples, which tests/test_readme.py leaves to the tests below.
DOCS_DIABETES = "python run.py experiment=diabetes_regression trainer.max_epochs=40"
DOCS_CHAR_LM = "python run.py experiment=char_lm data.max_chars=40000 trainer.max_epochs=2"
README_WAVES = f"{USER_PROJECT} experiment=waves trainer.max_epochs=3"
README_OWN_DATA = ("PYTHONPATH=examples/user_project python run.py data=custom data._target_=waves.data.make_waves "
                   "+data.num_samples=1024 +data.length=64 +data.noise=0.2 +data.seed=0 model=custom "
                   "model._target_=waves.model.WaveNet +model.channels=16 +model.hidden=64 +model.outputs=2 "
                   "objective=regression trainer.max_epochs=2")  # the user project on the command line alone
# Each example's command as its page shows it (tests/test_readme.py checks that the pages still do).
ON_THE_PAGES = {"diabetes_regression": DOCS_DIABETES, "char_lm": DOCS_CHAR_LM, "waves": README_WAVES}


def typed(name: str, *overrides: str, multirun: bool = False) -> str:
    command, budget, _ = EXAMPLES[name]
    if multirun:
        command = command.replace(" experiment=", " -m experiment=")
    return " ".join([command, *map(shlex.quote, [*budget, *QUICK, *overrides])])


def reference_run(train, name: str, run_name: str, *overrides: str):
    """The run dir of a run the test compares with, in-process (one process start fewer)."""
    command, budget, _ = EXAMPLES[name]
    _, run_dir = train(command.split()[-1], *budget, *QUICK, f"name={run_name}", *overrides, shrink=False)
    return run_dir


def final_weights(run_dir):
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


def trained_better_than_a_trivial_predictor(name: str, metrics: dict) -> None:
    if name == "diabetes_regression":
        assert metrics["test/r2"] > 0.2 and metrics["test/rmse"] < 65  # predicting the mean: r2 0, rmse about 77
    elif name == "char_lm":
        max_chars = int(re.search(r"data.max_chars=(\d+)", DOCS_CHAR_LM)[1])
        vocabulary = len(set(open_text_prefix(max_chars)))
        assert metrics["test/loss"] < 0.75 * math.log(vocabulary)  # a uniform guess: log(vocabulary) nats
        assert metrics["test/perplexity"] == pytest.approx(math.exp(metrics["test/loss"]), rel=1e-6)
    else:
        assert metrics["test/mae"] < 0.35  # predicting the mean frequency and amplitude: about 0.7


def open_text_prefix(chars: int) -> str:
    from framework.data import read_text

    return read_text("")[:chars]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, stop, workers", [
    ("diabetes_regression", signal.SIGTERM, 0),
    ("char_lm", signal.SIGTERM, 0),
    ("waves", signal.SIGKILL, 2),  # kill -9, and batches from 2 DataLoader workers (the page's run: none)
])
def test_an_example_trains_and_resumes_exactly_after_an_interruption(user, tmp_path, name, stop, workers):
    command = ON_THE_PAGES[name]
    whole = user.run(command)  # as the page shows it: the run the interrupted one must end as
    assert whole.returncode == 0, f"`{command}` exited {whole.returncode}:\n{(whole.stdout + whole.stderr)[-3000:]}"
    (uninterrupted,) = user.runs(name)
    overrides = f"name={name}_cut data.num_workers={workers}"
    log = tmp_path / "first.log"
    # Started with exec (so that the signal reaches python): the PYTHONPATH= prefix goes in the environment.
    _, prefixed, cut = f"{command} {overrides}".rpartition("PYTHONPATH=examples/user_project ")
    process = user.start(cut, log, env={"PYTHONPATH": "examples/user_project"} if prefixed else None)
    wait_for(lambda: list(user.outputs.glob(f"{name}_cut/*/checkpoints/last.pt")), process, log)
    process.send_signal(stop)
    assert process.wait(timeout=60) == (128 + stop if stop == signal.SIGTERM else -stop), log.read_text()[-3000:]
    resumed = user.run(f"{command} {overrides} resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from" in resumed.stdout + resumed.stderr
    (cut,) = user.runs(f"{name}_cut")[-1:]
    for key, value in final_weights(uninterrupted).items():
        assert torch.equal(final_weights(cut)[key], value), key
    metrics, resumed_metrics = read_metrics(uninterrupted), read_metrics(cut)
    scores = [key for key in metrics if key.startswith(("val/", "test/"))]
    assert {key: resumed_metrics[key] for key in scores} == {key: metrics[key] for key in scores}
    trained_better_than_a_trivial_predictor(name, metrics)


@pytest.mark.timeout(300)
def test_the_char_lm_example_with_its_own_loss_trains_under_ddp_as_in_one_process(user, train):
    # One epoch: still several logged losses to compare (2). No dropout: the model is the same on both ranks.
    same = ["logger=csv", "trainer.max_epochs=1", "model.dropout=0.0"]
    two = user.run(typed("char_lm", "name=two", *same, "parallel=ddp", "parallel.world_size=2"))
    assert two.returncode == 0, two.stderr[-3000:]
    one_dir, (two_dir,) = reference_run(train, "char_lm", "one", *same), user.runs("two")
    losses, expected = running_losses(two_dir), running_losses(one_dir)
    assert len(losses) == len(expected) > 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    assert read_metrics(two_dir)["val/loss"] == pytest.approx(read_metrics(one_dir)["val/loss"], rel=1e-3)


def running_losses_in_tensorboard(run_dir) -> list:
    """The epoch's running mean training loss every trainer.log_every_n_steps, as TensorBoard (the default
    logger) has it."""
    return [event.value for event in read_events(run_dir).Scalars("train/loss_running")]


@pytest.mark.timeout(300)
def test_the_readmes_own_dataset_model_and_loss_train_under_ddp_as_in_one_process(user):
    """A user's Dataset of dict samples through DataLoaders on 2 processes: the README's command, then the
    same under ddp."""
    command = README_OWN_DATA
    one = user.run(command)
    assert one.returncode == 0, f"`{command}` exited {one.returncode}:\n{(one.stdout + one.stderr)[-3000:]}"
    two = user.run(f"{command} name=two parallel=ddp parallel.world_size=2")
    assert two.returncode == 0, two.stderr[-3000:]
    (one_dir,), (two_dir,) = user.runs("train"), user.runs("two")
    losses, expected = running_losses_in_tensorboard(two_dir), running_losses_in_tensorboard(one_dir)
    assert len(losses) == len(expected) > 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    assert read_metrics(two_dir)["val/mae"] == pytest.approx(read_metrics(one_dir)["val/mae"], rel=1e-3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, space", [
    ("diabetes_regression", []),  # the shipped search space: lr, batch_size, model.width/depth, weight_decay
    ("char_lm", []),
    ("waves", ["~hydra.sweeper.params", "lr=tag(log, interval(1e-3, 1e-2))", "model.hidden=choice(32, 64)"]),
])
def test_an_example_sweeps_on_its_own_metric_in_its_direction(user, name, space):
    # 2 one-epoch trials: two different values tell the direction (the best is the lower one).
    result = user.run(typed(name, "search=random", "hydra.sweeper.n_trials=2", "trainer.max_epochs=1", "logger=none",
                            *space, multirun=True), timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    (study,) = (user.outputs / name / "multirun").glob("*/optimization_results.yaml")
    with open(study.parent / "trials.csv", newline="") as handle:
        values = [float(row["value"]) for row in csv.DictReader(handle)]
    assert len(values) == 2 and len(set(values)) == 2
    # Every monitor of these examples is better lower: the best trial is the lowest (direction auto).
    assert yaml.safe_load(study.read_text())["best_value"] == pytest.approx(min(values), rel=1e-6)
    for trial in range(2):
        assert EXAMPLES[name][2] in read_metrics(study.parent / str(trial))
