"""The objective group (framework/objective.py) and batches of any shape (framework/batch.py):
losses and metrics checked against scikit-learn's, names checked before any work."""
import json
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from sklearn import metrics as sk

from conftest import composed, read_metrics
from framework import batch as batches
from framework.config import known_metrics
from framework.errors import ConfigError
from framework.metrics import Accuracy, Mean
from framework.objective import Classification, ModelLoss, Multilabel, Regression, build_objective


@dataclass
class Pair:
    signal: torch.Tensor
    label: torch.Tensor


Named = namedtuple("Named", "x y")


@pytest.mark.parametrize("make", [
    lambda x, y: (x, y),
    lambda x, y: {"input": x, "target": y, "names": ["kept whole"]},
    lambda x, y: Pair(x, y),
    lambda x, y: Named(x, y),
    lambda x, y: [{"a": x}, (y,)],
])
def test_a_batch_of_any_shape_is_split_moved_and_counted_leaf_by_leaf(make):
    x, y = torch.arange(20.0).view(10, 2), torch.arange(10)
    batch = make(x, y)
    assert batches.size(batch) == 10
    parts = batches.split(batch, 4)
    assert [batches.size(part) for part in parts] == [4, 4, 2]
    assert all(type(part) is type(batch) for part in parts)
    leaves = [batches.tensors(part) for part in parts]
    for whole, pieces in zip(batches.tensors(batch), zip(*leaves)):
        assert torch.equal(torch.cat(pieces), whole)
    if isinstance(batch, dict):
        assert parts[2]["names"] == ["kept whole"]
    moved = batches.to_device(batch, torch.device("meta"))
    assert type(moved) is type(batch) and all(t.is_meta for t in batches.tensors(moved))


def test_classification_reports_sklearns_accuracy_top_k_and_macro_f1_with_label_smoothing():
    generator = torch.Generator().manual_seed(0)
    logits, target = torch.randn(300, 7, generator=generator), torch.randint(7, (300,), generator=generator)
    objective = Classification(output_size=7, label_smoothing=0.1, top_k=3)
    for chunk in range(0, 300, 64):  # state accumulates across batches
        objective.update(torch.nn.Identity(), (logits[chunk:chunk + 64], target[chunk:chunk + 64]))
    found = objective.compute()
    predicted = logits.argmax(1).numpy()
    top3 = (logits.topk(3, dim=1).indices == target[:, None]).any(1).float().mean().item()
    assert found["acc"] == pytest.approx(sk.accuracy_score(target, predicted), abs=1e-6)
    assert found["acc_top3"] == pytest.approx(top3, abs=1e-6)
    assert found["f1"] == pytest.approx(sk.f1_score(target, predicted, average="macro"), abs=1e-6)
    expected = torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1).item()
    assert found["loss"] == pytest.approx(expected, abs=1e-6)
    assert set(found) == set(Classification.directions(composed("objective.top_k=3").objective))


@pytest.mark.parametrize("objective, make_target", [
    (Classification(output_size=7, label_smoothing=0.0, top_k=3), lambda g: torch.randint(7, (90,), generator=g)),
    (Regression(output_size=7, loss="mse", huber_delta=1.0), lambda g: torch.randn(90, 7, generator=g)),
])
def test_two_processes_shares_of_a_split_sum_to_the_whole_splits_metrics(objective, make_target):
    generator = torch.Generator().manual_seed(3)
    outputs, target = torch.randn(90, 7, generator=generator), make_target(generator)
    objective.update(torch.nn.Identity(), (outputs, target))
    whole = objective.compute()
    shares = []
    for rows in (slice(0, 20), slice(20, 90)):  # as ddp's ranks may hold different numbers of samples
        objective.reset()
        objective.update(torch.nn.Identity(), (outputs[rows], target[rows]))
        sums = []
        objective.compute(lambda state: sums.append(state.clone()) or state)
        shares.append(sums)
    other = iter(shares[0])  # this process holds the second share; the reduce adds the first's state to it
    assert objective.compute(lambda state: state + next(other)) == pytest.approx(whole, rel=1e-6)  # the loss: float32 means of other batches
    assert objective.compute() != pytest.approx(whole, rel=1e-3)  # the second share alone is another value


