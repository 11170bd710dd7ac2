"""Optimizers (conf/optimizer/): any ``torch.optim`` class given as a partial ``_target_``."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn


def trainable_parameters(model: nn.Module) -> Iterable[nn.Parameter]:
    # Frozen parameters stay out of the optimizer, so weight decay and momentum never move them.
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(cfg: DictConfig, model: nn.Module,
                    param_groups: Optional[List[Dict[str, Any]]] = None) -> torch.optim.Optimizer:
    """``param_groups`` (fine-tuning) may carry an ``lr_factor`` that scales the configured rate."""
    optimizer = instantiate(cfg)(param_groups or trainable_parameters(model))
    for group in optimizer.param_groups:
        group["lr"] *= group.get("lr_factor", 1.0)
    return optimizer
