"""The same experiment under every parallel mode this machine offers, side by side.

    PYTHONPATH=$PWD python benchmarks/parallel_modes.py [--steps 30]

Each mode runs in a fresh process (so peak memory is its own): a 4-layer MLP of width 2304
(16.5M parameters) on synthetic data, global batch 256. The first table gives training
throughput, time per optimizer step, peak memory per process (RSS) or per GPU, and the
throughput relative to parallel=none and to ddp. The second gives what rank 0 holds once it has
trained: the storage bytes of its parameters, gradients and optimizer state (AdamW: two
moments per parameter). ddp replicates all three on every process; fsdp keeps 1/world_size.

On a CPU-only machine every mode shares the same cores and none adds compute, so the table
shows what the mechanics cost or how the cores get split, not a parallel speed-up (that
needs one device per process or stage). Process start-up is excluded; the gradient
all-reduce, the micro-batch pipeline and DataParallel's scatter/gather are included.
"""
from __future__ import annotations

import argparse
import contextlib
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
              "data.test_fraction=0.05", "model=mlp", "model.width=2304", "model.depth=4", "batch_size=256",
              "trainer.max_epochs=1", "trainer.progress_bar=false", "trainer.test_after_fit=false",
              "logger=none", "checkpoint.enabled=false", "early_stopping.enabled=false"]


def available_modes() -> Dict[str, List[str]]:
    """Each mode's overrides on this machine: every GPU when there are several, else two CPU workers/stages."""
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        return {"none": [], "dp": ["parallel=dp"], f"ddp x{gpus}": ["parallel=ddp"], f"fsdp x{gpus}": ["parallel=fsdp"],
                f"model x{gpus}": ["parallel=model", "parallel.microbatches=4"]}
    device = "device=cuda" if gpus else "device=cpu"
    modes = {"none": [device], "ddp x2": [device, "parallel=ddp", "parallel.world_size=2"],
             "fsdp x2": [device, "parallel=fsdp", "parallel.world_size=2"],
             "model x2 (cpu,cpu)": ["parallel=model", "parallel.devices=[cpu,cpu]", "parallel.microbatches=4"]}
    if gpus == 0:
        modes["dp (cpu: unwrapped)"] = ["device=cpu", "parallel=dp"]
    return modes


def storage_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """The bytes this process's parameters, gradients and optimizer state take: the storages
    behind them (a sharded tensor's local shard), each counted once."""
    def total(tensors) -> int:
        storages = {}
        for tensor in tensors:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return sum(storages.values())

    parameters = list(model.parameters())
    state = [value for per_parameter in optimizer.state.values() for value in per_parameter.values()
             if torch.is_tensor(value)]
    return {"parameters": total(parameters), "gradients": total(p.grad for p in parameters if p.grad is not None),
            "optimizer state": total(state)}


def trained_state_bytes(cfg, run_dir: Path, env) -> Dict[str, object]:
    """A task for ``framework.parallel.launch``: train as ``python run.py`` does, then return
    the metrics and what this process holds (rank 0's result is the one returned)."""
    from framework.trainer import Trainer

    Path(run_dir).mkdir(parents=True, exist_ok=True)  # as framework.run makes it
    trainer = Trainer(cfg, run_dir, env)
    try:
        return {"metrics": trainer.fit(), "bytes": storage_bytes(trainer.model, trainer.optimizer)}
    finally:
        trainer.close()


def measure_one(overrides: List[str], steps: int) -> Dict[str, object]:
    """Runs in its own process: train, then report throughput, rank 0's state bytes and this process tree's
    peak memory."""
    from framework import parallel
    from framework.entry import resolved_run_config

    with tempfile.TemporaryDirectory() as scratch:
        cfg = resolved_run_config([*EXPERIMENT, f"trainer.max_steps={steps}", f"paths.output_dir={scratch}", *overrides])
        result = parallel.launch(trained_state_bytes, cfg, Path(scratch) / "run")
    metrics = result["metrics"]
    memory = {"this process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if children:
        memory["largest worker"] = children
    for index in range(torch.cuda.device_count()):
        memory[f"cuda:{index}"] = torch.cuda.max_memory_allocated(index) / 2**20
    return {"samples_per_second": metrics["samples_per_second"], "step_ms": 1000 * metrics["train_seconds"] / metrics["step"],
            "memory_mb": memory, "bytes": result["bytes"]}


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
    ddp = next((result["samples_per_second"] for mode, result in results.items() if mode.startswith("ddp")), None)
    lines = ["| mode | samples/s | step time (ms) | peak memory (MB) | samples/s vs none | steps/s vs ddp |",
             "|---|---:|---:|---|---:|---:|"]
    for mode, result in results.items():
        memory = ", ".join(f"{name} {mb:,.0f}" for name, mb in result["memory_mb"].items())
        lines.append(f"| {mode} | {result['samples_per_second']:,.0f} | {result['step_ms']:.1f} | {memory} "
                     f"| {result['samples_per_second'] / base:.2f} | {result['samples_per_second'] / ddp:.2f} |")
    return "\n".join(lines)


def bytes_table(results: Dict[str, Dict[str, object]]) -> str:
    kinds = list(results["none"]["bytes"])
    lines = [f"| mode (rank 0) | {' | '.join(f'{kind} (MB)' for kind in kinds)} | total (MB) | total vs ddp |",
             "|---|" + "---:|" * (len(kinds) + 2)]
    ddp = next(sum(result["bytes"].values()) for mode, result in results.items() if mode.startswith("ddp"))
    for mode, result in results.items():
        total = sum(result["bytes"].values())
        cells = " | ".join(f"{result['bytes'][kind] / 2**20:,.1f}" for kind in kinds)
        lines.append(f"| {mode} | {cells} | {total / 2**20:,.1f} | {total / ddp:.2f} |")
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
    print(f"parallel modes on {machine}: MLP 256-2304x4-10 (16.5M parameters), global batch 256, "
          f"{args.steps} steps per mode, "
          f"median of {args.repeats} interleaved run(s)\n")
    modes = available_modes()
    # Round-robin, so a burst of load elsewhere on the machine hits every mode alike.
    runs = [{mode: run_mode(overrides, args.steps) for mode, overrides in modes.items()} for _ in range(args.repeats)]
    results = {mode: median_run([r[mode] for r in runs]) for mode in modes}
    print(table(results))
    print("\nWhat rank 0 holds after training (storage bytes):\n")
    print(bytes_table(results))
    if gpus < 2:
        print("\nWith fewer than 2 GPUs every mode runs on the same cores and none adds compute, so this is not a "
              "parallel speed-up. ddp compares 2 processes of half the threads each (plus a gradient all-reduce per "
              "step) with 1 process using all threads; fsdp does the same with a gather of each block's parameters "
              "in forward and backward and a reduce-scatter of its gradients instead of the all-reduce; model runs "
              "its micro-batches through the stages one after another; dp runs unwrapped. Load from other programs on the machine skews all of them. A speed-up "
              "needs one device per ddp process or pipeline stage.")


if __name__ == "__main__":
    from results import recorded

    # A mode's own process (--one) answers its parent on its last line; only the parent's tables are recorded.
    with recorded() if "--one" not in sys.argv else contextlib.nullcontext():
        main()
