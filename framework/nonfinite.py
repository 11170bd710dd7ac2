"""trainer.on_nonfinite: what a step with a non-finite loss or gradient does.

- ``stop`` (default): the step is not applied, and the run ends with ``DivergedError`` (exit
  code 3). Nothing after the last finite epoch is written, so ``last.pt`` and ``best.pt``
  hold the last finite state.
- ``skip``: the step is not applied (its gradients are dropped), training goes on, and
  ``metrics.json`` counts the skipped steps.

The decision reads the gradients after DDP has averaged them, so every rank skips the same
steps. Under fp16 the GradScaler already skips steps whose scaled gradients overflowed (that
is how it finds its scale), so there only the loss is checked. A non-finite validation metric
means the weights themselves are broken: it stops the run in either mode.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch

from framework.errors import DivergedError

log = logging.getLogger(__name__)

MODES = ("stop", "skip")


class GradientCheck:
    """Whether a step's loss or any of its gradients is nan or inf, found by the fused kernel torch's
    GradScaler runs (once per device and dtype) with a scale of 1, which leaves every value as it
    is: each gradient is read once and nothing is reduced to a norm, which would cost a small
    model's step about 10 %."""

    def __init__(self, parameters: List[torch.nn.Parameter]):
        self.groups: Dict[tuple, List[torch.nn.Parameter]] = defaultdict(list)
        for parameter in parameters:
            self.groups[(parameter.device, parameter.dtype)].append(parameter)
        # The kernel only ever sets a flag: it is cleared after a step that raised it, not before every step.
        self.found: Dict[torch.device, torch.Tensor] = {}
        self.one: Dict[torch.device, torch.Tensor] = {}

    def nonfinite(self, loss: torch.Tensor) -> bool:
        """Whether ``loss`` or a gradient is not finite: the step's one host sync (per device)."""
        checked = {kind: [p.grad for p in group if p.grad is not None] for kind, group in self.groups.items()}
        checked.setdefault((loss.device, loss.dtype), []).append(loss)
        for (device, _), tensors in checked.items():
            if device not in self.found:
                self.found[device], self.one[device] = torch.zeros(1, device=device), torch.ones(1, device=device)
            if tensors:
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, self.found[device], self.one[device])
        if not any(flag.item() for flag in self.found.values()):
            return False
        for flag in self.found.values():
            flag.zero_()
        return True

    def norm(self) -> torch.Tensor:
        """The gradients' total norm, for a message."""
        return torch.nn.utils.get_total_norm([p.grad for group in self.groups.values() for p in group if p.grad is not None])


class NonFiniteGuard:
    def __init__(self, mode: str, precision: str, kept: Callable[[], str]):
        self.mode, self.precision = mode, precision
        self.kept = kept  # what the run's checkpoints hold, for the message
        self.skipped = 0

    def step_is_finite(self, loss: torch.Tensor, gradients: GradientCheck, clipped_norm: Optional[torch.Tensor],
                       where: str, lr: float) -> bool:
        """Whether to apply this step; raises ``DivergedError`` when it is not finite and the mode is stop.
        ``clipped_norm`` is the gradient norm when clipping computed one: then it is the check."""
        if self.precision == "fp16":
            finite = bool(torch.isfinite(loss))
        elif clipped_norm is not None:
            finite = bool(torch.isfinite(loss + clipped_norm))
        else:
            finite = not gradients.nonfinite(loss)
        if finite:
            return True
        norm = gradients.norm() if clipped_norm is None else clipped_norm
        values = f"loss {loss.item():.4g}, gradient norm {norm.item():.4g}"
        if self.mode == "stop":
            raise DivergedError(self.diverged(where, values, lr))
        self.skipped += 1
        log.warning("Skipped %s: %s (trainer.on_nonfinite=skip; %d skipped so far).", where, values, self.skipped)
        return False

    def check_validation(self, metrics: Dict[str, float], where: str, lr: float) -> None:
        broken = [f"{name} {value}" for name, value in metrics.items() if not math.isfinite(value)]
        if broken:
            raise DivergedError(self.diverged(f"the validation after {where}", ", ".join(broken), lr))

    def diverged(self, where: str, values: str, lr: float) -> str:
        return (f"training diverged at {where}: {values}. Likely causes: a learning rate too high (lr {lr:g} at this "
                f"step) or an overflow in low precision (trainer.precision={self.precision}); lower lr, or set "
                f"trainer.gradient_clip_val=1.0 or trainer.on_nonfinite=skip. {self.kept()}")

    def summary(self) -> Dict[str, float]:
        return {"trainer/nonfinite_steps_skipped": self.skipped}
