"""A user's own data factories, outside the framework, for the `data=custom data._target_=...` tests."""
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from framework.data import DataBundle


def tagged_blobs(num_samples: int, labels: int, seed: int) -> DataBundle:
    """Multi-label data: each sample carries any subset of ``labels`` tags, and each tag shifts one
    input feature, so the tags are learnable (targets are 0/1 per tag)."""
    generator = torch.Generator().manual_seed(seed)
    target = (torch.rand(num_samples, labels, generator=generator) < 0.4).long()
    inputs = 3.0 * target.float() + torch.randn(num_samples, labels, generator=generator)
    cut = [int(num_samples * 0.7), int(num_samples * 0.85)]
    splits = [TensorDataset(inputs[a:b], target[a:b]) for a, b in zip([0, *cut], [*cut, num_samples])]
    return DataBundle(*splits, output_size=labels)


class Pairs(Dataset):
    """Map-style, sample i a dict {"input": features, "target": class}: not a TensorDataset."""

    def __init__(self, inputs: torch.Tensor, target: torch.Tensor):
        self.inputs, self.target = inputs, target

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int) -> dict:
        return {"input": self.inputs[i], "target": self.target[i]}


class Stream(IterableDataset):
    """An iterable dataset of (features, class); ``length`` None: it does not know its length."""

    def __init__(self, inputs: torch.Tensor, target: torch.Tensor, length):
        self.inputs, self.target, self.length = inputs, target, length

    def __iter__(self):
        return zip(self.inputs, self.target)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("a stream of unknown length")
        return self.length


def digits_as(kind: str, sized: bool = True) -> DataBundle:
    """The digits split as runlab splits them, served as ``kind``: "pairs" (dict samples) or "stream"."""
    from framework.data import digits

    bundle = digits(val_fraction=0.15, test_fraction=0.15, split_seed=0, train_per_class=0, classes=[], normalize=True)
    served = []
    for split in (bundle.train, bundle.val, bundle.test):
        inputs, target = split.tensors
        served.append(Pairs(inputs, target) if kind == "pairs" else Stream(inputs, target, len(target) if sized else None))
    return DataBundle(*served, classes=bundle.classes)


def as_pair(samples: list) -> tuple:
    """A collate of the user's own: dict samples into an (inputs, target) batch (counting its batches)."""
    as_pair.batches += 1
    return torch.stack([s["input"] for s in samples]), torch.stack([s["target"] for s in samples])


as_pair.batches = 0
