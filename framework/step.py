"""One optimizer step, and one evaluation pass, at sizes that fit (conf/trainer/, conf/troubleshoot/).

``TrainStep`` owns everything a step is: autocast and fp16 gradient scaling (``Precision``),
the micro-batches a batch is split into (gradient accumulation), gradient clipping, the
non-finite check, and the batch sizes themselves. When a step or an evaluation pass runs out
of memory it frees what the attempt held, halves the micro-batch (or eval batch) and retries
the same step, so no optimizer step is lost or repeated (troubleshoot/oom.py decides the
smaller size; parallel's ``Environment`` makes the processes of a ddp run agree). The sizes
travel in checkpoints (``state_dict``): a resumed run starts where the last one settled.

The step never looks inside a batch: the objective (objective.py) turns one into a loss, and
framework/batch.py moves and cuts it. The training loop (trainer.py) and the doctor
(troubleshoot/doctor.py) both drive it.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from framework import batch as batches
from framework.errors import ConfigError
from framework.nonfinite import NonFiniteGuard
from framework.objective import Objective
from framework.parallel import Environment
from framework.private_apis import one_kernel_total_norm
from framework.troubleshoot.oom import OOMRecovery


class Precision:
    """Autocast and, for fp16, gradient scaling; a no-op at 32-bit."""

    def __init__(self, precision: str, device: torch.device):
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError(f"trainer.precision=fp16 needs a CUDA device, but this run is on {device.type}; use bf16 or 32.")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


@torch.inference_mode()
def evaluation_pass(model: nn.Module, objective: Objective, split_batches, env: Environment, precision: Precision) -> bool:
    """Feed this process's share of a split to the objective's metrics; no graph is built."""
    model.eval()
    objective.reset()
    for batch in split_batches:
        with precision.autocast():
            objective.update(model, batch)
    return True


def evaluate(model: nn.Module, objective: Objective, split_batches, env: Environment, precision: Precision) -> Dict[str, float]:
    """The objective's loss and metrics over a split, across processes."""
    evaluation_pass(model, objective, split_batches, env, precision)
    return objective.compute(env.all_reduce_sum)


def configured_micro_batch(cfg: DictConfig, world_size: int) -> int:
    """The micro-batch this config asks for: each process's share of batch_size, split for accumulation."""
    per_process = cfg.batch_size // world_size
    accumulate = cfg.trainer.accumulate_grad_batches
    if per_process % accumulate:
        raise ConfigError(f"trainer.accumulate_grad_batches={accumulate} does not divide the per-process batch "
                          f"of {per_process}; pick a divisor of it.")
    return per_process // accumulate


