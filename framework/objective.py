"""What a run optimises and reports (conf/objective/): how a batch becomes a loss, and the metrics
of an evaluation pass.

The training step and the evaluation pass never look inside a batch; they hand it to the
objective. Two kinds exist:

- ``Supervised``: a batch is ``(inputs, target)`` or ``{"input": ..., "target": ...}``; the
  loss is ``loss(model(inputs), target)`` and each metric is fed ``(outputs, target)`` (the
  shipped ones are framework/metrics.py's, a user's own is a torchmetrics ``Metric``).
  ``Classification``, ``Multilabel`` and ``Regression`` are the shipped
  ones; ``objective._target_=framework.objective.Supervised`` with ``loss`` and ``metrics``
  (``_target_`` nodes) is a user's own.
- ``ModelLoss`` (``objective=model_loss``): the model computes its own loss, for language
  models, VAEs and contrastive models, where the loss is not "outputs against a target".
  The protocol, all of it:

      class MyModel(nn.Module):
          def loss(self, batch) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
              ...  # the batch's mean loss, and optionally other per-batch means to report

  The names of the dict's values are declared in ``objective.metrics`` (name: min|max), so
  every name a run logs is known before it starts; each is averaged over an evaluation pass,
  weighted by batch size. runlab calls ``loss`` through the module's ``__call__`` (see
  ``ComputesOwnLoss``), so ddp synchronises its gradients as it would a forward's.

Every metric's name and direction (``directions``) is read from the config alone, before any
data is built, so ``checkpoint.monitor``, ``early_stopping.monitor`` and ``optimized_metric``
are checked against them at start. Metrics keep their state across batches and, under ddp,
sum it across processes when computed (``compute(reduce)``; torchmetrics' metrics do it themselves).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from hydra.utils import get_object
from omegaconf import DictConfig
from torch import nn

from framework import batch as batches
from framework.errors import ConfigError, instantiate
from framework.metrics import Accuracy, MacroF1, Mean, MicroF1, Reduce, RegressionErrors, SumsMetric, alone

Directions = Dict[str, str]  # a metric's name (without its split) -> "min" or "max"


class Objective(nn.Module):
    """The base: a loss per batch, and an evaluation pass's metrics (``update`` per batch, ``compute``).

    An ``nn.Module`` so that ``.to(device)`` moves the metrics' state where the outputs are.
    """

    labels_outputs = False  # whether outputs score classes: the image grid, per-class accuracy, exported labels

    @classmethod
    def directions(cls, cfg: DictConfig) -> Directions:
        """Each metric this objective reports, by name, with whether lower or higher is better."""
        return {"loss": "min"}

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the step calls (ModelLoss wraps the model so its ``loss`` runs through ``__call__``)."""
        return model

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def update(self, model: nn.Module, batch: Any) -> None:
        raise NotImplementedError

    def compute(self, reduce: Reduce = alone) -> Dict[str, float]:
        """The pass's metrics over every process (``reduce``: the environment's ``all_reduce_sum``)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the last pass (or a pass that ran out of memory) before the next: every metric this
        objective holds (runlab's and torchmetrics' alike have ``reset``)."""
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset", None)):
                module.reset()

    @classmethod
    def example_input(cls, batch: Any) -> Optional[Any]:
        """What the model's ``forward`` takes, from a batch (for TensorBoard's graph and export); None: unknown."""
        return batches.first_tensor(batch)


