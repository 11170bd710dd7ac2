"""What this process runs on: versions, devices and the GPUs' own view of their load (GPUtil).

GPUtil shells out to nvidia-smi; without a GPU, without nvidia-smi, or without GPUtil
itself, the status is one line saying so, never an exception.
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Any, Dict, List, Tuple

import torch

MB = 2**20


def _read_gpus() -> Tuple[List[Dict[str, Any]], str]:
    """GPUtil's utilization and memory table, one dict per GPU, or [] and why there is none."""
    try:
        import GPUtil
    except Exception as error:  # not installed, or its own imports (distutils) missing
        return [], f"GPUtil cannot be imported ({type(error).__name__})"
    try:
        gpus = GPUtil.getGPUs()
    except Exception as error:  # nvidia-smi missing or failing
        return [], f"GPUtil could not run nvidia-smi ({type(error).__name__}: {error})"
    if not gpus:
        return [], "GPUtil found no NVIDIA GPU (or no nvidia-smi)"
    return [{"id": gpu.id, "name": gpu.name, "load_percent": round(100 * gpu.load, 1),
             "memory_used_mb": gpu.memoryUsed, "memory_total_mb": gpu.memoryTotal,
             "memory_percent": round(100 * gpu.memoryUtil, 1)} for gpu in gpus], ""


def gpu_table() -> List[Dict[str, Any]]:
    return _read_gpus()[0]


def gpu_status() -> str:
    return _status_text(*_read_gpus())


def _status_text(table: List[Dict[str, Any]], reason: str) -> str:
    """GPUtil's table as text, or one line saying why there is no GPU to report on."""
    if not table:
        return f"no GPU status: {reason}."
    return "\n".join(f"GPU {g['id']} {g['name']}: load {g['load_percent']}%, memory {g['memory_used_mb']:.0f}"
                     f"/{g['memory_total_mb']:.0f} MB ({g['memory_percent']}%)" for g in table)


def cuda_devices() -> List[Dict[str, Any]]:
    devices = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        devices.append({"index": index, "name": properties.name, "total_mb": round(total / MB, 1),
                        "free_mb": round(free / MB, 1), "capability": f"{properties.major}.{properties.minor}"})
    return devices


def describe_environment() -> Dict[str, Any]:
    cuda = torch.cuda.is_available()
    table, reason = _read_gpus()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": cuda_devices() if cuda else [],  # with torch.cuda.mem_get_info's free/total
        "gpus": table,
        "gpu_status": _status_text(table, reason),
    }
