"""parallel=fsdp: FSDP2 (``torch.distributed.fsdp.fully_shard``), one process per device.

It launches exactly as parallel=ddp does (distributed.py: processes spawned by the Hydra job,
torchrun, the tasks of a SLURM job), and every rank reads its slice of each global batch the same
way; what differs is the model. Each block (each top-level child of the model, or each module
whose class ``parallel.shard_modules`` names) is sharded, then the model itself: every process
keeps 1/world_size of each parameter, of its gradient and of the optimizer's state for it,
gathers a block's parameters for that block's forward and backward, and reduce-scatters its
gradients, averaged, so a step equals one step of parallel=none on the whole batch.

What the rest of runlab asks of the model goes through this environment:

- checkpoints stay one portable file: ``model_state`` and ``optimizer_state`` gather the full
  state to rank 0's CPU memory, in the form parallel=none saves, and the ``load_*`` methods
  shard such a state again, so a checkpoint moves freely between none, ddp and fsdp;
- with ``checkpoint.sharded=true``, for a model too big to gather, they are each process's shards
  instead, which ``save_shards`` writes with ``torch.distributed.checkpoint`` (framework/checkpoint.py
  has the format) and ``read_checkpoint`` reads back, each process its part at any number of
  processes; one process (task=eval, parallel=none) reads such a checkpoint whole;
- evaluation, and what rank 0 alone logs (TensorBoard's histograms and graph), run ``unsharded``:
  the parameters are gathered once, so forward passes need no collective and the processes may
  hold different numbers of evaluation batches;
- ``trainer.precision=bf16`` keeps the parameters in bf16 for compute (FSDP2's
  ``MixedPrecisionPolicy``) and reduces the gradients in fp32.
- ``trainer.compile=true`` compiles each block before it is sharded (``compiled_blocks``).

Out-of-memory recovery cannot work here as it does under ddp: FSDP's collectives run inside the
forward and the backward, block by block, so a process that ran out of memory cannot join the
others at a point they all reach. A training step that runs out of memory ends the run with a
message saying what to change; evaluation, which runs unsharded, backs off as under ddp.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from framework.checkpoint import (REST, by_index, by_name, clear, is_sharded, no_space_left, publish_sharded,
                                  save_checkpoint, split_tensors, unpublished)
from framework.errors import CheckpointError, ConfigError, ResourceError, disk_full
from framework.optimizer import with_this_update
from framework.parallel import Compile, Task, compiled, plain_named_parameters, unwrap
from framework.parallel.distributed import DDP, DistributedEnvironment
from framework.shards import read_sharded

# The full state, gathered to rank 0's CPU memory (the other ranks get none of it).
GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Every rank holds the full state (each read the checkpoint) and keeps its own shard of it.
FULL = StateDictOptions(full_state_dict=True)
# Each rank's own shards (checkpoint.sharded=true).
SHARDED = StateDictOptions()


@dataclass
class ShardedEnvironment(DistributedEnvironment):
    shard_modules: List[str] = field(default_factory=list)  # parallel.shard_modules
    reshard_after_forward: bool = True
    param_dtype: Optional[torch.dtype] = None  # bf16 under trainer.precision=bf16
    sharded_checkpoints: bool = False  # checkpoint.sharded

    collective_state = True
    traceable = False  # the trace's own check fails on the module classes fully_shard makes for each instance

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device)
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype,
                                      reduce_dtype=torch.float32 if self.param_dtype is not None else None)
        for block in compiled_blocks(unwrap(model), shard_blocks(unwrap(model), self.shard_modules), self.compile):
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        # The root's parameters are gathered again at once for backward, so it keeps them (torch's default for it).
        return fully_shard(model, reshard_after_forward=False, mp_policy=policy)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def processes_out_of_memory(self, model: nn.Module, ran_out: bool) -> int:
        if ran_out:
            raise ResourceError(
                "a training step ran out of memory, and parallel=fsdp cannot retry it at a smaller micro-batch: "
                "the other processes wait in a collective inside the forward or backward that this one left. Raise "
                "trainer.accumulate_grad_batches, lower batch_size, or keep parallel.reshard_after_forward=true.")
        return 0

    def model_state(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        return get_model_state_dict(unwrap(model), options=SHARDED if self.sharded_checkpoints else GATHERED)

    def load_model_state(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        sharded = any(isinstance(value, DTensor) for value in state.values())  # read by read_checkpoint
        set_model_state_dict(unwrap(model), state, options=SHARDED if sharded else FULL)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        if self.sharded_checkpoints:
            return get_optimizer_state_dict(unwrap(model), optimizer, options=SHARDED)
        return by_index(get_optimizer_state_dict(unwrap(model), optimizer, options=GATHERED))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        if all(isinstance(name, str) for group in state["param_groups"] for name in group["params"]):
            # by name: read by read_checkpoint
            set_optimizer_state_dict(unwrap(model), optimizer, with_this_update(state, optimizer), options=SHARDED)
            return
        names = parameter_names(unwrap(model), optimizer)
        set_optimizer_state_dict(unwrap(model), optimizer, with_this_update(by_name(state, names), optimizer), options=FULL)

    def shard_writer(self) -> Optional[Callable[[Dict[str, Any], Path], None]]:
        return self.save_shards if self.sharded_checkpoints else None

    def save_shards(self, state: Dict[str, Any], path: Path) -> None:
        """Write ``model_state`` and ``optimizer_state``'s shards, each process its own, with the rest of
        ``state`` beside them (rank 0), as the sharded checkpoint ``path``: atomically, as a single file is."""
        tensors, rest = split_tensors(state)
        tmp = unpublished(path)
        if self.is_main:
            clear(tmp)  # what a write killed midway left
        self.barrier()  # no process writes into the folder before rank 0 cleared it
        try:
            dcp.save(tensors, checkpoint_id=tmp)
        except dcp.CheckpointException as error:  # a BaseException: one failure per process that failed
            raise shards_not_written(path, tmp, error) from None
        # dcp.save returns on rank 0 once every process reported its shards written and synced, and its
        # index (.metadata) too: the checkpoint is complete but for the rest, rank 0's to write.
        if self.is_main:
            save_checkpoint(rest, tmp / REST)
            publish_sharded(tmp, path, state["step"])

    def read_checkpoint(self, path: Path, require: Sequence[str], model: nn.Module,
                        optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """A sharded checkpoint is read by every process, each its own shards of this model and optimizer,
        whatever the number of processes that wrote it; a single file as every mode reads it."""
        if not is_sharded(Path(path)):
            return super().read_checkpoint(path, require, model, optimizer)
        state = {"model": get_model_state_dict(unwrap(model), options=SHARDED)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(unwrap(model), optimizer, options=SHARDED)
        tensors, _ = split_tensors(state)
        state = read_sharded(Path(path), require, into=tensors)
        if optimizer is None:
            del state["optimizer"]  # its part of the checkpoint was not read
        return state

    @contextlib.contextmanager
    def unsharded(self, model: nn.Module) -> Iterator[None]:
        sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
        for module in sharded:
            module.unshard()
        model.set_reshard_after_forward(False)
        try:
            yield
        finally:
            for module in sharded:
                if module is not model:
                    module.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
                module.reshard()

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shards_not_written(path: Path, tmp: Path, error: BaseException) -> Exception:
    """What ends the run when this process's shards could not be written: a full disk in one line, as a
    single file's; else the failure, named. The previous checkpoint ``path`` links to is whole either way."""
    failure = next(iter(getattr(error, "failures", {}).values()), (error,))[0]
    if disk_full(failure, tmp.parent):
        return no_space_left(path)
    return CheckpointError(f"writing the sharded checkpoint {path} failed ({type(failure).__name__}: "
                           f"{str(failure).strip()[:200]}); the previous one is kept.")