def test_a_class_per_position_is_scored_label_by_label():
    generator = torch.Generator().manual_seed(4)
    logits, target = torch.randn(6, 4, 9, generator=generator), torch.randint(4, (6, 9), generator=generator)
    objective = Classification(output_size=4, label_smoothing=0.0, top_k=2)
    objective.update(torch.nn.Identity(), (logits, target))  # (N, C, L) scores, (N, L) labels: as cross entropy takes them
    found = objective.compute()
    rows, labels = logits.movedim(1, -1).reshape(-1, 4), target.reshape(-1)
    assert found["acc"] == pytest.approx(sk.accuracy_score(labels, rows.argmax(1)), abs=1e-9)
    assert found["f1"] == pytest.approx(sk.f1_score(labels, rows.argmax(1), average="macro"), abs=1e-9)
    assert found["acc_top2"] == pytest.approx((rows.topk(2, 1).indices == labels[:, None]).any(1).double().mean().item())


def test_metrics_keep_their_sums_where_the_outputs_are():
    # On a GPU the counts a batch gives are partly made on the CPU; "meta" stands in for the other device here.
    mean, accuracy = Mean().to("meta"), Accuracy(top_k=1).to("meta")
    mean.update(torch.zeros((), device="meta"), weight=3)
    accuracy.update(torch.zeros(5, 3, device="meta"), torch.zeros(5, dtype=torch.long, device="meta"))
    assert mean.sums.is_meta and accuracy.sums.is_meta


def test_multilabel_reports_sklearns_micro_f1_and_mean_average_precision():
    generator = torch.Generator().manual_seed(1)
    logits, target = torch.randn(200, 5, generator=generator), torch.randint(2, (200, 5), generator=generator)
    objective = Multilabel(output_size=5, threshold=0.5)
    objective.update(torch.nn.Identity(), (logits, target))
    found = objective.compute()
    assert found["f1"] == pytest.approx(sk.f1_score(target, (logits.sigmoid() > 0.5).int(), average="micro"), abs=1e-6)
    assert found["map"] == pytest.approx(sk.average_precision_score(target, logits.sigmoid(), average="macro"), abs=1e-5)
    assert found["loss"] == pytest.approx(torch.nn.functional.binary_cross_entropy_with_logits(logits, target.float()).item(), abs=1e-6)


@pytest.mark.parametrize("loss, reference", [("mse", torch.nn.functional.mse_loss), ("l1", torch.nn.functional.l1_loss),
                                             ("huber", lambda o, t: torch.nn.functional.huber_loss(o, t, delta=2.0))])
def test_regression_takes_one_output_per_target_and_reports_sklearns_mae_rmse_and_r2(loss, reference):
    generator = torch.Generator().manual_seed(2)
    target = torch.randn(100, generator=generator) * 3
    outputs = (target + torch.randn(100, generator=generator))[:, None]  # a model's (N, 1) outputs
    objective = Regression(output_size=1, loss=loss, huber_delta=2.0)
    objective.update(torch.nn.Identity(), (outputs, target))
    found = objective.compute()
    assert found["loss"] == pytest.approx(reference(outputs[:, 0], target).item(), rel=1e-5)
    assert found["mae"] == pytest.approx(sk.mean_absolute_error(target, outputs[:, 0]), rel=1e-5)
    assert found["rmse"] == pytest.approx(np.sqrt(sk.mean_squared_error(target, outputs[:, 0])), rel=1e-5)
    assert found["r2"] == pytest.approx(sk.r2_score(target, outputs[:, 0]), rel=1e-5)
    with pytest.raises(ConfigError, match=r"outputs of shape \(100, 2\) do not match the targets' \(100,\)"):
        objective.loss(torch.nn.Identity(), (torch.zeros(100, 2), target))


