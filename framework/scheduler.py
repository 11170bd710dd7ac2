"""Learning-rate schedulers (conf/scheduler/): a partial ``build`` target stepped every
``interval`` (epoch or step); ``scheduler=none`` keeps the rate constant."""

from __future__ import annotations

from typing import Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig


class Scheduler:
    """Owns its stepping policy, so the loop calls ``after_step`` and ``after_epoch`` unconditionally."""

    def __init__(self, scheduler: Optional[torch.optim.lr_scheduler.LRScheduler], interval: str):
        self.scheduler, self.interval = scheduler, interval  # interval "none": a constant rate

    def after_step(self) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def after_epoch(self) -> None:
        if self.interval == "epoch":
            self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict() if self.scheduler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler:
            self.scheduler.load_state_dict(state)


def build_scheduler(cfg: Optional[DictConfig], optimizer: torch.optim.Optimizer) -> Scheduler:
    if cfg is None:
        return Scheduler(None, "none")
    return Scheduler(instantiate(cfg.build)(optimizer), cfg.interval)
