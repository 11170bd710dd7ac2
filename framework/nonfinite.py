"""trainer.on_nonfinite: what a step with a nan or inf in its loss or gradients does.

- ``stop`` (default): the step is not applied, and the run ends with ``DivergedError`` (exit
  code 3). Nothing after the last finite epoch is written, so ``last.pt`` and ``best.pt``
  hold the last finite state.
- ``skip``: the step is not applied (its gradients are dropped), training goes on, and
  ``metrics.json`` counts the skipped steps.

The decision reads the gradients after DDP has averaged them, so every rank skips the same
steps. Under fp16 the GradScaler already skips steps whose scaled gradients
overflowed (that is how it finds its scale), so there only the loss is checked. A
non-finite validation metric means the weights themselves are broken: it stops the run in
either mode.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Callable, Dict, Iterable, List

import torch

from framework.errors import DivergedError

log = logging.getLogger(__name__)

MODES = ("stop", "skip")


class GradientCheck:
    """Whether a loss or any gradient holds a nan or inf: one pass over the gradients and one
    host sync per device, where a gradient norm would read them, square them and reduce them.

    The pass is the fused kernel torch's GradScaler runs on every fp16 step (a private op, pinned
    by tests/test_training.py), given a scale of 1, which leaves every value as it is.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.parameters: Dict[torch.device, List[torch.nn.Parameter]] = defaultdict(list)
        for parameter in parameters:
            self.parameters[parameter.device].append(parameter)
        # Per device: the flag the kernel sets (it never clears it) and the scale it multiplies by.
        self.flags: Dict[torch.device, tuple] = {}

    def nonfinite(self, loss: torch.Tensor) -> bool:
        tensors = {device: [p.grad for p in group if p.grad is not None] for device, group in self.parameters.items()}
        tensors.setdefault(loss.device, []).append(loss.detach())
        for device, group in tensors.items():
            if device not in self.flags:
                self.flags[device] = torch.zeros(1, device=device), torch.ones(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, *self.flags[device])
        found = [flag for flag, _ in self.flags.values() if flag.item()]
        for flag in found:
            flag.zero_()
        return bool(found)

    def norm(self) -> float:
        """The gradients' total norm, for a message."""
        grads = [p.grad for group in self.parameters.values() for p in group if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).item() if grads else 0.0


class NonFiniteGuard:
    def __init__(self, mode: str, precision: str, kept: Callable[[], str]):
        self.mode, self.precision = mode, precision
        self.kept = kept  # what the run's checkpoints hold, for the message
        self.skipped = 0

    def step_is_finite(self, loss: torch.Tensor, gradients: GradientCheck, where: str, lr: float) -> bool:
        """Whether to apply this step; raises ``DivergedError`` when it is not finite and the mode is stop."""
        if self.precision == "fp16":
            finite = math.isfinite(loss.item())  # the GradScaler checks the gradients itself
        else:
            finite = not gradients.nonfinite(loss)
        if finite:
            return True
        values = f"loss {loss.item():.4g}, gradient norm {gradients.norm():.4g}"
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
