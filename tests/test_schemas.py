"""Every option of model, optimizer and scheduler is a typed schema, and every ``_target_`` is checked
against its signature before any work: a misspelt key, a value of the wrong type or a key the target
does not take is refused in one line naming what is accepted (issue 23's table)."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from conftest import one_line_error
from framework.errors import ConfigError

MLP_KEYS = "its keys are: width, depth, dropout, batch_norm."


def experiment(tmp_path: Path, text: str) -> str:
    """A user's experiment YAML, found as experiments/ is (``experiment=NAME``), from its own search path."""
    folder = tmp_path / "extra" / "experiment"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "typo.yaml").write_text(f"# @package _global_\n{text}")
    return f"hydra.searchpath=[file://{tmp_path / 'extra'}]"


def refusal(train, *overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        train(*overrides, shrink=False)  # refused before any training: nothing to shrink
    line = str(error.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("yaml, expected", [
    ("trainer:\n  max_epoch: 3\n", "trainer.max_epoch is not a key of"),
    ("defaults:\n  - override /model: cnn\nmodel:\n  widht: 64\n",
     "model.widht is not a key of model=cnn; its keys are: channels, width, dropout, batch_norm."),
    ("optimizer:\n  weight_decy: 0.1\n", "optimizer.weight_decy is not a key of optimizer=adamw; its keys are: lr, weight_decay, fused."),
])
def test_a_typo_in_an_experiment_is_refused_in_one_line(train, tmp_path, yaml, expected):
    assert expected in refusal(train, experiment(tmp_path, yaml), "experiment=typo")


@pytest.mark.parametrize("override, expected", [
    ("model.widht=64", f"model.widht is not a key of model=mlp; {MLP_KEYS}"),
    ("optimizer.weight_decy=0.1", "optimizer.weight_decy is not a key of optimizer=adamw; its keys are: lr, weight_decay, fused."),
    ("scheduler.T_mx=3", "scheduler.T_mx is not a key of scheduler=cosine; its keys are: interval, T_max."),
    ("+model.widht=64", "model.widht is not an argument of framework.model.MLP; its arguments are: width, depth, dropout, "
                        "batch_norm (and input_shape, num_classes, which runlab passes)."),
    ("+optimizer.weight_decy=0.1", "optimizer.weight_decy is not an argument of torch.optim.AdamW; its arguments are: lr, "
                                   "betas, eps, weight_decay,"),
    ("model.width=abc", "model.width=abc (Value 'abc' of type 'str' could not be converted to Integer)"),
    ("scheduler.interval=week", "scheduler.interval='week' is not allowed; choose one of epoch, step."),
])
def test_a_typo_on_the_command_line_is_refused_in_one_line(train, override, expected):
    assert expected in refusal(train, override)


def test_a_users_own_target_is_checked_against_its_signature(train):
    assert refusal(train, "model=custom", "model._target_=usermodels.TinyNet", "+model.hiden=8") == \
        "model.hiden is not an argument of usermodels.TinyNet; its arguments are: hidden (and num_classes, which runlab passes)."
    # A shipped model's keys are not passed on to a module of one's own, unseen.
    assert refusal(train, "model._target_=usermodels.TinyNet") == (
        "model.width, model.depth, model.dropout, model.batch_norm are not arguments of usermodels.TinyNet (for a module "
        "of your own, start from model=custom); its arguments are: hidden (and num_classes, which runlab passes).")
    assert refusal(train, "data=custom", "data._target_=userdata.tagged_blobs", "+data.num_samples=64", "+data.labels=3",
                   "+data.seed=0", "+data.noise=0.1") == \
        "data.noise is not an argument of userdata.tagged_blobs; its arguments are: num_samples, labels, seed."
    assert "objective.loss.smoothing is not an argument of torch.nn.CrossEntropyLoss; its arguments are: weight," in refusal(
        train, "objective=supervised", "objective.loss._target_=torch.nn.CrossEntropyLoss", "+objective.loss.smoothing=0.1",
        "objective.monitor=val/loss")


def test_scheduler_none_trains_at_a_constant_rate(train):
    _, run_dir = train("scheduler=none", "logger=csv", "trainer.log_every_n_steps=7", "lr=0.004")
    with open(run_dir / "metrics.csv", newline="") as handle:
        rates = [float(row["value"]) for row in csv.DictReader(handle) if row["metric"] == "lr"]
    assert len(rates) >= 6 and set(rates) == {0.004}


def test_an_experiment_typo_stops_before_any_work_as_a_user_types_it(user):
    (user.repo / "experiments" / "typo.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: cnn\n"
                                                         "model:\n  widht: 64\n")
    line = one_line_error(user.run("python run.py experiment=typo"))
    assert "model.widht is not a key of model=cnn; its keys are: channels, width, dropout, batch_norm." in line
    assert not (user.repo / "outputs").exists()


def test_a_key_the_target_does_not_take_ends_in_one_line_as_a_user_types_it(cli, user):
    line = one_line_error(cli("+optimizer.weight_decy=0.1"))
    assert "optimizer.weight_decy is not an argument of torch.optim.AdamW; its arguments are: lr, betas," in line
    assert not user.runs()
