"""Noisy sine waves, made on the fly: a map-style Dataset whose samples are dicts."""
import math

import torch
from torch.utils.data import Dataset

from framework.data import DataBundle


class NoisyWaves(Dataset):
    """Sample i: {"input": a (1, length) wave with noise, "target": [frequency, amplitude]}.

    Each sample is drawn from a generator seeded by (seed, i), so it is the same in every epoch,
    in every DataLoader worker and after a resume.
    """

    def __init__(self, num_samples: int, length: int, noise: float, seed: int):
        self.num_samples, self.length, self.noise, self.seed = num_samples, length, noise, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        frequency, amplitude, phase = torch.rand(3, generator=generator) * torch.tensor([4.0, 1.5, 2 * math.pi])
        frequency, amplitude = frequency + 1.0, amplitude + 0.5
        t = torch.linspace(0, 1, self.length)
        wave = amplitude * torch.sin(2 * math.pi * frequency * t + phase)
        wave = wave + self.noise * torch.randn(self.length, generator=generator)
        return {"input": wave[None], "target": torch.stack([frequency, amplitude])}


def make_waves(num_samples: int, length: int, noise: float, seed: int) -> DataBundle:
    """runlab calls this with data.* (conf/data/waves.yaml): train, val and test, from disjoint seeds."""
    splits = [NoisyWaves(n, length, noise, seed + offset)
              for offset, n in enumerate((num_samples, num_samples // 5, num_samples // 5))]
    return DataBundle(*splits, output_size=2)
