"""Parallelism (conf/parallel/): the one place that knows about devices and processes.

Each option of conf/parallel/ names its ``Mode`` in ``_target_``. ``launch`` has that mode run
a task in the processes it needs and hand each an ``Environment``:
where that process runs, how it wraps the model and how it talks to the others. Models and
the training loop never import ``torch.distributed``.

- none:  one process, one device.
- dp:    ``nn.DataParallel`` over the visible GPUs (one process; see docs/parallelism.md for its costs).
- ddp:   ``DistributedDataParallel``, one process per device (distributed.py).
- model: the model's stages on several devices, pipelined GPipe-style (pipeline.py).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List

import torch
from hydra.utils import get_object
from omegaconf import DictConfig
from torch import nn

from framework.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} was requested but CUDA is not available here; use device=cpu or device=auto.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device={name!r} does not exist: this machine has {torch.cuda.device_count()} visible GPUs.")
    return device


@dataclass
class Environment:
    """Where this process runs and how it talks to the others (parallel=none: alone)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # this process logs, shows progress and writes checkpoints

    @property
    def output_device(self) -> torch.device:
        """Where the model's outputs, and so the targets and the loss, live."""
        return self.device

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def no_sync(self, model: nn.Module):
        """Context for a micro-batch whose gradients need not be synchronised yet."""
        return contextlib.nullcontext()

    def processes_out_of_memory(self, model: nn.Module, ran_out: bool) -> int:
        """How many processes ran out of memory in this step. Every process asks once per step,
        after its backward finished or failed (``ran_out``); alone, the answer is its own."""
        return int(ran_out)

    def after_failed_step(self, model: nn.Module) -> nn.Module:
        """The model to retry a step with once the processes agreed that the step failed."""
        return model

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over all processes, as a new tensor (the argument is left as is)."""
        return tensor

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(tensor) / self.world_size

    def agree_to_stop(self, requested: bool, all_ranks_ask: bool) -> bool:
        """Whether to stop here because a stop was requested (a signal). One process stops at once;
        several agree only where all of them ask (``all_ranks_ask``), so that all stop at the same step."""
        return requested

    def barrier(self) -> None:
        """Wait until every process got here (e.g. rank 0 finished writing a checkpoint)."""

    def cleanup(self) -> None:
        """Leave the process group, if any."""


@dataclass
class DataParallelEnvironment(Environment):
    """parallel=dp: one process replicates the model on every GPU for each forward pass."""

    device_ids: List[int] = field(default_factory=list)

    def wrap(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model.to(self.device), device_ids=self.device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside any wrapper (DataParallel, DDP, Pipeline, torch.compile)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def data_parallel(cfg: DictConfig) -> Environment:
    device = resolve_device(cfg.device)
    ids = [resolve_device(name).index for name in cfg.parallel.devices] if cfg.parallel.devices else \
        list(range(torch.cuda.device_count()))
    if device.type != "cuda" or len(ids) < 2:
        found = f"{len(ids)} GPU(s) are in use" if device.type == "cuda" else f"this run is on {device.type}"
        log.warning("parallel=dp needs at least 2 GPUs but %s; running the model unwrapped on %s.", found, device)
        return Environment(device=device)
    return DataParallelEnvironment(device=torch.device("cuda", ids[0]), device_ids=ids)


Task = Callable[[DictConfig, Path, Environment], Any]


class Mode:
    """How a parallel option runs a task: each option of conf/parallel/ names its Mode in
    ``_target_``. This one (parallel=none) runs the task here, in the one process's ``environment``."""

    @staticmethod
    def environment(cfg: DictConfig) -> Environment:
        """The environment of this process when it runs the task alone."""
        return Environment(device=resolve_device(cfg.device))

    @classmethod
    def launch(cls, task: Task, cfg: DictConfig, run_dir: Path) -> Any:
        env = cls.environment(cfg)
        try:
            return task(cfg, Path(run_dir), env)
        finally:
            env.cleanup()

    @staticmethod
    def launched_rank() -> int:
        """This process's rank when something outside runlab started the ranks; 0 otherwise."""
        return 0


class DataParallel(Mode):
    """parallel=dp: one process, the model replicated on every GPU."""

    environment = staticmethod(data_parallel)


def mode(cfg: DictConfig) -> type:
    """The ``Mode`` the run's parallel option names."""
    return get_object(cfg.parallel._target_)


def setup(cfg: DictConfig) -> Environment:
    """This process's environment for a task it runs alone (a ddp run's processes get theirs from ``launch``)."""
    return mode(cfg).environment(cfg)


def launched_rank(cfg: DictConfig) -> int:
    """This process's rank when something outside runlab started the ranks (torchrun, the tasks
    of a SLURM job): they may share one run dir. 0 otherwise."""
    return mode(cfg).launched_rank()


def launch(task: Task, cfg: DictConfig, run_dir: Path) -> Any:
    """Run ``task(cfg, run_dir, env)`` in every process the mode needs; returns rank 0's result.

    ``task`` must be a module-level function: ddp pickles it into freshly spawned processes.
    """
    return mode(cfg).launch(task, cfg, Path(run_dir))
