"""Automatic out-of-memory recovery (troubleshoot.oom_recovery).

When a training step runs out of memory, the trainer drops the step's tensors, frees the
cache, halves the micro-batch and retries the same step: gradient accumulation doubles, so
the effective batch and the optimizer's trajectory do not change, and no optimizer step is
lost or repeated. Evaluation halves its batch the same way. Below micro-batch 1 there is
nothing left to halve, and the run stops with ``DoesNotFitError`` saying why and what to try.

This module only catches and halves. Whether a step failed is decided with the other
processes (parallel's ``Environment.processes_out_of_memory``), and the step itself, with
its sizes, belongs to ``framework.step.TrainStep``.
"""
from __future__ import annotations

import functools
import gc
import logging
import math
from typing import Any, Callable, Dict, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from framework.errors import ResourceError
from framework.parallel import Environment, hookable, unwrap
from framework.troubleshoot.environment import gpu_status
from framework.troubleshoot.memory import activation_mb_per_sample, allocated_mb, model_memory

log = logging.getLogger(__name__)

# What the allocators say when they give up: CPU's RuntimeError, and CUDA's before OutOfMemoryError existed.
OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory")


class DoesNotFitError(ResourceError):
    """Even one sample per micro-batch (or eval batch) does not fit; the message says what to try."""


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OOM_MESSAGES)


def release_memory(device: torch.device) -> None:
    # The failed step's frames, traceback and any reference cycles through them are all new
    # objects, so collecting the young generations finds them; a full collection would also
    # walk everything torch and Hydra created at import (~0.3 s) for nothing.
    gc.collect(1)
    if device.type == "cuda":
        torch.cuda.empty_cache()


class OOMRecovery:
    """Catches out-of-memory errors around a step or an eval pass, frees what they held and decides the smaller batch."""

    def __init__(self, cfg: DictConfig, env: Environment, model: nn.Module, optimizer: torch.optim.Optimizer,
                 spec: Dict[str, Any], input_shape: tuple):
        self.enabled, self.env, self.model, self.optimizer = cfg.oom_recovery, env, unwrap(model), optimizer
        self.spec, self.input_shape = spec, input_shape
        self.backoffs, self.eval_backoffs, self.failure = 0, 0, ""
        self.freed = (0.0, 0.0)  # memory held before and after the last clean-up, in MB
        if cfg.inject_oom_above_batch >= 0 and cfg.inject_oom_rank in (-1, env.rank):
            hookable(model).register_forward_pre_hook(functools.partial(_inject, limit=cfg.inject_oom_above_batch))

    def attempt(self, work: Callable[..., Any], *args: Any) -> Optional[Any]:
        """``work(*args)``; None when it ran out of memory and recovery is on."""
        self.failure = ""
        try:
            return work(*args)
        except (RuntimeError, MemoryError) as error:
            if not (self.enabled and is_out_of_memory(error)):
                raise
            # Only the text is kept: the error's traceback holds the step's tensors, and
            # leaving this block drops it.
            self.failure = str(error).strip().splitlines()[0][:300]
        return None

    def free(self, drop_gradients: bool) -> None:
        """Drop what a failed attempt held, and its gradients when it was a training step."""
        before = allocated_mb(self.env.device)
        if drop_gradients:
            self.optimizer.zero_grad(set_to_none=True)
        release_memory(self.env.device)
        self.freed = (before, allocated_mb(self.env.device))

    def cause(self, processes: int) -> str:
        """What ran out, for the log line: this process's error, or how many of the others ran out."""
        if self.failure:
            return self.failure
        return f"{processes} of {self.env.world_size} processes ran out of memory"

    def halved(self, size: int, what: str) -> int:
        if size == 1:
            raise DoesNotFitError(self.does_not_fit(what))
        return size // 2

    def back_off(self, micro_batch: int, batch: int, step: int, processes: int, logger) -> int:
        """The micro-batch to retry optimizer step ``step`` (0-based) with, after ``processes`` ran out of memory."""
        smaller = self.halved(micro_batch, "micro-batch")
        self.backoffs += 1
        if self.env.is_main:
            log.warning("Out of memory at micro-batch %d (%s). Retrying step %d at micro-batch %d: accumulation %d -> %d, "
                        "effective batch unchanged; memory %.1f MB before clean-up, %.1f MB after.",
                        micro_batch, self.cause(processes), step + 1, smaller, math.ceil(batch / micro_batch),
                        math.ceil(batch / smaller), *self.freed)
        logger.log_metrics({"troubleshoot/micro_batch": smaller, "troubleshoot/oom_backoffs": self.backoffs}, step)
        return smaller

    def back_off_eval(self, eval_batch: int, step: int, processes: int, logger) -> int:
        smaller = self.halved(eval_batch, "eval batch")
        self.eval_backoffs += 1
        if self.env.is_main:
            log.warning("Out of memory in evaluation at batch %d (%s). Re-running the pass at batch %d; "
                        "memory %.1f MB before clean-up, %.1f MB after.", eval_batch, self.cause(processes), smaller,
                        *self.freed)
        logger.log_metrics({"troubleshoot/eval_batch_size": smaller, "troubleshoot/eval_backoffs": self.eval_backoffs}, step)
        return smaller

    def does_not_fit(self, what: str) -> str:
        sizes = model_memory(self.model, self.optimizer)
        activations = activation_mb_per_sample(self.spec, self.input_shape)
        per_sample = f"about {activations:.2f} MB of activations per sample" if activations is not None else \
            "activation size unknown"
        return (f"out of memory on {self.env.device} even at {what} 1 ({self.failure}). "
                f"The model has {sizes['parameters']:,} parameters: {sizes['parameter_mb']:.1f} MB of weights, "
                f"{sizes['gradient_mb']:.1f} MB of gradients, {sizes['optimizer_state_mb']:.1f} MB of optimizer state, "
                f"{per_sample}. {gpu_status()} Try mixed precision (trainer.precision=bf16, or fp16 on CUDA), "
                "a smaller model (fewer or narrower layers), splitting the model across devices (model parallel), "
                "or gradient checkpointing in the model; `python run.py task=doctor` measures what fits.")

    def summary(self) -> Dict[str, float]:
        return {"troubleshoot/oom_backoffs": self.backoffs, "troubleshoot/eval_backoffs": self.eval_backoffs}


def _inject(module: nn.Module, args: tuple, limit: int) -> None:
    """The fault-injection testing aid: a synthetic OOM for any forward pass above ``limit`` samples."""
    if args and torch.is_tensor(args[0]) and args[0].shape[0] > limit:
        raise torch.OutOfMemoryError(f"synthetic out-of-memory: {args[0].shape[0]} samples > "
                                     f"troubleshoot.inject_oom_above_batch={limit} (a testing aid)")
