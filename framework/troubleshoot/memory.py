"""Measuring memory honestly on CUDA and on CPU, and watching it across epochs.

CUDA has exact counters (``memory_allocated``, ``max_memory_allocated``). On CPU the
process's resident set is read from /proc: ``VmHWM`` is its peak, and writing ``5`` to
/proc/self/clear_refs resets that peak to the current RSS, so a peak can be taken over one
step or one epoch rather than over the process's lifetime (``ru_maxrss`` never resets).
Bytes in use on the heap come from glibc's ``mallinfo2``, which, unlike RSS, drops when
tensors are freed: that is what the leak check follows.
"""
from __future__ import annotations

import ctypes
import logging
import resource
from typing import Dict, List, Optional, Tuple

import torch

log = logging.getLogger(__name__)

MB = 2**20


def _proc_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mb() -> float:
    kb = _proc_status_kb("VmRSS")
    return kb / 1024 if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark; False where it cannot be (then peaks are lifetime peaks)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def rss_peak_mb() -> float:
    kb = _proc_status_kb("VmHWM")
    return kb / 1024 if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_in_use_mb() -> Optional[float]:
    """Bytes malloc has handed out and not had back (all arenas plus mmapped blocks); None off glibc."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return (info.uordblks + info.hblkhd) / MB


def allocated_mb(device: torch.device) -> float:
    """Memory held right now: tensors on CUDA, heap bytes in use (else RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MB
    heap = heap_in_use_mb()
    return heap if heap is not None else rss_mb()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_rss_peak()


def peak_mb(device: torch.device) -> float:
    """The peak since the last ``reset_peak``: allocated tensors on CUDA, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return rss_peak_mb()


def peak_kind(device: torch.device) -> str:
    return "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process RSS peak (VmHWM)"


class MemoryTracker:
    """Each epoch's peak to the logger, the run's peak to metrics.json, one warning on steady growth.

    The loop calls ``end_epoch`` unconditionally; growth only counts while the batch shape
    (micro-batch and eval batch) stays the same, since a new shape legitimately moves the peak.
    """

    def __init__(self, device: torch.device, growth_epochs: int):
        self.device, self.growth_epochs = device, growth_epochs
        self.history: List[Tuple[Tuple[int, ...], float]] = []
        self.warned = False
        reset_peak(device)

    def end_epoch(self, logger, step: int, batch_shape: Tuple[int, ...]) -> float:
        peak = peak_mb(self.device)
        reset_peak(self.device)
        self.history.append((batch_shape, peak))
        logger.log_metrics({"memory/peak_mb": peak}, step)
        if not self.warned and self.grows_steadily():
            self.warned = True
            peaks = ", ".join(f"{mb:.1f}" for _, mb in self.history[-self.growth_epochs - 1:])
            log.warning("Peak memory rose for %d epochs in a row at the same batch shape (%s MB). Something keeps "
                        "memory across steps: a tensor kept with its graph (accumulate loss.item() or loss.detach()), "
                        "evaluation without torch.no_grad(), or references held in a Python list. "
                        "`python run.py task=doctor` runs a leak check.", self.growth_epochs, peaks)
        return peak

    def grows_steadily(self) -> bool:
        """True when each of the last ``growth_epochs`` epochs peaked over 1% above the one before, at one shape."""
        recent = self.history[-self.growth_epochs - 1:]
        if len(recent) <= self.growth_epochs or len({shape for shape, _ in recent}) > 1:
            return False
        return all(later > earlier * 1.01 for (_, earlier), (_, later) in zip(recent, recent[1:]))

    def summary(self) -> Dict[str, float]:
        return {"memory/peak_mb": max((mb for _, mb in self.history), default=0.0)}


# --- what the model needs ------------------------------------------------------------------

def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MB


def model_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, float]:
    """Parameter, gradient and optimizer-state sizes (the state exists after the first step)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "parameter_mb": round(tensor_mb(model.parameters()), 3),
            "gradient_mb": round(tensor_mb(trainable), 3),
            "optimizer_state_mb": round(tensor_mb(state), 3)}


def activation_mb_per_sample(spec: Dict, input_shape: Tuple[int, ...]) -> Optional[float]:
    """The outputs of every leaf module for one sample, from a forward pass on the meta device.

    No activation is allocated (the weights are built on the CPU, then moved to meta);
    autograd keeps roughly these tensors for the backward pass. None when the model cannot
    run on the meta device.
    """
    from framework.model import build_model

    total = 0

    def count(module, inputs, output):
        nonlocal total
        if torch.is_tensor(output):
            total += output.numel() * output.element_size()

    try:
        model = build_model(spec).to("meta")
        for module in model.modules():
            if not list(module.children()):
                module.register_forward_hook(count)
        model(torch.empty(2, *input_shape, device="meta"))  # two samples: batch norm refuses one in training mode
    except Exception:
        return None
    return total / 2 / MB
