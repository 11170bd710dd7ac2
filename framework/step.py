"""One optimizer step, and one evaluation pass, at sizes that fit (conf/trainer/, conf/troubleshoot/).

``TrainStep`` owns everything a step is: autocast and fp16 gradient scaling (``Precision``),
the micro-batches a batch is split into (gradient accumulation), gradient clipping, the
non-finite check, and the batch sizes themselves. When a step or an evaluation pass runs out
of memory it frees what the attempt held, halves the micro-batch (or eval batch) and retries
the same step, so no optimizer step is lost or repeated (troubleshoot/oom.py decides the
smaller size; parallel's ``Environment`` makes the processes of a ddp run agree). The sizes
travel in checkpoints (``state_dict``): a resumed run starts where the last one settled.

The training loop (trainer.py) and the doctor (troubleshoot/doctor.py) both drive it.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from framework.errors import ConfigError
from framework.nonfinite import NonFiniteGuard
from framework.parallel import Environment
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
def eval_totals(model: nn.Module, batches, env: Environment, precision: Precision) -> torch.Tensor:
    """This process's loss sum, correct count, sample count and an out-of-memory flag (0 here) over a split."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=env.output_device)
    for x, y in batches:
        if not batches.on_device:
            x, y = x.to(env.device), y.to(env.output_device)
        with precision.autocast():
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    return totals


def summarize(totals: torch.Tensor) -> Dict[str, float]:
    loss_sum, correct, count, _ = totals.tolist()
    return {"loss": loss_sum / count, "acc": correct / count}


def evaluate(model: nn.Module, batches, env: Environment, precision: Precision) -> Dict[str, float]:
    """Mean loss and accuracy over a split, summed across processes; no graph is built."""
    return summarize(env.all_reduce_sum(eval_totals(model, batches, env, precision)))


def configured_micro_batch(cfg: DictConfig, world_size: int) -> int:
    """The micro-batch this config asks for: each process's share of batch_size, split for accumulation."""
    per_process = cfg.batch_size // world_size
    accumulate = cfg.trainer.accumulate_grad_batches
    if per_process % accumulate:
        raise ConfigError(f"trainer.accumulate_grad_batches={accumulate} does not divide the per-process batch "
                          f"of {per_process}; pick a divisor of it.")
    return per_process // accumulate


