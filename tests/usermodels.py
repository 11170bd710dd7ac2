"""A user's own model, outside the framework, for the `model._target_=...` tests (and a callback of their own)."""
import gc
import os

from hydra.experimental.callback import Callback
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, num_classes: int, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


class TorchvisionStyleNet(nn.Module):
    """Named as torchvision's ResNets name their parts (conv1, bn1, layer1, fc), with no head_name:
    a stand-in for another library's model where torchvision does not import."""

    def __init__(self, num_classes: int, input_shape):
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.layer1(self.bn1(self.conv1(x)).relu())
        return self.fc(self.pool(x).flatten(1))


class CollectorProbe(TinyNet):
    """TinyNet that notes, when the run builds it, whether the cyclic garbage collector runs and how many
    objects start-up froze (framework/startup.py): a line "pid enabled frozen model" in $COLLECTOR_PROBE."""

    def __init__(self, num_classes: int, hidden: int = 16):
        super().__init__(num_classes, hidden)
        note_collector("model")


class CollectorProbeAtSweepStart(Callback):
    """A Hydra callback noting the same when a sweep starts, before its first job: "pid enabled frozen sweep"."""

    def on_multirun_start(self, config, **kwargs) -> None:
        note_collector("sweep")


def note_collector(where: str) -> None:
    with open(os.environ["COLLECTOR_PROBE"], "a") as probe:
        probe.write(f"{os.getpid()} {gc.isenabled()} {gc.get_freeze_count()} {where}\n")
