"""The user's model: a small 1-D convolutional network with two outputs."""
from torch import nn


class WaveNet(nn.Module):
    def __init__(self, channels: int, hidden: int, outputs: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(channels, 2 * channels, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(8), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(16 * channels, hidden), nn.ReLU(), nn.Linear(hidden, outputs))

    def forward(self, waves):
        return self.head(self.features(waves))