def shard_blocks(model: nn.Module, class_names: List[str]) -> List[nn.Module]:
    """The modules sharded one by one before the model: those of the named classes (outermost only:
    a block's own sub-blocks are part of it), or else each top-level child that has parameters."""
    if not class_names:
        return [child for child in model.children() if any(True for _ in child.parameters())]
    blocks: List[nn.Module] = []
    inside: set = set()
    for module in model.modules():
        if id(module) in inside or type(module).__name__ not in class_names:
            continue
        blocks.append(module)
        inside.update(id(sub) for sub in module.modules())
    if not blocks:
        found = sorted({type(module).__name__ for module in model.modules()})
        raise ConfigError(f"parallel.shard_modules={class_names} names no module of {type(model).__name__}; "
                          f"its module classes are {', '.join(found)}.")
    return blocks


def compiled_blocks(model: nn.Module, blocks: List[nn.Module], compile: Optional[Compile]) -> List[nn.Module]:
    """The blocks to shard, each compiled in its place where trainer.compile asks for it: compiled before
    fully_shard, as torchtitan compiles each transformer block, so that FSDP's hooks gather and free the
    parameters around the compiled code. ``torch.compile(block)``: ``block.compile()`` of a block of torch's
    own layers (an nn.Sequential, a Linear) runs eagerly once it is sharded, silently (torch 2.14.1).
    Parameter names get the wrapper's ``_orig_mod.``, which torch.distributed.checkpoint's state dicts,
    and so checkpoints, leave out."""
    if compile is None:
        return blocks
    if any(block is model for block in blocks):
        raise ConfigError(f"parallel.shard_modules names {type(model).__name__}, the model itself, which "
                          "trainer.compile=true cannot compile as a block; name the classes of its blocks.")
    places = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    wrapped = []
    for block in blocks:
        parent, name = places[id(block)]
        wrapped.append(compiled(block, compile))
        parent.register_module(name, wrapped[-1])
    return wrapped


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[str]:
    """The name of each parameter the optimizer holds, in its order (the order torch numbers them in),
    as torch.distributed.checkpoint names it: without a compiled block's ``_orig_mod.``."""
    names = {id(parameter): name for name, parameter in plain_named_parameters(model)}
    return [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]


