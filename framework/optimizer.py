"""Optimizers (conf/optimizer/): any ``torch.optim`` class given as a partial ``_target_``."""
from __future__ import annotations

from typing import Iterable

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn


def trainable_parameters(model: nn.Module) -> Iterable[nn.Parameter]:
    # Frozen parameters stay out of the optimizer, so weight decay and momentum never move them.
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    return instantiate(cfg)(trainable_parameters(model))
