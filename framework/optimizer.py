"""Optimizers (conf/optimizer/): any ``torch.optim`` class named in ``_target_``, built with the
option's keys and ``params=`` the model's trainable parameters (or fine-tuning's groups)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from framework.errors import instantiate


def trainable_parameters(model: nn.Module) -> Iterable[nn.Parameter]:
    # Frozen parameters stay out of the optimizer, so weight decay and momentum never move them.
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(cfg: DictConfig, model: nn.Module,
                    param_groups: Optional[List[Dict[str, Any]]] = None) -> torch.optim.Optimizer:
    """``param_groups`` (fine-tuning) may carry an ``lr_factor`` that scales the configured rate."""
    # "all": the groups reach torch as the dicts they are (OmegaConf would make each a DictConfig).
    optimizer = instantiate(cfg, params=param_groups or trainable_parameters(model), _convert_="all")
    for group in optimizer.param_groups:
        group["lr"] *= group.get("lr_factor", 1.0)
    return optimizer


def configured_groups(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """The hyperparameters this config gave each parameter group (a copy, without the parameters)."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def base_lr(group: Dict[str, Any]) -> float:
    return group.get("initial_lr", group["lr"])  # a scheduler keeps the rate it started from in initial_lr


def keep_configured(optimizer: torch.optim.Optimizer, configured: List[Dict[str, Any]]) -> bool:
    """After a checkpoint's optimizer state was loaded: this config's hyperparameters (weight decay,
    betas, momentum, ...) apply again. Returns whether the base learning rate differs from the
    checkpoint's, in which case the schedule must restart from the new one (``restart_lr``)."""
    lr_changed = False
    for group, wanted in zip(optimizer.param_groups, configured):
        lr_changed |= base_lr(group) != base_lr(wanted)
        group.update({key: value for key, value in wanted.items() if key not in ("lr", "initial_lr")})
    return lr_changed


def restart_lr(optimizer: torch.optim.Optimizer, configured: List[Dict[str, Any]]) -> None:
    """Every group back at this config's base rate, for a scheduler built anew on top of it."""
    for group, wanted in zip(optimizer.param_groups, configured):
        group["lr"] = base_lr(wanted)
        group.pop("initial_lr", None)