class ScoresItself(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def loss(self, batch):
        x, = batch
        return (self.weight * x).mean(), {"double": 2 * x.mean()}


def test_a_model_that_defines_its_loss_is_called_through_its_wrapper_and_its_values_are_weighted_by_batch_size():
    objective = ModelLoss(metrics={"double": "min"}, perplexity=True)
    model = objective.wrap(ScoresItself())
    assert model.module.__class__ is ScoresItself  # parallel.unwrap and checkpoints see the model itself
    objective.update(model, (torch.full((3,), 1.0),))
    objective.update(model, (torch.full((1,), 5.0),))
    found = objective.compute()
    assert found == pytest.approx({"loss": 2.0, "double": 4.0, "perplexity": np.exp(2.0)})
    with pytest.raises(ConfigError, match=r"returned the values \['double'\] but objective.metrics declares \[\]"):
        ModelLoss(metrics={}, perplexity=False).loss(model, (torch.ones(2),))
    with pytest.raises(ConfigError, match="objective=model_loss needs the model to define loss"):
        objective.wrap(torch.nn.Linear(1, 1))


def test_every_metric_a_run_reports_is_known_from_the_config_with_its_direction():
    assert known_metrics(composed()) == {
        "train/loss": "min", "val/loss": "min", "val/acc": "max", "val/acc_top5": "max", "val/f1": "max",
        "test/loss": "min", "test/acc": "max", "test/acc_top5": "max", "test/f1": "max"}
    regression = composed("experiment=diabetes_regression")
    assert known_metrics(regression)["val/rmse"] == "min" and known_metrics(regression)["val/r2"] == "max"
    assert regression.checkpoint.monitor == regression.early_stopping.monitor == regression.optimized_metric == "val/rmse"
    built = build_objective(composed("objective=supervised", "objective.loss._target_=torch.nn.SmoothL1Loss",
                                     "+objective.metrics.mae._target_=torchmetrics.MeanAbsoluteError").objective, 1)
    assert isinstance(built.loss_fn, torch.nn.SmoothL1Loss) and built.metric_names == ["mae"]


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.monitor=test/acc"], "checkpoint.monitor='test/acc' is not a metric of every epoch of this run; "
                                      "choose one of train/loss, val/loss, val/acc, val/acc_top5, val/f1."),
    (["early_stopping.monitor=val/rmse"], "early_stopping.monitor='val/rmse' is not a metric of every epoch"),
    (["checkpoint.monitor=val/loss", "checkpoint.mode=max"], "checkpoint.mode=max does not fit val/loss, which is "
                                                             "better lower; use checkpoint.mode=auto (or min)."),
    (["optimized_metric=val/r2"], "optimized_metric='val/r2' is not allowed; choose one of train/loss, val/loss"),
    (["objective=regression", "objective.huber_delta=0"], "objective.huber_delta=0.0 is invalid"),
])
def test_a_monitor_or_objective_that_cannot_work_is_refused_before_any_work(train, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        train(*overrides)


def test_any_val_metric_may_be_monitored_and_optimized_with_its_own_direction(train):
    metrics, run_dir = train("checkpoint.monitor=val/f1", "optimized_metric=val/acc_top5", "trainer.max_epochs=2")
    assert metrics["best/val/f1"] == max(metrics["val/f1"], metrics["best/val/f1"])
    assert 0 < metrics["test/f1"] <= 1 and metrics["test/acc_top5"] >= metrics["test/acc"]


# --- any data, end to end (in this process; tests/userdata.py is the user's package) ---------------

USER_DATA = ["data=custom", "logger=csv"]


@pytest.fixture
def user_package(monkeypatch):
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "tests"))


