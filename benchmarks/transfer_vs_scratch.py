"""What the shipped fine-tuning example gains over the same budget from scratch, seed by seed.

For each seed S, in one process and under a temporary output folder, the example's three
commands (experiments/digits_finetune.yaml's comment) with seed=S:

  pretrain   experiment=digits_pretrain seed=S (a small ResNet on the even digits, all labels)
  finetune   experiment=digits_finetune seed=S (the odd digits, 5 labels per class, from that run)
  scratch    experiment=digits_finetune seed=S finetune.from="" "finetune.freeze=[]"
             (the same ResNet, labels, steps and learning rate, from random weights)

Pretraining runs again for each seed: its seed decides the weights fine-tuning starts from, so
a single pretraining run would measure one lucky or unlucky start ten times. Prints a Markdown
table of both test accuracies (of each run's best checkpoint) per seed, their means, and the
number of seeds fine-tuning won.
Usage:  python benchmarks/transfer_vs_scratch.py [--seeds 0 1 ... 9] [--per-class N]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from statistics import mean
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import framework  # noqa: E402
from framework.entry import compose  # noqa: E402

QUIET = ["logger=none", "trainer.progress_bar=false"]
SCRATCH = ["finetune.from=", "finetune.freeze=[]"]


def one_seed(seed: int, budget: List[str], tmp: str) -> Tuple[float, float]:
    """(fine-tuned, scratch) test accuracy for one seed."""
    common = [*QUIET, f"seed={seed}", f"paths.output_dir={tmp}"]
    source = f"{tmp}/pretrain{seed}"
    framework.run(["experiment=digits_pretrain", *common], run_dir=source)
    tuned = framework.run(["experiment=digits_finetune", f"finetune.from={source}", *budget, *common],
                          run_dir=f"{tmp}/finetune{seed}")
    scratch = framework.run(["experiment=digits_finetune", *SCRATCH, *budget, *common], run_dir=f"{tmp}/scratch{seed}")
    return tuned.metrics["test/acc"], scratch.metrics["test/acc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--per-class", type=int, help="labelled training images per class (default: the experiment's)")
    args = parser.parse_args()
    budget = [f"data.train_per_class={args.per_class}", f"batch_size={5 * args.per_class}"] if args.per_class else []
    example = compose(["experiment=digits_finetune", *budget])
    logging.disable(logging.INFO)
    print(f"digits {list(example.data.classes)}, {example.data.train_per_class} labels per class, {example.trainer.max_epochs} steps, lr {example.lr:g}, "
          f"finetune.freeze={list(example.finetune.freeze)}; test/acc of the best checkpoint\n")
    print("| seed | fine-tuned | scratch | gain |\n|---:|---:|---:|---:|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            rows.append(one_seed(seed, budget, tmp))
            tuned, scratch = rows[-1]
            print(f"| {seed} | {tuned:.4f} | {scratch:.4f} | {tuned - scratch:+.4f} |", flush=True)
    tuned, scratch = mean(r[0] for r in rows), mean(r[1] for r in rows)
    print(f"| **mean** | **{tuned:.4f}** | **{scratch:.4f}** | **{tuned - scratch:+.4f}** |")
    wins = sum(t > s for t, s in rows)
    print(f"\nfine-tuning won {wins} of {len(rows)} seeds; gains {min(t - s for t, s in rows):+.4f} to "
          f"{max(t - s for t, s in rows):+.4f}")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
