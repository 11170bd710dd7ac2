"""Automatic out-of-memory recovery (troubleshoot.oom_recovery).

When a training step runs out of memory, the trainer drops the step's tensors, frees the
cache, halves the micro-batch and retries the same step: gradient accumulation doubles, so
the effective batch and the optimizer's trajectory do not change, and no optimizer step is
lost or repeated. Evaluation halves its batch the same way. Below micro-batch 1 there is
nothing left to halve, and the run stops with ``DoesNotFitError`` saying why and what to try.

Under several processes all ranks must back off together, and none may be left waiting in
a collective that an out-of-memory rank will never join; ``AgreedSync`` explains how.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from framework.errors import ResourceError
from framework.parallel import Environment, unwrap
from framework.troubleshoot.environment import gpu_status
from framework.troubleshoot.memory import activation_mb_per_sample, allocated_mb, model_memory

log = logging.getLogger(__name__)

# What the allocators say when they give up: CPU's RuntimeError, and CUDA's before OutOfMemoryError existed.
OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory")


class StepOutOfMemory(torch.OutOfMemoryError):
    """Raised on every rank once the ranks agree that at least one of them ran out of memory."""


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


class LocalSync:
    """One process, or recovery off: DDP synchronises gradients inside the last micro-batch's backward."""

    def __init__(self, env: Environment, model: nn.Module):
        self.env, self.model = env, model

    def micro_batch(self, is_last: bool):
        return contextlib.nullcontext() if is_last else self.env.no_sync(self.model)


class AgreedSync:
    """Several processes: every rank learns of an out-of-memory error anywhere before it can wait on that rank.

    DDP all-reduces gradient buckets from inside backward; a rank that ran out of memory in
    its forward or half-way through its backward would never join, and the others would
    wait in the all-reduce until the timeout. So every micro-batch runs under ``no_sync``
    (gradients accumulate locally), and after each one the ranks all-reduce an out-of-memory
    flag. After the last, the flag rides on the one all-reduce that averages the gradients
    (into a buffer allocated up front, so that all-reduce cannot itself run out of memory): a
    step costs one collective, as under DDP, without DDP's overlap of that all-reduce with
    backward, plus one tiny flag all-reduce per further micro-batch.

    The same all-reduce averages the floating-point buffers (batch-norm running statistics).
    DDP's own buffer broadcast must be off (``forward_sync_buffers=False``): DDP decides whether
    the next forward broadcasts in the previous forward's epilogue, which a forward that ran
    out of memory never reaches, so the ranks would disagree on the next broadcast.
    """

    def __init__(self, env: Environment, model: nn.Module):
        self.env, self.model = env, model
        self.params = [p for p in unwrap(model).parameters() if p.requires_grad]
        self.buffers = [b for b in unwrap(model).buffers() if b.is_floating_point()]
        tensors = self.params + self.buffers
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)
        self.buffer = torch.zeros(sum(t.numel() for t in tensors) + 1, dtype=dtype, device=env.device)
        views = [view.view_as(t) for view, t in zip(self.buffer[:-1].split([t.numel() for t in tensors]), tensors)]
        self.grad_views, self.buffer_views = views[:len(self.params)], views[len(self.params):]
        self.flag = torch.zeros(1, device=env.device)

    def micro_batch(self, is_last: bool) -> "_AgreedMicroBatch":
        return _AgreedMicroBatch(self, is_last)

    def ranks_out_of_memory(self, ran_out: bool, is_last: bool) -> int:
        """All-reduce this rank's flag (with the gradients after the last micro-batch); how many ranks ran out."""
        if not is_last:
            self.flag.fill_(float(ran_out))
            return int(self.env.all_reduce_sum(self.flag).item())
        if not ran_out:
            for param, view in zip(self.params, self.grad_views):
                if param.grad is None:
                    view.zero_()
                else:
                    view.copy_(param.grad)
            for buffer, view in zip(self.buffers, self.buffer_views):
                view.copy_(buffer)
        self.buffer[-1] = float(ran_out)
        reduced = self.env.all_reduce_sum(self.buffer)
        if reduced is not self.buffer:
            self.buffer.copy_(reduced)
        count = int(self.buffer[-1].item())
        if not count:
            self.buffer.div_(self.env.world_size)  # DDP averages gradients over ranks
            for param, view in zip(self.params, self.grad_views):
                if param.grad is not None:
                    param.grad.copy_(view)
            for buffer, view in zip(self.buffers, self.buffer_views):
                buffer.copy_(view)
        return count


class _AgreedMicroBatch:
    def __init__(self, sync: AgreedSync, is_last: bool):
        self.sync, self.is_last = sync, is_last

    def __enter__(self) -> None:
        self.no_sync = self.sync.env.no_sync(self.sync.model)
        self.no_sync.__enter__()

    def __exit__(self, kind, error, traceback) -> bool:
        self.no_sync.__exit__(None, None, None)
        ran_out = error is not None and is_out_of_memory(error)
        if error is not None and not ran_out:
            return False  # any other error propagates as it would without recovery
        count = self.sync.ranks_out_of_memory(ran_out, self.is_last)
        if count:
            here = f"; this one: {str(error).strip().splitlines()[0][:200]}" if ran_out else ""
            raise StepOutOfMemory(f"{count} of {self.sync.env.world_size} processes ran out of memory{here}")
        return False