class Supervised(Objective):
    """``loss(outputs, target)`` and metrics of ``(outputs, target)``."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 metrics: Optional[Mapping[str, nn.Module]] = None, output_size: Optional[int] = None):
        super().__init__()
        self.loss_fn = loss
        # Listed, not a ModuleDict: a metric's name may be any word, "float" or "train" among them.
        self.metric_names, self.metrics = list(metrics or {}), nn.ModuleList((metrics or {}).values())
        self.mean_loss = Mean()

    @classmethod
    def directions(cls, cfg: DictConfig) -> Directions:
        found = {"loss": "min"}
        for name, node in (cfg.get("metrics") or {}).items():
            better = getattr(get_object(node._target_), "higher_is_better", None)
            if better is None:
                raise ConfigError(f"objective.metrics.{name}={node._target_} does not say whether higher is better "
                                  "(its class has no higher_is_better); use a torchmetrics metric that does.")
            found[str(name)] = "max" if better else "min"
        return found

    @staticmethod
    def inputs_and_target(batch: Any) -> Tuple[Any, torch.Tensor]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:  # first: every step asks
            return batch[0], batch[1]
        if isinstance(batch, Mapping) and "input" in batch and "target" in batch:
            return batch["input"], batch["target"]
        raise ConfigError(f"a {type(batch).__name__} batch is neither (inputs, target) nor a dict with 'input' and "
                          "'target'; make the data's collate return one, or let the model compute its loss "
                          "(objective=model_loss).")

    def prepare(self, outputs: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Outputs and target as the loss and the metrics take them."""
        if target.device != outputs.device:  # under parallel=model: the last stage's device
            target = target.to(outputs.device, non_blocking=True)
        return outputs, target

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, target = self.inputs_and_target(batch)
        outputs, target = self.prepare(model(inputs), target)
        return self.loss_fn(outputs, target)

    def update(self, model: nn.Module, batch: Any) -> None:
        inputs, target = self.inputs_and_target(batch)
        outputs, target = self.prepare(model(inputs), target)
        outputs = outputs.float()
        self.mean_loss.update(self.loss_fn(outputs, target), weight=len(outputs))
        for metric in self.metrics:
            metric.update(outputs, self.metric_target(target))

    def metric_target(self, target: torch.Tensor) -> torch.Tensor:
        return target

    def compute(self, reduce: Reduce = alone) -> Dict[str, float]:
        return {"loss": self.mean_loss.compute(reduce),
                **{name: metric_value(metric, reduce) for name, metric in zip(self.metric_names, self.metrics)}}

    @classmethod
    def example_input(cls, batch: Any) -> Any:
        return cls.inputs_and_target(batch)[0]


class Classification(Supervised):
    """Single-label classification: cross entropy on logits, accuracy, top-k accuracy and macro F1."""

    labels_outputs = True

    def __init__(self, output_size: int, label_smoothing: float, top_k: int):
        super().__init__(nn.CrossEntropyLoss(label_smoothing=label_smoothing), {
            "acc": Accuracy(),
            # Named by the configured k, known before the data; with fewer classes than k it is 1.
            f"acc_top{top_k}": Accuracy(top_k=min(top_k, output_size)),
            "f1": MacroF1(output_size),
        })

    @classmethod
    def directions(cls, cfg: DictConfig) -> Directions:
        return {"loss": "min", "acc": "max", f"acc_top{cfg.top_k}": "max", "f1": "max"}


