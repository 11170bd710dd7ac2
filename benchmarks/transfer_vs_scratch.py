"""What the shipped fine-tuning example gains over training from scratch on the same small budget.

For each seed, in one process and under a temporary output folder:

  pretrain   experiment=digits_pretrain seed=S (a small ResNet on digits 0-4, all labels)
  finetune   experiment=digits_finetune seed=S (5-9 with 3 labels per class, from that run)
  scratch    experiment=digits_finetune seed=S finetune.from="" "finetune.freeze=[]"
             (the same ResNet, labels, steps and learning rate, from random weights)

and prints both test accuracies per seed, then their means and the gain.
Usage:  python benchmarks/transfer_vs_scratch.py [--seeds 0 1 2] [--per-class N]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import framework  # noqa: E402

QUIET = ["logger=none", "trainer.progress_bar=false"]


def one_seed(seed: int, per_class: int, tmp: str) -> tuple:
    """(fine-tuned, scratch) test accuracy for one seed."""
    common = [*QUIET, f"seed={seed}", f"paths.output_dir={tmp}"]
    budget = [f"data.train_per_class={per_class}", f"batch_size={5 * per_class}"]
    source = f"{tmp}/pretrain{seed}"
    framework.run(["experiment=digits_pretrain", *common], run_dir=source)
    tuned = framework.run(["experiment=digits_finetune", f"finetune.from={source}", *budget, *common], run_dir=f"{tmp}/finetune{seed}")
    scratch = framework.run(["experiment=digits_finetune", "finetune.from=", "finetune.freeze=[]", *budget, *common],
                            run_dir=f"{tmp}/scratch{seed}")
    return tuned["test/acc"], scratch["test/acc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--per-class", type=int, default=3, help="labelled training images per class (digits_finetune ships 3)")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    print(f"digits 5-9, {args.per_class} labels per class; test/acc of the best checkpoint")
    print(f"{'seed':>6}{'finetuned':>11}{'scratch':>9}{'gain':>8}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            rows.append(one_seed(seed, args.per_class, tmp))
            tuned, scratch = rows[-1]
            print(f"{seed:>6}{tuned:>11.4f}{scratch:>9.4f}{tuned - scratch:>+8.4f}", flush=True)
    tuned, scratch = mean(r[0] for r in rows), mean(r[1] for r in rows)
    print(f"{'mean':>6}{tuned:>11.4f}{scratch:>9.4f}{tuned - scratch:>+8.4f}")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
