"""How much the framework's training loop costs over a hand-written one.

Trains the same MLP on the same data for the same number of optimizer steps, three ways,
in one process, alternating rounds and keeping each way's median:

  limit       a hand-written loop over tensors already in memory, validating each epoch
  dataloader  the same loop fed by a torch DataLoader (per-sample __getitem__ + collate)
  framework   framework.run(...) with the progress bar drawn and TensorBoard logging on

The framework's time is its ``train_seconds`` (the training loop alone, validation,
checkpoints and logging included; start-up excluded). Usage:
    python benchmarks/step_overhead.py [--experiment digits_mlp|synthetic_mlp] [--rounds 3]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import framework  # noqa: E402
from framework.data import build_data  # noqa: E402
from framework.entry import compose  # noqa: E402
from framework.model import build_model, model_spec  # noqa: E402


class TerminalSink(io.TextIOWrapper):
    """A stderr that claims to be a terminal, so tqdm really formats and writes its bar."""

    def isatty(self) -> bool:
        return True


def setup(overrides):
    cfg = compose(overrides)
    cfg.paths.root_dir = str(Path.cwd())
    data = build_data(cfg.data, cfg.seed)
    spec = model_spec(cfg.model, data.input_shape, data.num_classes)
    return cfg, data, spec


def hand_loop(cfg, data, spec, steps: int, batches_of) -> float:
    torch.manual_seed(cfg.seed)
    model = build_model(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.optimizer.weight_decay)
    started, step, epoch = time.perf_counter(), 0, 0
    while step < steps:
        model.train()
        for x, y in batches_of(epoch):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        model.eval()
        with torch.no_grad():
            (model(data.val.x).argmax(1) == data.val.y).float().mean().item()
        epoch += 1
    return time.perf_counter() - started


def in_memory_batches(data, batch_size, seed):
    def batches(epoch):
        order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start:start + batch_size]
            yield data.train.x[index], data.train.y[index]
    return batches


def dataloader_batches(data, batch_size):
    loader = DataLoader(TensorDataset(data.train.x, data.train.y), batch_size=batch_size, shuffle=True, drop_last=True)
    return lambda epoch: loader


def framework_run(overrides, steps: int, workdir: str) -> float:
    real_stderr = sys.stderr
    sys.stderr = TerminalSink(open(os.devnull, "wb"))
    try:
        metrics = framework.run([*overrides, f"trainer.max_steps={steps}", "trainer.progress_bar=true",
                                 "logger=tensorboard", "early_stopping.enabled=false"],
                                run_dir=tempfile.mkdtemp(dir=workdir))
    finally:
        sys.stderr = real_stderr
    assert metrics["step"] == steps
    return metrics["train_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="synthetic_mlp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    overrides = [f"experiment={args.experiment}", "scheduler=none", f"trainer.max_epochs={args.epochs}", "device=cpu"]
    cfg, data, spec = setup(overrides)
    steps = args.epochs * (len(data.train) // cfg.batch_size)
    ways = {
        "limit": lambda: hand_loop(cfg, data, spec, steps, in_memory_batches(data, cfg.batch_size, cfg.seed)),
        "dataloader": lambda: hand_loop(cfg, data, spec, steps, dataloader_batches(data, cfg.batch_size)),
        "framework": lambda: framework_run(overrides, steps, workdir),
    }
    times = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.rounds):
            for name, way in ways.items():
                times[name].append(way())
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.experiment}: {steps} optimizer steps of batch {cfg.batch_size}, {len(data.train)} train samples, "
          f"torch threads {torch.get_num_threads()}, median of {args.rounds} rounds")
    for name, seconds in median.items():
        print(f"  {name:<11} {seconds:8.3f} s   {steps / seconds:9.1f} steps/s   ratio to limit {seconds / median['limit']:.3f}")
    print(f"framework/limit = {median['framework'] / median['limit']:.3f}  (target <= 1.05)")
    print(f"dataloader/limit = {median['dataloader'] / median['limit']:.3f}")


if __name__ == "__main__":
    main()
