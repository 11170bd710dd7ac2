"""Models for tests/test_parallel.py that no shipped model can stand in for."""
from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import nn

from framework.model import MLP


class CrashingMLP(MLP):
    """The shipped MLP, except that rank 1 of a ddp run dies on its third training step.

    Rank 0 is then waiting in the gradient all-reduce: the job must still end, with the error shown.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, crash: str = "raise", **mlp):
        super().__init__(input_shape, num_classes, **mlp)  # model=mlp's keys
        self.crash, self.calls = crash, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and os.environ.get("RANK") == "1":
            self.calls += 1
            if self.calls == 3 and self.crash == "exit":
                os._exit(3)  # no Python exception, no traceback: as if the process were killed
            if self.calls == 3:
                raise RuntimeError("rank 1 crashed on purpose at its third step")
        return super().forward(x)


class TwoBranch(nn.Module):
    """A model whose forward is not a chain of its children, so it cannot be cut into stages."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, width: int = 32, **_unused):
        super().__init__()
        features = int(torch.tensor(input_shape).prod())
        self.left, self.right = nn.Linear(features, num_classes), nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.left(x) + self.right(x)