class TrainStep:
    """``step(batch, index, where)``: one optimizer step over a batch; ``evaluate(batches)``: one pass."""

    def __init__(self, cfg: DictConfig, env: Environment, model: nn.Module, objective: Objective,
                 optimizer: torch.optim.Optimizer, nonfinite: NonFiniteGuard, oom: OOMRecovery, logger):
        self.env, self.optimizer, self.nonfinite, self.oom, self.logger = env, optimizer, nonfinite, oom, logger
        self.objective = objective
        self.model = model  # the wrapped model: under ddp a failed step may wrap it anew (after_failed_step)
        self.parameters = list(model.parameters())  # listed once: walking the modules costs more than the norm
        # Plain tensors on one device, of one dtype (most models): their norm is one kernel. Sharded (fsdp)
        # or spread over devices (parallel=model), torch groups them.
        one_group = len({(p.device, p.dtype) for p in self.parameters}) == 1
        plain = all(type(p) is nn.Parameter for p in self.parameters)
        self.norm_of = one_kernel_total_norm if one_group and plain else torch.nn.utils.get_total_norm
        self.precision = Precision(str(cfg.trainer.precision), env.device)
        self.clip = cfg.trainer.gradient_clip_val
        self.configured_sizes = configured_micro_batch(cfg, env.world_size), cfg.data.eval_batch_size
        self.micro_batch, self.eval_batch_size = self.configured_sizes

    @classmethod
    def of(cls, cfg: DictConfig, env: Environment, setup, nonfinite: NonFiniteGuard, logger) -> "TrainStep":
        """The step for a ``trainer.Setup``: its model and optimizer, with out-of-memory recovery as configured."""
        oom = OOMRecovery(cfg.troubleshoot, env, setup.model, setup.optimizer, setup.spec, setup.data.input_shape)
        return cls(cfg, env, setup.model, setup.objective, setup.optimizer, nonfinite, oom, logger)

    def __call__(self, batch: Any, index: int, where: str) -> Optional[torch.Tensor]:
        """Optimizer step ``index`` (0-based) over the batch; returns its mean loss (detached), or None when
        the step was not finite and skipped. ``where`` names the step in messages."""
        while (loss := self.gradients(batch, index)) is None:
            pass  # a process ran out of memory: every one backed off, and the same step is tried again
        grad_norm = self.unscaled_grad_norm()
        applied = self.nonfinite.step_is_finite(loss, grad_norm, where, self.lr)
        if applied:
            self.precision.scaler.step(self.optimizer)
        self.precision.scaler.update()
        return loss if applied else None

    def gradients(self, batch: Any, index: int) -> Optional[torch.Tensor]:
        """The batch's gradients in place and its mean loss, or None when some process ran out of memory
        (then all of them have freed the attempt and halved the micro-batch)."""
        loss = self.oom.attempt(self.accumulate_gradients, batch)
        if loss is None:  # free what the attempt held before joining the other processes' collectives
            self.oom.free(drop_gradients=True)
        ran_out = self.env.processes_out_of_memory(self.model, ran_out=loss is None)
        if not ran_out:
            return loss
        if loss is not None:  # another process ran out: this one drops its finished attempt too
            self.oom.free(drop_gradients=True)
        self.model = self.env.after_failed_step(self.model)
        self.micro_batch = self.oom.back_off(self.micro_batch, batches.size(batch), index, ran_out, self.logger)
        return None

    def accumulate_gradients(self, batch: Any) -> torch.Tensor:
        """Forward and backward over the batch in micro-batches; returns the batch's mean loss (detached)."""
        self.optimizer.zero_grad(set_to_none=True)
        batch_loss = None
        samples = batches.size(batch)
        # A batch that is one micro-batch is not split: each split is an op, and a small model's step is a few.
        micro_batches = batches.split(batch, self.micro_batch) if samples > self.micro_batch else [batch]
        last = math.ceil(samples / self.micro_batch) - 1
        for i, micro_batch in enumerate(micro_batches):
            # Gradients accumulate locally until the last micro-batch, whose backward synchronises
            # them across processes (under ddp: bucket by bucket, overlapped with that backward).
            with self.env.no_sync(self.model) if i < last else contextlib.nullcontext():
                with self.precision.autocast():
                    loss = self.objective.loss(self.model, micro_batch)
                # Weight each micro-batch by its share, so the gradient equals the full batch's
                # (a whole batch skips the multiplication: a small model's step is a few ops).
                if last:
                    loss = loss * (batches.size(micro_batch) / samples)
                self.precision.scaler.scale(loss).backward()
            batch_loss = loss.detach() if batch_loss is None else batch_loss + loss.detach()
        return batch_loss

    def unscaled_grad_norm(self) -> torch.Tensor:
        """The gradients' total norm (clipped to trainer.gradient_clip_val when set), as a tensor: no host sync."""
        self.precision.scaler.unscale_(self.optimizer)
        parameters = [p for p in self.parameters if p.grad is not None]
        if not parameters:  # everything frozen, or a step whose loss reached no parameter
            return torch.zeros((), device=self.env.device)
        norm = self.norm_of([p.grad for p in parameters])
        if self.clip:
            torch.nn.utils.clip_grads_with_norm_(parameters, self.clip, norm)
        # Over sharded gradients (fsdp) the norm is already the whole model's; full_tensor makes it a plain tensor.
        return self.env.full_tensor(norm)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def evaluate(self, split_batches, index: int = 0) -> Dict[str, float]:
        """The objective's loss and metrics over a split, across processes; no graph is built.

        If any process runs out of memory, all of them halve the eval batch and redo the pass:
        they agree on it before the metrics are computed (which, under ddp, gathers them).
        """
        while True:
            split_batches.set_batch_size(self.eval_batch_size)
            with self.env.unsharded(self.model):
                finished = self.oom.attempt(evaluation_pass, self.model, self.objective, split_batches, self.env,
                                            self.precision)
            if not finished:
                self.oom.free(drop_gradients=False)
            ran_out = int(self.env.all_reduce_sum(torch.tensor([0.0 if finished else 1.0], device=self.env.device)).item())
            if not ran_out:
                return self.objective.compute(self.env.all_reduce_sum)
            self.eval_batch_size = self.oom.back_off_eval(self.eval_batch_size, index, ran_out, self.logger)

    @property
    def sizes(self) -> tuple:
        """The batch shape memory depends on: (micro-batch, eval batch)."""
        return self.micro_batch, self.eval_batch_size

    def summary(self) -> Dict[str, float]:
        return {**self.oom.summary(), "troubleshoot/micro_batch": self.micro_batch,
                "troubleshoot/eval_batch_size": self.eval_batch_size}

    def state_dict(self) -> Dict[str, Any]:
        return {"scaler": self.precision.scaler.state_dict(), "micro_batch": self.micro_batch,
                "eval_batch_size": self.eval_batch_size}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state["scaler"] and self.precision.scaler.is_enabled():  # empty when saved at 32-bit or bf16
            self.precision.scaler.load_state_dict(state["scaler"])
        # An out-of-memory back-off stays; smaller sizes on this command line apply too.
        micro_batch, eval_batch_size = self.configured_sizes
        self.micro_batch = min(state["micro_batch"], micro_batch)
        self.eval_batch_size = min(state.get("eval_batch_size", eval_batch_size), eval_batch_size)