class TrainStep:
    """``step(x, y, index, where)``: one optimizer step over a batch; ``evaluate(batches)``: one pass."""

    def __init__(self, cfg: DictConfig, env: Environment, model: nn.Module, optimizer: torch.optim.Optimizer,
                 nonfinite: NonFiniteGuard, oom: OOMRecovery, logger):
        self.env, self.optimizer, self.nonfinite, self.oom, self.logger = env, optimizer, nonfinite, oom, logger
        self.model = model  # the wrapped model: under ddp a failed step may wrap it anew (after_failed_step)
        self.parameters = list(model.parameters())  # listed once: walking the modules costs more than the norm
        self.precision = Precision(str(cfg.trainer.precision), env.device)
        self.clip = cfg.trainer.gradient_clip_val
        self.configured_sizes = configured_micro_batch(cfg, env.world_size), cfg.data.eval_batch_size
        self.micro_batch, self.eval_batch_size = self.configured_sizes

    @classmethod
    def of(cls, cfg: DictConfig, env: Environment, setup, nonfinite: NonFiniteGuard, logger) -> "TrainStep":
        """The step for a ``trainer.Setup``: its model and optimizer, with out-of-memory recovery as configured."""
        oom = OOMRecovery(cfg.troubleshoot, env, setup.model, setup.optimizer, setup.spec, setup.data.input_shape)
        return cls(cfg, env, setup.model, setup.optimizer, nonfinite, oom, logger)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, index: int, where: str) -> Optional[torch.Tensor]:
        """Optimizer step ``index`` (0-based) over the batch; returns its mean loss (detached), or None when
        the step was not finite and skipped. ``where`` names the step in messages."""
        while (loss := self.gradients(x, y, index)) is None:
            pass  # a process ran out of memory: every one backed off, and the same step is tried again
        grad_norm = self.unscaled_grad_norm()
        applied = self.nonfinite.step_is_finite(loss, grad_norm, where, self.lr)
        if applied:
            self.precision.scaler.step(self.optimizer)
        self.precision.scaler.update()
        return loss if applied else None

    def gradients(self, x: torch.Tensor, y: torch.Tensor, index: int) -> Optional[torch.Tensor]:
        """The batch's gradients in place and its mean loss, or None when some process ran out of memory
        (then all of them have freed the attempt and halved the micro-batch)."""
        loss = self.oom.attempt(self.accumulate_gradients, x, y)
        if loss is None:  # free what the attempt held before joining the other processes' collectives
            self.oom.free(drop_gradients=True)
        ran_out = self.env.processes_out_of_memory(self.model, ran_out=loss is None)
        if not ran_out:
            return loss
        if loss is not None:  # another process ran out: this one drops its finished attempt too
            self.oom.free(drop_gradients=True)
        self.model = self.env.after_failed_step(self.model)
        self.micro_batch = self.oom.back_off(self.micro_batch, len(y), index, ran_out, self.logger)
        return None

    def accumulate_gradients(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the batch in micro-batches; returns the batch's mean loss (detached)."""
        self.optimizer.zero_grad(set_to_none=True)
        batch_loss = None
        # A batch that is one micro-batch is not split: each split is an op, and a small model's step is a few.
        micro_batches = zip(x.split(self.micro_batch), y.split(self.micro_batch)) if len(y) > self.micro_batch else [(x, y)]
        last = math.ceil(len(y) / self.micro_batch) - 1
        for i, (xs, ys) in enumerate(micro_batches):
            # Gradients accumulate locally until the last micro-batch, whose backward synchronises
            # them across processes (under ddp: bucket by bucket, overlapped with that backward).
            with self.env.no_sync(self.model) if i < last else contextlib.nullcontext():
                with self.precision.autocast():
                    loss = F.cross_entropy(self.model(xs), ys)
                # Weight each micro-batch by its share, so the gradient equals the full batch's
                # (a whole batch skips the multiplication: a small model's step is a few ops).
                if last:
                    loss = loss * (len(ys) / len(y))
                self.precision.scaler.scale(loss).backward()
            batch_loss = loss.detach() if batch_loss is None else batch_loss + loss.detach()
        return batch_loss

    def unscaled_grad_norm(self) -> torch.Tensor:
        """The gradients' total norm (clipped to trainer.gradient_clip_val when set), as a tensor: no host sync."""
        self.precision.scaler.unscale_(self.optimizer)
        parameters = [p for p in self.parameters if p.grad is not None]
        if self.clip:
            return torch.nn.utils.clip_grad_norm_(parameters, self.clip)
        return torch.nn.utils.get_total_norm([p.grad for p in parameters])

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def evaluate(self, batches, index: int = 0) -> Dict[str, float]:
        """Mean loss and accuracy over a split, summed across processes; no graph is built.

        If any process runs out of memory, all of them halve the eval batch and redo the pass:
        the out-of-memory flag rides on the all-reduce of the totals, so it costs no collective.
        """
        while True:
            batches.plan.batch_size = self.eval_batch_size
            totals = self.oom.attempt(eval_totals, self.model, batches, self.env, self.precision)
            if totals is None:  # ran out of memory here: tell the others through the flag
                self.oom.free(drop_gradients=False)
                totals = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64, device=self.env.output_device)
            totals = self.env.all_reduce_sum(totals)
            if not totals[3]:
                return summarize(totals)
            self.eval_batch_size = self.oom.back_off_eval(self.eval_batch_size, index, int(totals[3]), self.logger)

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
