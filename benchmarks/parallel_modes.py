"""The same experiment under every parallel mode this machine offers, side by side.

    PYTHONPATH=$PWD python benchmarks/parallel_modes.py [--steps 30]

Each mode runs in a fresh process (so peak memory is its own): a 4-layer MLP of width 1024
on synthetic data, global batch 256. The table gives training throughput, time per optimizer
step, peak memory per process (RSS) or per GPU, and the throughput relative to parallel=none.

On a CPU-only machine every mode shares the same cores and none adds compute, so the table
shows what the mechanics cost or how the cores get split, not a parallel speed-up (that
needs one device per process or stage). Process start-up is excluded; the gradient
all-reduce, the micro-batch pipeline and DataParallel's scatter/gather are included.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch

REPO = Path(__file__).resolve().parent.parent
EXPERIMENT = ["data=synthetic", "data.num_samples=16384", "data.input_shape=[256]", "data.val_fraction=0.05",
              "data.test_fraction=0.05", "model=mlp", "model.width=1024", "model.depth=4", "batch_size=256",
              "trainer.max_epochs=1", "trainer.progress_bar=false", "trainer.test_after_fit=false",
              "logger=none", "checkpoint.enabled=false", "early_stopping.enabled=false"]


def available_modes() -> Dict[str, List[str]]:
    """Each mode's overrides on this machine: every GPU when there are several, else two CPU workers/stages."""
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        return {"none": [], "dp": ["parallel=dp"], f"ddp x{gpus}": ["parallel=ddp"],
                f"model x{gpus}": ["parallel=model", "parallel.microbatches=4"]}
    device = "device=cuda" if gpus else "device=cpu"
    modes = {"none": [device], "ddp x2": [device, "parallel=ddp", "parallel.world_size=2"],
             "model x2 (cpu,cpu)": ["parallel=model", "parallel.devices=[cpu,cpu]", "parallel.microbatches=4"]}
    if gpus == 0:
        modes["dp (cpu: unwrapped)"] = ["device=cpu", "parallel=dp"]
    return modes


def measure_one(overrides: List[str], steps: int) -> Dict[str, object]:
    """Runs in its own process: train, then report throughput and this process tree's peak memory."""
    from framework import run

    with tempfile.TemporaryDirectory() as scratch:
        metrics = run([*EXPERIMENT, f"trainer.max_steps={steps}", f"paths.output_dir={scratch}", *overrides],
                      run_dir=f"{scratch}/run")
    memory = {"this process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if children:
        memory["largest ddp process"] = children
    for index in range(torch.cuda.device_count()):
        memory[f"cuda:{index}"] = torch.cuda.max_memory_allocated(index) / 2**20
    return {"samples_per_second": metrics["samples_per_second"], "step_ms": 1000 * metrics["train_seconds"] / metrics["step"],
            "memory_mb": memory}


def run_mode(overrides: List[str], steps: int) -> Dict[str, object]:
    command = [sys.executable, __file__, "--one", json.dumps(overrides), "--steps", str(steps)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_run(runs: List[Dict[str, object]]) -> Dict[str, object]:
    return sorted(runs, key=lambda r: r["samples_per_second"])[len(runs) // 2]


def table(results: Dict[str, Dict[str, object]]) -> str:
    base = results["none"]["samples_per_second"]
    lines = ["| mode | samples/s | step time (ms) | peak memory (MB) | samples/s vs none |", "|---|---:|---:|---|---:|"]
    for mode, result in results.items():
        memory = ", ".join(f"{name} {mb:,.0f}" for name, mb in result["memory_mb"].items())
        lines.append(f"| {mode} | {result['samples_per_second']:,.0f} | {result['step_ms']:.1f} | {memory} "
                     f"| {result['samples_per_second'] / base:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per mode")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved; the median is shown")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: the overrides of one mode, as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(json.loads(args.one), args.steps)))
        return
    gpus = torch.cuda.device_count()
    machine = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else f"CPU only ({torch.get_num_threads()} threads)"
    print(f"parallel modes on {machine}: MLP 256-1024x4-10, global batch 256, {args.steps} steps per mode, "
          f"median of {args.repeats} interleaved run(s)\n")
    modes = available_modes()
    # Round-robin, so a burst of load elsewhere on the machine hits every mode alike.
    runs = [{mode: run_mode(overrides, args.steps) for mode, overrides in modes.items()} for _ in range(args.repeats)]
    results = {mode: median_run([r[mode] for r in runs]) for mode in modes}
    print(table(results))
    if gpus < 2:
        print("\nWith fewer than 2 GPUs every mode runs on the same cores and none adds compute, so this is not a "
              "parallel speed-up. ddp compares 2 processes of half the threads each (plus a gradient all-reduce per "
              "step) with 1 process using all threads; model runs its micro-batches through the stages one after "
              "another; dp runs unwrapped. Load from other programs on the machine skews all of them. A speed-up "
              "needs one device per ddp process or pipeline stage.")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