class Multilabel(Supervised):
    """Several labels per sample (targets of 0/1 per label): BCE on logits, micro F1 and mean average precision."""

    def __init__(self, output_size: int, threshold: float):
        # Average precision needs every score of the pass, not sums: torchmetrics' (imported only here).
        from torchmetrics.classification import MultilabelAveragePrecision

        super().__init__(nn.BCEWithLogitsLoss(), {
            "f1": MicroF1(threshold),
            "map": MultilabelAveragePrecision(output_size, average="macro"),
        })

    @classmethod
    def directions(cls, cfg: DictConfig) -> Directions:
        return {"loss": "min", "f1": "max", "map": "max"}

    def prepare(self, outputs: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return outputs, target.to(outputs.device, dtype=outputs.dtype, non_blocking=True)

    def metric_target(self, target: torch.Tensor) -> torch.Tensor:
        return target.long()


REGRESSION_LOSSES = {"mse": nn.MSELoss, "l1": nn.L1Loss, "huber": nn.HuberLoss}


class Regression(Supervised):
    """Real-valued targets: MSE, L1 or Huber; mean absolute error, root mean squared error and R²."""

    def __init__(self, output_size: int, loss: str, huber_delta: float):
        loss_fn = nn.HuberLoss(delta=huber_delta) if loss == "huber" else REGRESSION_LOSSES[loss]()
        super().__init__(loss_fn, {kind: RegressionErrors(output_size, kind) for kind in ("mae", "rmse", "r2")})

    @classmethod
    def directions(cls, cfg: DictConfig) -> Directions:
        return {"loss": "min", "mae": "min", "rmse": "min", "r2": "max"}

    def prepare(self, outputs: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        target = target.to(outputs.device, dtype=outputs.dtype, non_blocking=True)
        if outputs.dim() == target.dim() + 1 and outputs.shape[-1] == 1:  # one output per sample, targets (N,)
            outputs = outputs.squeeze(-1)
        if outputs.shape != target.shape:
            raise ConfigError(f"the model's outputs of shape {tuple(outputs.shape)} do not match the targets' "
                              f"{tuple(target.shape)}; objective=regression needs one output per target value.")
        return outputs, target


class ComputesOwnLoss(nn.Module):
    """Calls the model's ``loss(batch)`` through ``__call__``, so ddp's hooks see it as a forward.
    ``module`` is the model: ``parallel.unwrap`` and checkpoints see the model itself."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: Any):
        return self.module.loss(batch)


class ModelLoss(Objective):
    """The model's own ``loss(batch)``; the values it returns beside it are reported by the names
    ``metrics`` declares, and ``perplexity`` adds exp(mean loss) (a language model's loss in nats)."""

    def __init__(self, metrics: Mapping[str, str], perplexity: bool, output_size: Optional[int] = None):
        super().__init__()
        self.declared = dict(metrics)
        self.perplexity = perplexity
        self.mean_loss = Mean()
        self.means = nn.ModuleList(Mean() for _ in self.declared)

    @classmethod
    def directions(cls, cfg: DictConfig) -> Directions:
        found = {"loss": "min", **{str(name): str(direction) for name, direction in cfg.metrics.items()}}
        if cfg.perplexity:
            found["perplexity"] = "min"
        return found

    def wrap(self, model: nn.Module) -> nn.Module:
        if not callable(getattr(model, "loss", None)):
            raise ConfigError(f"objective=model_loss needs the model to define loss(batch), but {type(model).__name__} "
                              "does not; pick another objective (classification, multilabel, regression).")
        return ComputesOwnLoss(model)

    def unpack(self, returned: Any) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        loss, values = returned if isinstance(returned, tuple) else (returned, {})
        if set(values) != set(self.declared):
            raise ConfigError(f"the model's loss returned the values {sorted(values)} but objective.metrics declares "
                              f"{sorted(self.declared)}; declare each name it returns (name: min|max).")
        return loss, values

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.unpack(model(batch))[0]

    def update(self, model: nn.Module, batch: Any) -> None:
        loss, values = self.unpack(model(batch))
        weight = batches.size(batch)
        self.mean_loss.update(loss.float(), weight=weight)
        for name, mean in zip(self.declared, self.means):
            mean.update(torch.as_tensor(values[name], dtype=torch.float64), weight=weight)

    def compute(self, reduce: Reduce = alone) -> Dict[str, float]:
        loss = self.mean_loss.compute(reduce)
        found = {"loss": loss, **{name: mean.compute(reduce) for name, mean in zip(self.declared, self.means)}}
        if self.perplexity:
            found["perplexity"] = math.exp(min(loss, 700.0))  # exp overflows a float above ~709
        return found


def metric_value(metric: nn.Module, reduce: Reduce) -> float:
    """A metric's value over the pass: runlab's sum their state with ``reduce``, torchmetrics' sync themselves."""
    return metric.compute(reduce) if isinstance(metric, SumsMetric) else metric.compute().item()


def objective_class(cfg: DictConfig) -> type:
    return get_object(cfg._target_)


def directions(cfg: DictConfig) -> Directions:
    """The objective's metrics and their directions, from its config alone."""
    return objective_class(cfg).directions(cfg)


def saved_objective(config: DictConfig) -> DictConfig:
    """A checkpoint's objective; one from before objectives were a config group trained a classifier."""
    if "objective" in config:
        return config.objective
    from omegaconf import OmegaConf

    return OmegaConf.create({"_target_": "framework.objective.Classification", "label_smoothing": 0.0, "top_k": 5})


def build_objective(cfg: DictConfig, output_size: int) -> Objective:
    """The objective ``cfg`` (conf/objective/) names; ``output_size`` is what the data says the model outputs."""
    from omegaconf import OmegaConf

    # monitor is what the run is judged by (checkpoint.monitor's default), not how the objective computes.
    option = OmegaConf.to_container(cfg, resolve=True)
    objective = instantiate({key: value for key, value in option.items() if key != "monitor"},
                            output_size=output_size, _convert_="all")
    if not isinstance(objective, Objective):
        raise ConfigError(f"objective._target_={cfg._target_} built a {type(objective).__name__}, not a "
                          "framework.objective.Objective.")
    return objective
