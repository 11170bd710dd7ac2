"""Parallelism (conf/parallel/): the one place that knows about devices and processes.

Each option of conf/parallel/ names its ``Mode`` in ``_target_``, which ``mode`` builds with
``hydra.utils.instantiate`` and the option's keys (``DDP(world_size=0, backend="auto", ...)``),
as every group's option is built. ``launch`` has that mode run a task in the processes it needs
and hand each an ``Environment``: where that process runs, how it wraps the model and how it
talks to the others. What only the run has (its config, the task, the run dir) comes in as
arguments of the mode's methods. Models and the training loop never import ``torch.distributed``.

- none:  one process, one device.
- dp:    ``nn.DataParallel`` over the visible GPUs (one process; see docs/parallelism.md for its costs).
- ddp:   ``DistributedDataParallel``, one process per device (distributed.py).
- fsdp:  FSDP2's ``fully_shard``: like ddp, each process holding a shard of the model (fsdp.py).
- model: the model's stages on several devices, pipelined GPipe-style (pipeline.py).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from framework.checkpoint import load_checkpoint
from framework.errors import ConfigError, instantiate
from framework.optimizer import with_this_update
from framework.private_apis import compiled_original

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


@dataclass(frozen=True)
class Compile:
    """trainer.compile: ``torch.compile`` with the run's backend and mode."""

    backend: str
    mode: Optional[str]

    @classmethod
    def of(cls, trainer: DictConfig) -> Optional["Compile"]:
        """The run's compile settings; None when trainer.compile is off."""
        return cls(trainer.compile_backend, trainer.compile_mode) if trainer.compile else None


def compiled(module: nn.Module, compile: Optional[Compile]) -> nn.Module:
    """``torch.compile(module)`` where ``compile`` asks for it, else ``module``.

    Each mode's ``wrap`` compiles the module a distributed wrapper runs (DDP's module, each
    pipeline stage, each block fsdp shards), as torch's guidance has it, not the wrapper.
    ``torch.compile(module)``, not ``module.compile()``: torch 2.13 silently skips the latter for a
    model made only of torch's own layers (an ``nn.Sequential``; pytorch/pytorch#150915), and 2.14.1
    still does once ``fully_shard`` wrapped such a module. Checkpoints hold
    ``unwrap``'s plain model, and TensorBoard's histograms ``plain_named_parameters``' names, without
    the ``_orig_mod.`` its parameter names get here.

    The batch dimension is not marked dynamic: a second batch size (an out-of-memory back-off,
    an epoch's last batch) recompiles once with it dynamic, and later sizes reuse that graph.
    """
    return module if compile is None else torch.compile(module, backend=compile.backend, mode=compile.mode)


