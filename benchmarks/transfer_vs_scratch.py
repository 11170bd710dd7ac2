"""What the shipped fine-tuning example gains over training from scratch on the same budget.

Runs, in one process and under a temporary output folder:

  pretrain   experiment=digits_pretrain (a CNN on digits 0-4)
  finetune   experiment=digits_finetune (5-9 from that run, convolutions frozen)
  scratch    the same experiment, budget and learning rate, from a fresh CNN with nothing frozen

and prints each run's accuracies, trainable parameters and training time side by side.
Usage:  python benchmarks/transfer_vs_scratch.py [--epochs N]   (N: the fine-tuning budget)
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import framework  # noqa: E402

QUIET = ["logger=none", "trainer.progress_bar=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2, help="the fine-tuning budget (digits_finetune ships 2)")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        common = [*QUIET, f"paths.output_dir={tmp}"]
        budget = [f"trainer.max_epochs={args.epochs}"]
        pretrain = framework.run(["experiment=digits_pretrain", *common], run_dir=f"{tmp}/pretrain")
        rows = {
            "pretrain (0-4)": pretrain,
            "finetune (5-9)": framework.run(["experiment=digits_finetune", f"finetune.from={tmp}/pretrain", *budget, *common],
                                            run_dir=f"{tmp}/finetune"),
            "scratch (5-9)": framework.run(["experiment=digits_finetune", "finetune.from=", "finetune.freeze=[]", "model=cnn",
                                            *budget, *common], run_dir=f"{tmp}/scratch"),
        }
    print(f"{'run':<16}{'epochs':>7}{'val/acc':>9}{'test/acc':>9}{'train s':>9}")
    for name, metrics in rows.items():
        print(f"{name:<16}{metrics['epoch']:>7}{metrics['val/acc']:>9.4f}{metrics['test/acc']:>9.4f}{metrics['train_seconds']:>9.2f}")
    gain = rows["finetune (5-9)"]["test/acc"] - rows["scratch (5-9)"]["test/acc"]
    print(f"fine-tuned minus scratch, test/acc after {args.epochs} epochs: {gain:+.4f}")


if __name__ == "__main__":
    main()