@pytest.mark.parametrize("collate", [[], ["data.collate={_target_: userdata.as_pair, _partial_: true}"]])
def test_dict_samples_through_a_dataloader_train_exactly_as_the_same_tensors_in_memory(train, user_package, collate):
    import userdata

    userdata.as_pair.batches = 0
    pairs, _ = train(*USER_DATA, "data._target_=userdata.digits_as", "+data.kind=pairs", *collate)
    assert (userdata.as_pair.batches > 3 * (1257 // 64)) == bool(collate)  # every train, val and test batch
    tensors, _ = train("logger=csv")
    for key in ("train/loss", "val/loss", "val/acc", "test/f1"):
        assert pairs[key] == pytest.approx(tensors[key], abs=1e-6), key


def test_an_out_of_memory_step_on_dict_batches_backs_off_and_keeps_the_trajectory(train, user_package):
    dicts = [*USER_DATA, "data._target_=userdata.digits_as", "+data.kind=pairs", "trainer.max_epochs=2"]
    metrics, _ = train(*dicts, "troubleshoot.inject_oom_above_batch=16")
    reference, _ = train(*dicts, "trainer.accumulate_grad_batches=4")
    assert metrics["troubleshoot/micro_batch"] == 16 and metrics["troubleshoot/oom_backoffs"] == 2
    assert metrics["val/loss"] == pytest.approx(reference["val/loss"], abs=1e-6)


def test_an_iterable_dataset_trains_and_one_without_a_length_is_refused_in_one_line(train, user_package):
    stream, _ = train(*USER_DATA, "data._target_=userdata.digits_as", "+data.kind=stream", "trainer.max_epochs=2")
    assert stream["step"] == 2 * (1257 // 64) and stream["val/acc"] > 0.5
    with pytest.raises(ConfigError, match=r"the training set is a Stream, an IterableDataset without __len__; define "
                                          r"__len__ \(its samples per process in an epoch\)"):
        train(*USER_DATA, "data._target_=userdata.digits_as", "+data.kind=stream", "+data.sized=false")


def test_multilabel_targets_train_with_their_own_metrics(train, user_package):
    metrics, _ = train(*USER_DATA, "data._target_=userdata.tagged_blobs", "+data.num_samples=1200", "+data.labels=4",
                       "+data.seed=0", "objective=multilabel", "lr=1e-2", "trainer.max_epochs=6")
    assert metrics["test/map"] > 0.9 and metrics["test/f1"] > 0.8  # tags shift their feature by 3 noise units
    assert "best/val/map" in metrics and "val/acc" not in metrics


def test_a_regression_checkpoint_evaluates_with_its_metrics_and_exports_without_labels(train):
    _, run_dir = train("experiment=diabetes_regression", "trainer.max_epochs=5")
    scores, eval_dir = train("task=eval", f"ckpt={run_dir}")
    assert set(scores) == {"test/loss", "test/mae", "test/rmse", "test/r2", "epoch", "step"}
    assert scores["test/rmse"] == pytest.approx(read_metrics(run_dir)["test/rmse"], rel=1e-6)
    _, export_dir = train("task=export", f"ckpt={run_dir}")
    manifest = json.loads((export_dir / "artifact" / "manifest.json").read_text())
    assert manifest["labels"] == [] and manifest["input_shape"] == [10]


def test_a_model_computing_its_own_loss_cannot_be_pipelined_and_says_so(train):
    with pytest.raises(ConfigError, match=r"parallel=model cannot pipeline a model that computes its own loss"):
        train("experiment=char_lm", "data.max_chars=3000", "parallel=model", "parallel.devices=[cpu,cpu]")


def test_a_run_stops_its_dataloader_workers_when_it_ends(train, user_package):
    """In a notebook the trainer is freed by the garbage collector, at some later time: its persistent
    workers would live on until then, and stopping them there took seconds per worker."""
    import multiprocessing

    train(*USER_DATA, "data._target_=userdata.digits_as", "+data.kind=pairs", "data.num_workers=2", "trainer.max_epochs=1")
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("direction, expected", [("min", ["minimize"]), ("auto", ["minimize"]), ("minimize", ["minimize"])])
def test_the_sweeper_takes_the_direction_in_checkpoint_modes_words_or_optunas(direction, expected):
    from test_optuna_compat import runlab_sweeper

    sweeper = runlab_sweeper(direction=direction)
    sweeper.config = composed("checkpoint.monitor=val/loss")
    sweeper.check()
    assert sweeper.directions == expected
    contradicting = runlab_sweeper(direction="max")
    contradicting.config = sweeper.config
    with pytest.raises(ConfigError, match=r"direction=maximize does not fit optimized_metric=val/loss, which is better "
                                          r"lower; use auto \(or minimize\)"):
        contradicting.check()