@dataclass
class Environment:
    """Where this process runs and how it talks to the others (parallel=none: alone)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    compile: Optional[Compile] = None  # trainer.compile, applied by wrap

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # this process logs, shows progress and writes checkpoints

    @property
    def output_device(self) -> torch.device:
        """Where the model's outputs, and so the targets and the loss, live."""
        return self.device

    def wrap(self, model: nn.Module) -> nn.Module:
        return compiled(model.to(self.device), self.compile)

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

    # Whether building a checkpoint's state takes every process (fsdp gathers the shards to rank 0).
    collective_state: ClassVar[bool] = False
    # Whether torch.jit.trace can trace the wrapped model (TensorBoard's graph).
    traceable: ClassVar[bool] = True

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The plain model's full state dict, as a checkpoint holds it (only rank 0's need be complete)."""
        return unwrap(model).state_dict()

    def load_model_state(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        unwrap(model).load_state_dict(state)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's full state dict in torch's own form (parameters by index), as a checkpoint holds it."""
        return optimizer.state_dict()

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        optimizer.load_state_dict(with_this_update(state, optimizer))

    def shard_writer(self) -> Optional[Callable[[Dict[str, Any], Path], None]]:
        """What writes a checkpoint of which each process writes its own shards (checkpoint.sharded=true,
        parallel=fsdp); None: rank 0 writes the one file ``model_state`` and ``optimizer_state`` fill."""
        return None

    def read_checkpoint(self, path: Path, require: Sequence[str], model: nn.Module,
                        optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """A checkpoint's state for ``load_model_state`` and ``load_optimizer_state`` (for ``model`` and
        ``optimizer``): here a sharded one is read whole by every process."""
        return load_checkpoint(path, require)

    def unsharded(self, model: nn.Module):
        """Context in which the model's forward passes need no other process: evaluation, where processes
        hold different numbers of batches, and what rank 0 alone logs."""
        return contextlib.nullcontext()

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole value of a tensor computed from parameters or gradients the mode may shard."""
        return tensor

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
        inner = getattr(model, "module", None) or compiled_original(model)
        if inner is None:
            return model
        model = inner


def plain_named_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """The plain model's parameters under their plain names, in ``named_parameters``' order: no ``_orig_mod.``
    anywhere in a name, also where torch.compile wrapped a part of the model (each block fsdp shards)."""
    seen = set()
    for prefix, module in plain_modules(unwrap(model)):
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) not in seen:  # a shared parameter keeps its first name, as named_parameters gives it
                seen.add(id(parameter))
                yield prefix + name, parameter


def plain_modules(module: nn.Module, prefix: str = "") -> Iterator[Tuple[str, nn.Module]]:
    """Each module under ``module`` (a compiled one as the module it compiled) and its parameters' plain prefix."""
    module = compiled_original(module) or module
    yield prefix, module
    for name, child in module.named_children():
        yield from plain_modules(child, f"{prefix}{name}.")


def hookable(model: nn.Module) -> nn.Module:
    """The module to hook a forward of: the compiled one where trainer.compile made one, since its
    hooks run before the compiled code (the plain model's are traced into it), else the plain model."""
    while compiled_original(model) is None:
        inner = getattr(model, "module", None)
        if inner is None:
            return model
        model = inner
    return model


Task = Callable[[DictConfig, Path, Environment], Any]


@dataclass(frozen=True)
class Mode:
    """How a parallel option runs a task, built from the option's keys (``mode``). This one
    (parallel=none, no keys) runs the task here, in the one process's ``environment``."""

    def environment(self, cfg: DictConfig) -> Environment:
        """The environment of this process when it runs the task alone."""
        return Environment(device=resolve_device(cfg.device), compile=Compile.of(cfg.trainer))

    def launch(self, task: Task, cfg: DictConfig, run_dir: Path) -> Any:
        env = self.environment(cfg)
        try:
            return task(cfg, Path(run_dir), env)
        finally:
            env.cleanup()

    def launched_rank(self) -> int:
        """This process's rank when something outside runlab started the ranks; 0 otherwise."""
        return 0

    def launched_world_size(self) -> int:
        """How many processes something outside runlab started for this run; 1 otherwise."""
        return 1


@dataclass(frozen=True)
class DataParallel(Mode):
    """parallel=dp: one process, the model replicated on every GPU (conf/parallel/dp.yaml)."""

    devices: List[str]

    def environment(self, cfg: DictConfig) -> Environment:
        if cfg.trainer.compile:
            raise ConfigError("trainer.compile=true is not supported with parallel=dp: torch.compile supports "
                              "DistributedDataParallel, not nn.DataParallel; use parallel=ddp.")
        device = resolve_device(cfg.device)
        ids = [resolve_device(name).index for name in self.devices] if self.devices else \
            list(range(torch.cuda.device_count()))
        if device.type != "cuda" or len(ids) < 2:
            found = f"{len(ids)} GPU(s) are in use" if device.type == "cuda" else f"this run is on {device.type}"
            log.warning("parallel=dp needs at least 2 GPUs but %s; running the model unwrapped on %s.", found, device)
            return Environment(device=device)
        return DataParallelEnvironment(device=torch.device("cuda", ids[0]), device_ids=ids)


def mode(cfg: DictConfig) -> Mode:
    """The run's ``Mode``: what ``parallel._target_`` names, built with the option's keys."""
    return instantiate(cfg.parallel, _convert_="all")


def setup(cfg: DictConfig) -> Environment:
    """This process's environment for a task it runs alone (a ddp run's processes get theirs from ``launch``)."""
    return mode(cfg).environment(cfg)


def launched_rank(cfg: DictConfig) -> int:
    """This process's rank when something outside runlab started the ranks (torchrun, the tasks
    of a SLURM job): they may share one run dir. 0 otherwise."""
    return mode(cfg).launched_rank()


def launched_world_size(cfg: DictConfig) -> int:
    """How many processes torchrun or a SLURM job started for this run; 1 where runlab starts them."""
    return mode(cfg).launched_world_size()


def launch(task: Task, cfg: DictConfig, run_dir: Path) -> Any:
    """Run ``task(cfg, run_dir, env)`` in every process the mode needs; returns rank 0's result.

    ``task`` must be a module-level function: ddp pickles it into freshly spawned processes.
    """
    return mode(cfg).launch(task, cfg, Path(run_dir))