class OOMRecovery:
    """Catches out-of-memory errors around a step or an eval pass and decides the smaller batch."""

    def __init__(self, cfg: DictConfig, env: Environment, model: nn.Module, optimizer: torch.optim.Optimizer,
                 spec: Dict[str, Any], input_shape: tuple):
        self.enabled, self.env, self.model, self.optimizer = cfg.oom_recovery, env, model, optimizer
        self.spec, self.input_shape = spec, input_shape
        self.backoffs, self.eval_backoffs, self.failure = 0, 0, ""
        agreed = self.enabled and env.world_size > 1
        self.sync = AgreedSync(env, model) if agreed else LocalSync(env, model)
        if cfg.inject_oom_above_batch >= 0 and cfg.inject_oom_rank in (-1, env.rank):
            unwrap(model).register_forward_pre_hook(functools.partial(_inject, limit=cfg.inject_oom_above_batch))

    def micro_batch(self, is_last: bool):
        """The context each micro-batch's forward and backward run in; it decides where gradients synchronise."""
        return self.sync.micro_batch(is_last)

    def attempt(self, work: Callable[..., Any], *args: Any) -> Optional[Any]:
        """``work(*args)``; None when it ran out of memory and recovery is on."""
        try:
            return work(*args)
        except (RuntimeError, MemoryError) as error:
            if not (self.enabled and is_out_of_memory(error)):
                raise
            # Only the text is kept: the error's traceback holds the step's tensors, and
            # leaving this block drops it.
            self.failure = str(error).strip().splitlines()[0][:300]
        return None

    def _halve(self, size: int, what: str, drop_grads: bool) -> Tuple[int, float, float]:
        """Free what the failed attempt held; the halved size and the memory before and after."""
        before = allocated_mb(self.env.device)
        if drop_grads:
            self.optimizer.zero_grad(set_to_none=True)
        release_memory(self.env.device)
        after = allocated_mb(self.env.device)
        if size == 1:
            raise DoesNotFitError(self.does_not_fit(what))
        return size // 2, before, after

    def back_off(self, micro_batch: int, batch: int, step: int, logger) -> int:
        """The micro-batch to retry the step with, after freeing what the failed attempt held."""
        smaller, before, after = self._halve(micro_batch, "micro-batch", drop_grads=True)
        self.backoffs += 1
        if self.env.is_main:
            log.warning("Out of memory at micro-batch %d (%s). Retrying step %d at micro-batch %d: accumulation %d -> %d, "
                        "effective batch unchanged; memory %.1f MB before clean-up, %.1f MB after.",
                        micro_batch, self.failure, step + 1, smaller, math.ceil(batch / micro_batch),
                        math.ceil(batch / smaller), before, after)
        logger.log_metrics({"troubleshoot/micro_batch": smaller, "troubleshoot/oom_backoffs": self.backoffs}, step)
        return smaller

    def back_off_eval(self, eval_batch: int, step: int, logger) -> int:
        smaller, before, after = self._halve(eval_batch, "eval batch", drop_grads=False)
        self.eval_backoffs += 1
        if self.env.is_main:
            log.warning("Out of memory in evaluation at batch %d (%s). Re-running the pass at batch %d; "
                        "memory %.1f MB before clean-up, %.1f MB after.", eval_batch, self.failure, smaller, before, after)
        logger.log_metrics({"troubleshoot/eval_batch_size": smaller, "troubleshoot/eval_backoffs": self.eval_backoffs}, step)
        return smaller

    def does_not_fit(self, what: str) -> str:
        sizes = model_memory(unwrap(self.model), self.optimizer)
        activations = activation_mb_per_sample(self.spec, self.input_shape)
        per_sample = f"about {activations:.2f} MB of activations per sample" if activations is not None else \
            "activation size unknown"
        return (f"out of memory on {self.env.device} even at {what} 1 ({self.failure}). "
                f"The model has {sizes['parameters']:,} parameters: {sizes['parameter_mb']:.1f} MB of weights, "
                f"{sizes['gradient_mb']:.1f} MB of gradients, {sizes['optimizer_state_mb']:.1f} MB of optimizer state, "
                f"{per_sample}. {gpu_status()} Try mixed precision (trainer.precision=bf16, or fp16 on CUDA), "
                "a smaller model (fewer or narrower layers), splitting the model across devices (model parallel), "
                "or gradient checkpointing in the model; `python run.py task=doctor` measures what fits.")

    def summary(self, micro_batch: int, eval_batch: int) -> Dict[str, float]:
        return {"troubleshoot/oom_backoffs": self.backoffs, "troubleshoot/eval_backoffs": self.eval_backoffs,
                "troubleshoot/micro_batch": micro_batch, "troubleshoot/eval_batch_size": eval_batch}


def _inject(module: nn.Module, args: tuple, limit: int) -> None:
    """The fault-injection testing aid: a synthetic OOM for any forward pass above ``limit`` samples."""
    if args and torch.is_tensor(args[0]) and args[0].shape[0] > limit:
        raise torch.OutOfMemoryError(f"synthetic out-of-memory: {args[0].shape[0]} samples > "
                                     f"troubleshoot.inject_oom_above_batch={limit} (a testing aid)")
