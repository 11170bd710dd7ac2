"""Learning-rate schedulers (conf/scheduler/): any torch LR scheduler named in ``_target_``, built with
the option's keys and ``optimizer=``, and stepped every ``interval`` (epoch or step), runlab's own key;
``scheduler=none`` (``constant``) keeps the rate at lr."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from omegaconf import DictConfig

from framework.errors import instantiate

# A scheduler's state that says where it is, not which schedule it follows.
POSITION = ("last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "base_lrs")


class Scheduler:
    """Owns its stepping policy, so the loop calls ``after_step`` and ``after_epoch`` unconditionally."""

    def __init__(self, scheduler: Optional[torch.optim.lr_scheduler.LRScheduler], interval: str):
        self.scheduler = scheduler
        self.interval = interval if scheduler else "never"  # no scheduler: a constant rate

    def after_step(self) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def after_epoch(self) -> None:
        if self.interval == "epoch":
            self.scheduler.step()

    def fast_forward(self, epochs: int, steps: int) -> None:
        """Put a freshly built schedule where a run of this budget would be after ``epochs``/``steps``:
        how a resumed run with a new budget, schedule or lr continues on the schedule it now has."""
        with warnings.catch_warnings():  # stepping without optimizer steps is the point here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range({"epoch": epochs, "step": steps}.get(self.interval, 0)):
                self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict() if self.scheduler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler and state:
            self.scheduler.load_state_dict(state)


def same_schedule(configured: dict, saved: dict) -> bool:
    """Whether two scheduler states follow the same schedule, wherever each one is on it."""
    def schedule(state: dict) -> dict:
        return {key: value for key, value in state.items() if key not in POSITION}

    return configured.keys() == saved.keys() and schedule(configured) == schedule(saved)


def constant(optimizer: torch.optim.Optimizer) -> None:
    """scheduler=none: no schedule; the rate stays at lr."""


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer) -> Scheduler:
    option = {key: value for key, value in cfg.items() if key != "interval"}  # the scheduler's own keys
    return Scheduler(instantiate(option, optimizer=optimizer), cfg.get("interval", "never"))
