"""TPE sweeps with the median pruner vs the same sweeps without, side by side in one run.

    PYTHONPATH=$PWD python benchmarks/pruning.py [--trials 20] [--epochs 10] [--seeds 0 1 2 3 4]

The pruner runs with its shipped settings (hydra/sweeper/pruner=median: 3 startup trials, pruning
from the first epoch). Each pair of sweeps searches the shipped space (search=tpe) on the digits
MLP with the same seed and early stopping off, so pruning is the only thing that ends a trial
early. How much a pruner saves, and whether the best trial survives, depends on what the sampler
happens to try, so the pair runs for several seeds. Prints, per seed and over all seeds, the ratio
of training epochs spent (target <= 0.6x) and how far the pruned sweeps' best values are from the
unpruned ones' (target: within 1%).
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


def relative_gap(value: float, reference: float) -> float:
    return (value - reference) / reference


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    epochs = {"unpruned": 0, "pruned": 0}
    bests = {"unpruned": [], "pruned": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            output = Path(tmp) / f"seed{seed}"
            full_epochs, full_best = sweep("unpruned", output, args.trials, args.epochs, [f"seed={seed}"])
            pruned_epochs, pruned_best = sweep("pruned", output, args.trials, args.epochs,
                                               [f"seed={seed}", "hydra/sweeper/pruner=median"])
            epochs["unpruned"] += full_epochs
            epochs["pruned"] += pruned_epochs
            bests["unpruned"].append(full_best)
            bests["pruned"].append(pruned_best)
            print(f"seed {seed}: without pruning {full_epochs} epochs, best {full_best:.4f}; median pruner "
                  f"{pruned_epochs} epochs, best {pruned_best:.4f}; epochs ratio {pruned_epochs / full_epochs:.2f}x, "
                  f"best {relative_gap(pruned_best, full_best):+.2%}", flush=True)
    gaps = [relative_gap(pruned, full) for pruned, full in zip(bests["pruned"], bests["unpruned"])]
    mean = {name: sum(values) / len(values) for name, values in bests.items()}
    print(f"{len(args.seeds)} pairs of {args.trials}-trial TPE sweeps of {args.epochs} epochs: epochs ratio "
          f"{epochs['pruned'] / epochs['unpruned']:.2f}x over all seeds (target <= 0.6x); mean best "
          f"{mean['pruned']:.4f} pruned against {mean['unpruned']:.4f}, "
          f"{relative_gap(mean['pruned'], mean['unpruned']):+.2%} (target within 1%); per seed from "
          f"{min(gaps):+.2%} to {max(gaps):+.2%}")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
