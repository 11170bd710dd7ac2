"""Learning-rate schedulers (conf/scheduler/): any torch LR scheduler named in ``_target_``, built with
the option's keys and ``optimizer=``, and stepped every ``interval`` (epoch or step), runlab's own key;
``scheduler=none`` (``constant``) keeps the rate at lr."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from framework.errors import instantiate


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


def same_schedule(saved_config: dict, cfg: DictConfig) -> bool:
    """Whether a checkpoint's run (its resolved config) followed the schedule ``cfg`` builds: the same
    scheduler option and keys, resolved, so that a new budget (cosine's T_max is trainer.max_epochs)
    or interval is a new schedule."""
    return saved_config.get("scheduler") == OmegaConf.to_container(cfg.scheduler, resolve=True, enum_to_str=True)


def constant(optimizer: torch.optim.Optimizer) -> None:
    """scheduler=none: no schedule; the rate stays at lr."""


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer) -> Scheduler:
    option = {key: value for key, value in cfg.items() if key != "interval"}  # the scheduler's own keys
    return Scheduler(instantiate(option, optimizer=optimizer), cfg.get("interval", "never"))
