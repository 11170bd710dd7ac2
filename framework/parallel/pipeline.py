"""parallel=model: a sequential model's stages on several devices, pipelined GPipe-style.

The model's top-level children are cut into contiguous stages, one per device, balanced by
parameter count unless ``parallel.split`` gives the cut points. Each batch is cut into
``parallel.microbatches`` micro-batches that advance on a clock: at tick t stage s runs
micro-batch t - s, so while stage k+1 works on micro-batch i, stage k already works on i+1.
On CUDA, kernels launch asynchronously and the copies between devices are non-blocking, so
the devices overlap; on CPU the same schedule runs one stage at a time, which proves the
mechanics (same losses and weights as one device), not a speed-up.
"""
from __future__ import annotations

import functools
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from framework.errors import ConfigError
from framework.model import BATCH_NORMS
from framework.objective import ComputesOwnLoss
from framework.parallel import Compile, Environment, Mode, compiled, resolve_device

log = logging.getLogger(__name__)


def balanced_boundaries(sizes: Sequence[int], stages: int) -> List[int]:
    """Cut points splitting ``sizes`` into ``stages`` contiguous non-empty runs whose largest sum is smallest.

    ``[1, 4, 4, 1]`` in 2 stages gives ``[2]``: stages ``[1, 4]`` and ``[4, 1]``. Among equally
    balanced splits the earliest cut points win, so the result is deterministic.
    """
    if not 1 <= stages <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} layers into {stages} non-empty stages")
    prefix = [0, *itertools.accumulate(sizes)]

    @functools.lru_cache(maxsize=None)
    def best(parts: int, end: int) -> Tuple[int, Tuple[int, ...]]:
        """(largest stage sum, cut points) for the first ``end`` layers in ``parts`` stages."""
        if parts == 1:
            return prefix[end], ()
        options = []
        for cut in range(parts - 1, end):
            largest, cuts = best(parts - 1, cut)
            options.append((max(largest, prefix[end] - prefix[cut]), cuts + (cut,)))
        return min(options)

    return list(best(stages, len(sizes))[1])


def check_boundaries(boundaries: Sequence[int], layers: int, stages: int) -> None:
    inside = all(0 < b < layers for b in boundaries)
    increasing = all(a < b for a, b in zip(boundaries, boundaries[1:]))
    if len(boundaries) != stages - 1 or not inside or not increasing:
        raise ConfigError(f"parallel.split={list(boundaries)} is invalid for {stages} stages of a {layers}-layer model; "
                          f"give {stages - 1} increasing cut points between 1 and {layers - 1}.")


def stage_boundaries(model: nn.Module, stages: int, explicit: Sequence[int]) -> List[int]:
    """Where to cut ``model``: ``explicit`` if given, else balanced by parameter count."""
    name = type(model).__name__
    if isinstance(model, ComputesOwnLoss):
        raise ConfigError(f"parallel=model cannot pipeline a model that computes its own loss from the whole batch "
                          f"({type(model.module).__name__}.loss, objective=model_loss); use parallel=ddp.")
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        raise ConfigError(f"parallel=model needs an nn.Sequential-like model whose forward just chains its children, "
                          f"but {name} is not one; use parallel=ddp, or build the model as an nn.Sequential of stages.")
    if len(model) < stages:
        raise ConfigError(f"parallel.devices lists {stages} devices but {name} has only {len(model)} top-level layers; "
                          f"use at most {len(model)} devices.")
    if explicit:
        check_boundaries(explicit, len(model), stages)
        return list(explicit)
    return balanced_boundaries([sum(p.numel() for p in child.parameters()) for child in model], stages)


class Pipeline(nn.Module):
    """Runs ``module``'s stages on their devices; takes input on the first, returns output on the last.

    ``module`` stays the plain model (so ``unwrap`` and checkpoints see the usual keys); the
    stages are views of its children, not registered a second time.
    """

    def __init__(self, module: nn.Sequential, devices: Sequence[torch.device], boundaries: Sequence[int],
                 microbatches: int):
        super().__init__()
        self.module, self.devices, self.microbatches = module, list(devices), microbatches
        layers = list(module.named_children())
        edges = [0, *boundaries, len(layers)]
        self.stages = tuple(nn.Sequential(OrderedDict(layers[start:end])).to(device)
                            for start, end, device in zip(edges, edges[1:], self.devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"parallel=model pipelines one input tensor, cut into micro-batches along its first "
                              f"dimension, but this batch's inputs are a {type(x).__name__}; use parallel=ddp.")
        chunks = list(x.chunk(self.microbatches))
        for tick in range(len(chunks) + len(self.stages) - 1):
            # Stage s takes micro-batch tick - s, which stage s - 1 finished on the previous tick.
            for s, (stage, device) in enumerate(zip(self.stages, self.devices)):
                i = tick - s
                if 0 <= i < len(chunks):
                    chunks[i] = stage(chunks[i].to(device, non_blocking=True))
        return torch.cat(chunks)

    def describe(self) -> str:
        return "; ".join(f"stage {s} on {device}: {', '.join(name for name, _ in stage.named_children())} "
                         f"({sum(p.numel() for p in stage.parameters()):,} parameters)"
                         for s, (stage, device) in enumerate(zip(self.stages, self.devices)))


@dataclass
class PipelineEnvironment(Environment):
    devices: List[torch.device] = field(default_factory=list)
    split: List[int] = field(default_factory=list)
    microbatches: int = 1

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]

    def wrap(self, model: nn.Module) -> nn.Module:
        boundaries = stage_boundaries(model, len(self.devices), self.split)
        has_batch_norm = any(isinstance(m, BATCH_NORMS) for m in model.modules())
        if has_batch_norm and self.microbatches > 1:
            log.warning("BatchNorm layers compute their statistics per micro-batch under parallel.microbatches=%d, "
                        "so training differs slightly from parallel=none.", self.microbatches)
        pipeline = Pipeline(model, self.devices, boundaries, self.microbatches)
        log.info("Model parallel, %d micro-batches per batch: %s.", self.microbatches, pipeline.describe())
        # Each stage on its device; the schedule and the copies between devices stay eager.
        pipeline.stages = tuple(compiled(stage, self.compile) for stage in pipeline.stages)
        return pipeline


def pipeline_devices(names: Sequence[str]) -> List[torch.device]:
    """The stage devices: as listed, else every visible GPU, else two CPU stages."""
    if not names:
        count = torch.cuda.device_count()
        names = [f"cuda:{i}" for i in range(count)] if count >= 2 else ["cpu", "cpu"]
    return [resolve_device(name) for name in names]


@dataclass(frozen=True)
class ModelParallel(Mode):
    """parallel=model: one process, the model's stages on several devices. Built from
    conf/parallel/model.yaml's keys."""

    devices: List[str]
    microbatches: int
    split: List[int]

    def environment(self, cfg: DictConfig) -> PipelineEnvironment:
        devices = pipeline_devices(self.devices)
        return PipelineEnvironment(device=devices[0], devices=devices, split=list(self.split),
                                   microbatches=self.microbatches, compile=Compile.of(cfg.trainer))
