"""The shipped objectives' metrics, kept as sums over an evaluation pass.

Each metric holds a few running sums (in float64, so long passes do not drift); ``compute(reduce)``
adds up every process's sums first (``reduce``: the parallel environment's ``all_reduce_sum``),
so under ddp or fsdp the value is that of the whole split, whatever share each process scored.

They give what torchmetrics' classes of the same names give (tests/test_objectives.py checks them
against scikit-learn's). runlab does not use torchmetrics' own for them because importing
torchmetrics costs every process that does about 2.8 s (it loads torchvision, torch._dynamo,
scipy.signal and matplotlib), longer than a short run trains. A metric of the user's own
(``objective=supervised``), and multilabel's mean average precision, are torchmetrics' still.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a tensor summed over every process


def alone(sums: torch.Tensor) -> torch.Tensor:
    """The ``reduce`` of a single process: its own sums are the total."""
    return sums


class SumsMetric(nn.Module):
    """A metric computed from sums over the batches of a pass: ``update`` per batch, then ``compute``."""

    def __init__(self, *shape: int):
        super().__init__()
        # A buffer, so that .to(device) moves it; not persistent: a checkpoint holds no pass's sums.
        self.register_buffer("sums", torch.zeros(shape, dtype=torch.float64), persistent=False)

    def reset(self) -> None:
        self.sums.zero_()

    def add(self, *values: torch.Tensor) -> None:
        # The counts a batch gives may be made on the CPU; the sums live where the outputs are.
        self.sums += torch.stack([value.to(self.sums.device, torch.float64) for value in values])

    def compute(self, reduce: Reduce = alone) -> float:
        return float(self.value(reduce(self.sums)))

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is 0 (as torchmetrics' safe division)."""
    return torch.where(denominator == 0, torch.zeros_like(numerator), numerator / denominator.clamp_min(1e-300))


class Ratio(SumsMetric):
    """A sum over a count (a weighted mean, the share of hits)."""

    def __init__(self):
        super().__init__(2)

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        return sums[0] / sums[1]


class Mean(Ratio):
    """The mean of per-batch values, each weighted by its batch's size (torchmetrics' MeanMetric)."""

    def update(self, value: torch.Tensor, weight: float) -> None:
        value = torch.as_tensor(value).detach()
        self.add(value * weight, torch.as_tensor(float(weight)))


def per_label(outputs: torch.Tensor, target: torch.Tensor) -> tuple:
    """Scores (N, C, ...) and labels (N, ...) as (N·..., C) and (N·...,): one row per label scored, as
    cross entropy takes them (a class per position of a sequence or pixel of an image)."""
    return outputs.movedim(1, -1).reshape(-1, outputs.shape[1]), target.reshape(-1)


class Accuracy(Ratio):
    """The share of labels that are among the ``top_k`` highest scores (MulticlassAccuracy, micro)."""

    def __init__(self, top_k: int = 1):
        super().__init__()
        self.top_k = top_k

    def update(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        outputs, target = per_label(outputs, target)
        hits = (outputs.topk(self.top_k, dim=1).indices == target[:, None]).any(1)
        self.add(hits.sum(), torch.tensor(float(len(target))))


class MacroF1(SumsMetric):
    """F1 of each class, averaged over the classes that occur as label or prediction (MulticlassF1Score, macro)."""

    def __init__(self, num_classes: int):
        super().__init__(3, num_classes)
        self.num_classes = num_classes

    def update(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        outputs, target = per_label(outputs, target)
        predicted = outputs.argmax(1)
        counts = lambda labels: torch.bincount(labels, minlength=self.num_classes)  # noqa: E731
        true_positives = counts(target[predicted == target])
        self.add(true_positives, counts(predicted) - true_positives, counts(target) - true_positives)

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        true_positives, false_positives, false_negatives = sums
        scored = true_positives + false_positives + false_negatives
        f1 = ratio(2 * true_positives, 2 * true_positives + false_positives + false_negatives)
        return ratio(f1[scored > 0].sum(), (scored > 0).sum().to(f1.dtype))


class MicroF1(SumsMetric):
    """F1 over every (sample, label) pair, a label predicted where sigmoid(logit) > threshold (MultilabelF1Score, micro)."""

    def __init__(self, threshold: float):
        super().__init__(3)
        self.threshold = threshold

    def update(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        predicted, target = outputs.sigmoid() > self.threshold, target.bool()
        self.add((predicted & target).sum(), (predicted & ~target).sum(), (~predicted & target).sum())

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        true_positives, false_positives, false_negatives = sums
        return ratio(2 * true_positives, 2 * true_positives + false_positives + false_negatives)


class RegressionErrors(SumsMetric):
    """Per target column: the count, sum of targets, of squared targets, of squared and of absolute errors.
    ``kind`` picks what it reports: mae, rmse, or r2 (R², averaged over the columns)."""

    def __init__(self, columns: int, kind: str):
        super().__init__(5, columns)
        self.kind = kind

    def update(self, outputs: torch.Tensor, target: torch.Tensor) -> None:
        outputs, target = outputs.reshape(len(target), -1).double(), target.reshape(len(target), -1).double()
        errors = target - outputs
        self.add(torch.full_like(target[0], len(target)), target.sum(0), (target ** 2).sum(0), (errors ** 2).sum(0),
                 errors.abs().sum(0))

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        count, total, total_of_squares, squared_error, absolute_error = sums
        if self.kind == "mae":
            return absolute_error.sum() / count.sum()
        if self.kind == "rmse":
            return (squared_error.sum() / count.sum()).sqrt()
        if count[0] < 2:
            return torch.tensor(float("nan"))  # R² of a single sample is undefined
        spread = total_of_squares - total ** 2 / count  # the total sum of squares about the mean
        # As torchmetrics' R2Score: 1 where the errors are ~0, else 0 where the targets are constant.
        exact, flat = (torch.isclose(sums, torch.zeros_like(sums), atol=1e-4) for sums in (squared_error, spread))
        ones, zeros = torch.ones_like(spread), torch.zeros_like(spread)
        return torch.where(exact, ones, torch.where(flat, zeros, 1 - squared_error / spread)).mean()
