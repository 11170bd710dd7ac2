"""What this process runs on: versions, devices and the GPUs' own view of their load (GPUtil).

GPUtil shells out to nvidia-smi; without a GPU, without nvidia-smi, or without GPUtil
itself, the status is one line saying so, never an exception.
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Any, Dict, List

import torch

MB = 2**20


def gpu_table() -> List[Dict[str, Any]]:
    """GPUtil's utilization and memory table, one dict per GPU; [] when there is none to read."""
    try:
        import GPUtil

        gpus = GPUtil.getGPUs()
    except Exception:  # no GPUtil, no nvidia-smi, or nvidia-smi failing: all mean "no table"
        return []
    return [{"id": gpu.id, "name": gpu.name, "load_percent": round(100 * gpu.load, 1),
             "memory_used_mb": gpu.memoryUsed, "memory_total_mb": gpu.memoryTotal,
             "memory_percent": round(100 * gpu.memoryUtil, 1)} for gpu in gpus]


def gpu_status() -> str:
    """GPUtil's table as text, or one line when there is no GPU to report on."""
    table = gpu_table()
    if not table:
        return "no GPU status: GPUtil found no GPU (no NVIDIA GPU, no nvidia-smi, or GPUtil not installed)."
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
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": cuda_devices() if cuda else [],  # with torch.cuda.mem_get_info's free/total
        "gpus": gpu_table(),
        "gpu_status": gpu_status(),
    }
