"""What runlab does with a batch without looking inside it.

A batch is whatever the data's ``collate`` makes: a tensor, or a tuple, list, dict or dataclass
of them, nested as deep as the user likes. runlab moves every tensor in it to the device,
counts its samples by the first tensor's first dimension, and cuts it into micro-batches
(gradient accumulation, the out-of-memory back-off) by splitting every tensor along that
dimension. Leaves that are not tensors (a list of file names, a flag) travel whole. How a
batch becomes a loss is the objective's business (objective.py), never the loop's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import torch


def apply(batch: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``function`` applied to each tensor in it, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, dict):
        return type(batch)((key, apply(value, function)) for key, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(apply(value, function) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(apply(value, function) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: apply(getattr(batch, f.name), function)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def tensors(batch: Any) -> List[torch.Tensor]:
    """Every tensor in ``batch``, in order."""
    found: List[torch.Tensor] = []
    apply(batch, found.append)
    return found


def first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    if type(batch) is tuple and len(batch) and isinstance(batch[0], torch.Tensor):
        return batch[0]  # the common (inputs, target) pair, without walking it
    found = tensors(batch)
    return found[0] if found else None


def size(batch: Any) -> int:
    """How many samples the batch holds: its first tensor's first dimension."""
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise TypeError(f"a batch must hold at least one tensor with a batch dimension; got {type(batch).__name__}")
    return tensor.shape[0]


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch on ``device`` (copies are asynchronous from pinned memory)."""
    if type(batch) is tuple and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)  # the common pair, fast
    return apply(batch, lambda tensor: tensor.to(device, non_blocking=True))


def split(batch: Any, micro_batch: int) -> List[Any]:
    """The batch cut into micro-batches of ``micro_batch`` samples (the last may be smaller)."""
    count = -(-size(batch) // micro_batch)
    parts = [[] for _ in range(count)]

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        for part, piece in zip(parts, tensor.split(micro_batch)):
            part.append(piece)
        return tensor

    apply(batch, cut)
    pieces = [iter(part) for part in parts]
    return [apply(batch, lambda _tensor, it=it: next(it)) for it in pieces]