def check_fsdp(cfg: DictConfig) -> None:
    """What fsdp cannot do, refused before any process starts."""
    if str(cfg.trainer.precision) == "fp16":
        raise ConfigError("trainer.precision=fp16 is not supported with parallel=fsdp: the gradient scaler would see "
                          "only this process's shard of the gradients; use trainer.precision=bf16.")
    if cfg.checkpoint.enabled and cfg.checkpoint.every_minutes:
        raise ConfigError(f"checkpoint.every_minutes={cfg.checkpoint.every_minutes} is not supported with parallel=fsdp: "
                          "every process takes part in writing a checkpoint, so they must agree on when without "
                          "comparing clocks; use checkpoint.every_n_steps.")


@dataclass(frozen=True)
class FSDP(DDP):
    """parallel=fsdp: the task runs in every process of the group, each in its ShardedEnvironment.
    Built from conf/parallel/fsdp.yaml's keys: ddp's and these."""

    shard_modules: List[str]
    reshard_after_forward: bool

    def launch(self, task: Task, cfg: DictConfig, run_dir: Path) -> Any:
        check_fsdp(cfg)
        return super().launch(task, cfg, run_dir)

    def group_environment(self, cfg: DictConfig, **joined: Any) -> ShardedEnvironment:
        return ShardedEnvironment(**joined, shard_modules=list(self.shard_modules),
                                  reshard_after_forward=self.reshard_after_forward,
                                  param_dtype=torch.bfloat16 if str(cfg.trainer.precision) == "bf16" else None,
                                  sharded_checkpoints=cfg.checkpoint.sharded)
