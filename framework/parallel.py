"""Parallelism (conf/parallel/): the one place that knows about devices and processes.

``setup`` describes where this process runs; ``Environment.wrap`` wraps a plain model for
the chosen mode. Models and the training loop never import ``torch.distributed``.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from framework.config import ConfigError

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} was requested but CUDA is not available here; use device=cpu or device=auto.")
    return device


@dataclass
class Environment:
    """Where this process runs and how it talks to the others."""

    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # this process logs, shows progress and writes checkpoints

    @property
    def output_device(self) -> torch.device:
        return self.device

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def no_sync(self, model: nn.Module):
        """Context for a micro-batch whose gradients need not be synchronised yet."""
        return contextlib.nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any wrapper (DataParallel, DDP, torch.compile)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def setup(cfg: DictConfig) -> Environment:
    return Environment(device=resolve_device(cfg.device))
