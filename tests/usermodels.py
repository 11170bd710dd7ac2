"""A user's own model, outside the framework, for the `model._target_=...` tests."""
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, num_classes: int, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)
