"""Optimizers (conf/optimizer/): any ``torch.optim`` class named in ``_target_``, built with the
option's keys and ``params=`` the model's trainable parameters (or fine-tuning's groups).

``fused`` is runlab's key, not always the class's: where the class takes ``fused`` (Adam, AdamW,
SGD, ...) and every parameter is floating point, it gets ``fused=True``, torch's implementation
that updates all parameters in one kernel instead of a loop of small ops per parameter: the
same update up to rounding, about 3x faster for Adam(W) on a small model on the CPU here. Another class
(``optimizer._target_=torch.optim.RMSprop``) is built without it."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.config import accepted_keys
from framework.errors import instantiate


def trainable_parameters(model: nn.Module) -> Iterable[nn.Parameter]:
    # Frozen parameters stay out of the optimizer, so weight decay and momentum never move them.
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(cfg: DictConfig, model: nn.Module,
                    param_groups: Optional[List[Dict[str, Any]]] = None) -> torch.optim.Optimizer:
    """``param_groups`` (fine-tuning) may carry an ``lr_factor`` that scales the configured rate."""
    params = param_groups or trainable_parameters(model)
    option = OmegaConf.to_container(cfg, resolve=True)
    if option.pop("fused") and takes_fused(option["_target_"], params):
        option["fused"] = True
    # "all": the groups reach torch as the dicts they are (OmegaConf would make each a DictConfig).
    optimizer = instantiate(option, params=params, _convert_="all")
    for group in optimizer.param_groups:
        group["lr"] *= group.get("lr_factor", 1.0)
    return optimizer


def takes_fused(target: str, params: List[Any]) -> bool:
    """Whether the class has a fused implementation (a ``fused`` argument) that takes these parameters."""
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    return "fused" in (accepted_keys(get_object(target)) or ()) and all(p.is_floating_point() for p in tensors)


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
