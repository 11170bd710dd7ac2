"""A TPE sweep with the median pruner vs the same sweep without, side by side in one run.

    PYTHONPATH=$PWD python benchmarks/pruning.py [--trials 20] [--epochs 10]

The pruner runs with its shipped settings (conf: hydra/sweeper/pruner=median: 4 startup trials,
1 warm-up epoch). Both sweeps search the shipped space (search=tpe, seeded) on the digits MLP with early
stopping off, so pruning is the only thing that ends a trial early. Prints the ratio of
training epochs spent (target <= 0.6x) and both best values (target: within 1%).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Tuple

REPO = Path(__file__).resolve().parent.parent


def sweep(name: str, output: Path, trials: int, epochs: int, extra: list) -> Tuple[int, float]:
    """(training epochs spent, best val/acc) of one sweep."""
    command = [sys.executable, "run.py", "search=tpe", f"hydra.sweeper.n_trials={trials}",
               f"hydra.sweeper.study_name={name}", f"paths.output_dir={output}",
               f"hydra.sweeper.export_dir={output / 'experiments'}", f"trainer.max_epochs={epochs}",
               "early_stopping.enabled=false", "logger=csv", "trainer.progress_bar=false", *extra]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    runs = [json.loads(p.read_text()) for p in (output / "train" / "multirun" / name).glob("*/metrics.json")]
    assert len(runs) == trials, f"{name}: {len(runs)} of {trials} trials finished"
    # A pruned trial returns its last epoch's value; the best of the sweep is over complete ones
    # too, so compare the best val/acc any trial reached at its end.
    return sum(int(run["epoch"]) for run in runs), max(run["val/acc"] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp)
        full_epochs, full_best = sweep("unpruned", output, args.trials, args.epochs, [])
        pruned_epochs, pruned_best = sweep("pruned", output, args.trials, args.epochs,
                                           ["hydra/sweeper/pruner=median"])
    print(f"{args.trials}-trial TPE sweeps of {args.epochs} epochs: without pruning {full_epochs} epochs, best "
          f"{full_best:.4f}; median pruner {pruned_epochs} epochs, best {pruned_best:.4f}; epochs ratio "
          f"{pruned_epochs / full_epochs:.2f}x (target <= 0.6x), best differs by "
          f"{abs(pruned_best - full_best) / full_best:.2%} (target <= 1%)")


if __name__ == "__main__":
    main()
