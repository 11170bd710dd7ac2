"""A testing aid: an MLP that fails the way real runs fail, in chosen trials or steps.

    model._target_=faulty_model.FaultyMLP '+model.trial=${search.trial}' '+model.faults={1:raise,2:nan_loss,3:oom}'
    model._target_=faulty_model.FaultyMLP '+model.nan_at_steps=[3,7]'      NaN logits on those training steps
    model._target_=faulty_model.FaultyMLP '+model.nan_grad_at_steps=[3,7]' a finite loss, NaN gradients, on those steps
    model._target_=faulty_model.FaultyMLP +model.nan_in_eval=true          NaN logits in evaluation only

needs tests/ on PYTHONPATH. ``raise`` raises, ``nan_loss`` returns NaN logits (so the loss is
NaN), ``oom`` raises the RuntimeError that PyTorch's CPU allocator raises when memory runs out.
"""
from typing import Dict, Optional, Sequence

import torch

from framework.model import MLP

CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
           "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)")


class FaultyMLP(MLP):
    def __init__(self, input_shape: Sequence[int], num_classes: int, trial: int = -1,
                 faults: Optional[Dict[int, str]] = None, nan_at_steps: Sequence[int] = (), nan_in_eval: bool = False,
                 nan_grad_at_steps: Sequence[int] = (), **mlp_kwargs):
        super().__init__(input_shape, num_classes, **mlp_kwargs)
        self.fault = (faults or {}).get(trial, "none")
        self.nan_at_steps, self.nan_in_eval, self.training_steps = set(nan_at_steps), nan_in_eval, 0
        self.nan_grad_at_steps = set(nan_grad_at_steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fault == "raise":
            raise ValueError("a deliberately failing trial")
        if self.fault == "oom":
            raise RuntimeError(CPU_OOM)
        self.training_steps += self.training  # one forward per step: no accumulation in these tests
        logits = super().forward(x)
        nan = self.fault == "nan_loss" or (self.training and self.training_steps in self.nan_at_steps) or \
            (not self.training and self.nan_in_eval)
        if self.training and self.training_steps in self.nan_grad_at_steps:
            # sqrt's slope at 0 is infinite: the values stay as they are, the backward gives 0 * inf = NaN.
            return logits + 0 * torch.sqrt(logits - logits)
        return logits * float("nan") if nan else logits
