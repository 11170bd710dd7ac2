"""trainer.on_nonfinite: what a step with a non-finite loss or gradient norm does.

- ``stop`` (default): the step is not applied, and the run ends with ``DivergedError`` (exit
  code 3). Nothing after the last finite epoch is written, so ``last.pt`` and ``best.pt``
  hold the last finite state.
- ``skip``: the step is not applied (its gradients are dropped), training goes on, and
  ``metrics.json`` counts the skipped steps.

The decision reads the gradient norm after DDP has averaged the gradients, so every rank
skips the same steps. Under fp16 the GradScaler already skips steps whose scaled gradients
overflowed (that is how it finds its scale), so there only the loss is checked. A
non-finite validation metric means the weights themselves are broken: it stops the run in
either mode.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Dict

import torch

from framework.errors import DivergedError

log = logging.getLogger(__name__)

MODES = ("stop", "skip")


class NonFiniteGuard:
    def __init__(self, mode: str, precision: str, kept: Callable[[], str]):
        self.mode, self.precision = mode, precision
        self.kept = kept  # what the run's checkpoints hold, for the message
        self.skipped = 0

    def step_is_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor, where: str, lr: float) -> bool:
        """Whether to apply this step; raises ``DivergedError`` when it is not finite and the mode is stop."""
        checked = loss if self.precision == "fp16" else loss + grad_norm  # one host sync for both
        if math.isfinite(checked.item()):
            return True
        values = f"loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g}"
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

    def caveat(self, steps_run: int) -> str:
        """What a run's last lines must say about its skipped steps, or ""."""
        if not self.skipped:
            return ""
        return (f"{self.skipped} of {steps_run} steps ({self.skipped / max(steps_run, 1):.0%}) were skipped as "
                "non-finite (trainer.on_nonfinite=skip); the weights learned only from the others.")

    def check_run(self, steps_run: int) -> None:
        """A run that skipped more than half its steps did not really train: it ends with DivergedError."""
        if self.skipped * 2 > steps_run:
            raise DivergedError(f"{self.caveat(steps_run)} With more than half skipped the result is not a trained "
                                f"model; lower lr, or set trainer.gradient_clip_val=1.0. {self.kept()}")
