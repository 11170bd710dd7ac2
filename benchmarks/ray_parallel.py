"""Ray-parallel trials vs the same trials one after another, side by side in one run.

    PYTHONPATH=$PWD python benchmarks/ray_parallel.py [--trials 4] [--cpus 2] [--epochs 48]

Both sweeps run the same 4 CPU-bound trials (a synthetic MLP problem; only lr varies) with
torch on one thread per trial, so the comparison is honest: the sequential sweep uses one
core, the Ray sweep runs `--cpus` trials at a time. Early stopping is off, so the trials are
equally long and the ratio measures parallelism, not how the trials happen to pack onto the
slots. Wall times include Ray's start-up and shutdown. Target: ratio <= 0.6.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Tuple

REPO = Path(__file__).resolve().parent.parent
EXPERIMENT = ["experiment=synthetic_mlp", "data.num_samples=32768", "batch_size=256",
              "model.width=512", "model.depth=3", "optimizer.weight_decay=0.01", "logger=csv",
              "trainer.progress_bar=false", "search.num_threads=1", "early_stopping.enabled=false"]


def timed_sweep(name: str, output: Path, trials: int, epochs: int, extra: list) -> Tuple[float, float]:
    """(wall seconds of the sweep, mean training seconds of its trials)."""
    command = [sys.executable, "run.py", "search=random", f"hydra.sweeper.n_trials={trials}", f"trainer.max_epochs={epochs}",
               f"hydra.sweeper.study_name={name}", f"paths.output_dir={output}",
               f"hydra.sweeper.export_dir={output / 'experiments'}", *EXPERIMENT, *extra]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    runs = [json.loads(p.read_text()) for p in (output / "synthetic_mlp" / "multirun" / name).glob("*/metrics.json")]
    assert len(runs) == trials, f"{name}: {len(runs)} of {trials} trials finished"
    return seconds, sum(run["train_seconds"] for run in runs) / trials


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--cpus", type=int, default=2)
    # Ray costs ~15 s here once per sweep (start ~5 s, each worker's first trial importing torch
    # and the framework ~6 s, stop ~1.5 s), so it pays off for trials of a minute or more.
    parser.add_argument("--epochs", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp)
        sequential, sequential_trial = timed_sweep("sequential", output, args.trials, args.epochs, [])
        ray, ray_trial = timed_sweep("ray", output, args.trials, args.epochs, ["launcher=ray_local", f"hydra.sweeper.n_jobs={args.trials}",
                                                       f"+hydra.launcher.ray.init.num_cpus={args.cpus}"])
    print(f"{args.trials} trials of {args.epochs} epochs, torch on 1 thread each: sequential {sequential:.1f} s, "
          f"Ray on {args.cpus} CPUs {ray:.1f} s, ratio {ray / sequential:.2f}x (target <= 0.6x). Mean training "
          f"time per trial: {sequential_trial:.1f} s alone, {ray_trial:.1f} s beside another trial under Ray")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
