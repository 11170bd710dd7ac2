"""What a whole runlab run costs over a hand-written training script doing the same job.

The job: experiment=digits_mlp for --epochs epochs (its MLP on the bundled digits, AdamW, its lr and
batch size, a cosine schedule stepped per epoch), validate after every epoch, test once at
the end. Timed whole, set-up included (reading the data, building the model and optimizer; for
runlab also composing the config, the run dir, logging and checkpoints), in one process,
alternating rounds after one warm-up round. Each way's ratio is the median over the rounds of
its time over the hand-written run's in the same round, with the range, and the same ratio of
CPU time (every thread of this process: TensorBoard's and the checkpoint writer's included):

  hand-written     a plain loop over tensors in memory: the limit
  hand-written + checkpoint  the same loop writing model and optimizer to an atomic, fsynced
                   checkpoint every epoch: the floor of a run that loses nothing on a crash
  hand-written, unfused  the first, with torch's default AdamW, as a script would build it; the
                   floors above use the fused one, as runlab's optimizer.fused (the default) does
  runlab defaults  framework.run(...) as the command line runs it: TensorBoard, checkpoints, progress bar
  runlab bare      logger=none checkpoint.enabled=false trainer.progress_bar=false
  lightning ...    the same job in Lightning, bare and with its defaults, only if lightning is installed

--loader dataloader times runlab's DataLoader path instead: the same splits as Samples, a plain
map-style Dataset read one sample at a time and batched by the default collate, as a user's own
Dataset is (a TensorDataset would take the in-memory path). runlab gets it from this file's
digits_samples (data=custom), the hand-written loop from DataLoaders with --workers worker
processes, kept between epochs as runlab keeps them; Lightning is left out. The CPU ratio counts
this process, not its workers. After each way, outside the timings, the worker processes it left
running are counted and collected, and any are reported.

Early stopping is off in every runlab run so that all of them train every epoch. Usage:
    python benchmarks/step_overhead.py [--epochs 30] [--rounds 5] [--threads 1]
    python benchmarks/step_overhead.py --epochs 300 --rounds 3
    python benchmarks/step_overhead.py --loader dataloader [--workers 0]
    python benchmarks/step_overhead.py --device cuda   both on the GPU (benchmarks/gpu_check.sh runs it)
    python benchmarks/step_overhead.py --cold-start [--rounds 7]   whole processes (benchmarks/startup.py)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import framework  # noqa: E402
from framework.data import DataBundle, digits, load_digits_arrays  # noqa: E402

# way: (its floor, the target ratio to it at 30 epochs, at 300)
TARGETS = {"runlab defaults": ("hand-written + checkpoint", 1.15, 1.10), "runlab bare": ("hand-written", 1.05, 1.03)}
BARE = ["logger=none", "checkpoint.enabled=false", "trainer.progress_bar=false"]
BATCH, LR, WEIGHT_DECAY, WIDTH, SEED = 64, 2e-3, 0.01, 256, 42  # experiment=digits_mlp's
FACTORY = "benchmarks.step_overhead.digits_samples"  # this file, which Hydra imports as it would a user's package


class TerminalSink(io.TextIOWrapper):
    """A stderr that claims to be a terminal, so tqdm really formats and writes its bar."""

    def isatty(self) -> bool:
        return True


@contextlib.contextmanager
def output_discarded():
    """The runs' per-epoch lines and progress bars go nowhere, but are still formatted and written."""
    with open(os.devnull, "w") as devnull, TerminalSink(open(os.devnull, "wb")) as terminal:
        with contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(terminal):
            yield


# --- the hand-written script -------------------------------------------------------------

def digits_splits():
    """Digits as runlab's data=digits prepares them: 70/15/15 split, standardized by the train split."""
    x, y = load_digits_arrays()
    order = np.random.default_rng(0).permutation(len(y))
    n_held = round(len(y) * 0.15)
    parts = [order[2 * n_held:], order[:n_held], order[n_held:2 * n_held]]
    mean, std = x[parts[0]].mean(), x[parts[0]].std()
    return [(torch.from_numpy((x[i] - mean) / std), torch.from_numpy(y[i])) for i in parts]


class Samples(Dataset):
    """A map-style dataset of (input, label) pairs, read one sample at a time."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


@torch.no_grad()
def loss_and_accuracy(model, x, y):
    model.eval()
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def digits_mlp(epochs: int, device: str = "cpu", fused: bool = True):
    """experiment=digits_mlp's model, optimizer (fused, as optimizer.fused makes it) and schedule."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)
    return model, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)


def durable_checkpoint(model, optimizer, epoch: int, directory: str) -> None:
    """torch.save to a temporary file, fsync, rename over last.pt, fsync the folder."""
    path, tmp = Path(directory) / "last.pt", Path(directory) / ".last.pt.tmp"
    with open(tmp, "wb") as handle:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    folder = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def hand_written(epochs: int, checkpoint_dir: str = "", device: str = "cpu", fused: bool = True) -> None:
    torch.manual_seed(SEED)
    (train_x, train_y), (val_x, val_y), (test_x, test_y) = (tuple(t.to(device) for t in split) for split in digits_splits())
    model, optimizer, schedule = digits_mlp(epochs, device, fused)
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(SEED + epoch)).to(device)
        for start in range(0, len(order) - BATCH + 1, BATCH):
            index = order[start:start + BATCH]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(train_x[index]), train_y[index]).backward()
            optimizer.step()
        schedule.step()
        loss_and_accuracy(model, val_x, val_y)
        if checkpoint_dir:
            durable_checkpoint(model, optimizer, epoch, checkpoint_dir)
    loss_and_accuracy(model, test_x, test_y)


def hand_written_loader(epochs: int, workers: int) -> None:
    """The same loop over DataLoaders of Samples, as torch's tutorials write it."""
    torch.manual_seed(SEED)
    options = {"num_workers": workers, "persistent_workers": workers > 0}
    train, val, test = (Samples(x, y) for x, y in digits_splits())
    train = DataLoader(train, batch_size=BATCH, shuffle=True, drop_last=True, **options)
    val, test = (DataLoader(split, batch_size=len(split), **options) for split in (val, test))
    model, optimizer, schedule = digits_mlp(epochs)
    for _ in range(epochs):
        model.train()
        for x, y in train:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        schedule.step()
        for x, y in val:
            loss_and_accuracy(model, x, y)
    for x, y in test:
        loss_and_accuracy(model, x, y)


# --- runlab ------------------------------------------------------------------------------

def digits_samples() -> DataBundle:
    """runlab's data for --loader dataloader: data=digits' own split and standardisation, each split as Samples."""
    bundle = digits(normalize=True, val_fraction=0.15, test_fraction=0.15, split_seed=0)  # data=digits' defaults
    return DataBundle(*(Samples(*bundle.split(name).tensors) for name in ("train", "val", "test")), classes=bundle.classes)


def runlab(overrides: List[str], epochs: int, workdir: str) -> None:
    with output_discarded():
        result = framework.run([*overrides, f"trainer.max_epochs={epochs}"], run_dir=tempfile.mkdtemp(dir=workdir))
    assert result["epoch"] == epochs


# --- Lightning, when installed -----------------------------------------------------------

def lightning_ways(epochs: int, workdir: str) -> Dict[str, Callable[[], None]]:
    if importlib.util.find_spec("lightning") is None:
        return {}
    import lightning as L

    class DigitsModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, WIDTH), torch.nn.ReLU(),
                                             torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10))

        def training_step(self, batch, index):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def validation_step(self, batch, index):
            x, y = batch
            logits = self.model(x)
            self.log_dict({"val/loss": F.cross_entropy(logits, y), "val/acc": (logits.argmax(1) == y).float().mean()})

        test_step = validation_step

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
            return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)]

    def fit(**trainer_options) -> None:
        from torch.utils.data import DataLoader, TensorDataset

        torch.manual_seed(SEED)
        train, val, test = (TensorDataset(*split) for split in digits_splits())
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, default_root_dir=tempfile.mkdtemp(dir=workdir),
                            **trainer_options)
        module = DigitsModule()
        with output_discarded():
            trainer.fit(module, DataLoader(train, batch_size=BATCH, shuffle=True, drop_last=True),
                        DataLoader(val, batch_size=len(val)))
            trainer.test(module, DataLoader(test, batch_size=len(test)), verbose=False)

    return {"lightning defaults": fit,
            "lightning bare": lambda: fit(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                          enable_model_summary=False)}


def reap_leftovers() -> Tuple[int, float]:
    """The worker processes a way left running, and the seconds the garbage collector took to stop them.

    A DataLoader held in a reference cycle keeps its persistent workers after the run, and freeing it
    from the collector waits out torch's 5 s join timeout for each. Collected here, outside the
    timings, so that none of it lands in whichever way runs next."""
    workers = len(multiprocessing.active_children())
    started = time.perf_counter()
    gc.collect()
    return workers, time.perf_counter() - started


def per_round(seconds: Dict[str, List[float]], name: str, floor: str = "hand-written") -> List[float]:
    """Each round's time of ``name`` over the ``floor``'s in that round: this machine's speed
    drifts from minute to minute, and neighbours in time share it."""
    return [mine / hand for mine, hand in zip(seconds[name], seconds[floor])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; this MLP gains nothing from more")
    parser.add_argument("--loader", choices=["memory", "dataloader"], default="memory",
                        help="the data as tensors in memory, or a per-sample Dataset through DataLoaders")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (--loader dataloader)")
    parser.add_argument("--cold-start", action="store_true", help="time whole processes instead (benchmarks/startup.py)")
    parser.add_argument("--device", default="cpu", help="where both train, e.g. cuda (--loader memory, no Lightning)")
    args = parser.parse_args()
    if args.device != "cpu" and args.loader == "dataloader":
        parser.error("--device applies to --loader memory only")
    if args.cold_start:
        from startup import cold_start

        return cold_start(args.rounds)
    torch.set_num_threads(args.threads)
    overrides = ["experiment=digits_mlp", "early_stopping.enabled=false", f"device={args.device}"]
    hand, data = (lambda: hand_written(args.epochs, device=args.device)), f"tensors in memory, on {args.device}"
    if args.loader == "dataloader":
        overrides += ["data=custom", f"data._target_={FACTORY}", f"data.num_workers={args.workers}"]
        hand, data = (lambda: hand_written_loader(args.epochs, args.workers)), f"DataLoaders, {args.workers} workers"
    with tempfile.TemporaryDirectory() as workdir:
        floors = {"hand-written + checkpoint": lambda: hand_written(args.epochs, tempfile.mkdtemp(dir=workdir), args.device),
                  "hand-written, unfused": lambda: hand_written(args.epochs, device=args.device, fused=False)}
        ways = {"hand-written": hand, **(floors if args.loader == "memory" else {}),
                "runlab defaults": lambda: runlab(overrides, args.epochs, workdir),
                "runlab bare": lambda: runlab([*overrides, *BARE], args.epochs, workdir),
                **(lightning_ways(args.epochs, workdir) if args.loader == "memory" and args.device == "cpu" else {})}
        times: Dict[str, List[float]] = {name: [] for name in ways}
        cpu: Dict[str, List[float]] = {name: [] for name in ways}
        leftovers: Dict[str, Tuple[int, float]] = {}
        for round_ in range(args.rounds + 1):
            for name, way in ways.items():
                started, started_cpu = time.perf_counter(), time.process_time()
                way()
                if round_:  # round 0 warms up: imports, the first Hydra compose, allocator
                    times[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - started_cpu)
                if args.loader == "dataloader":
                    leftovers[name] = reap_leftovers()
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"digits_mlp, {args.epochs} epochs, {data}, whole runs: torch threads {torch.get_num_threads()}, "
          f"median of {args.rounds} rounds; x: the median of each round's ratio to the hand-written run beside it")
    print(f"  {'':<25} {'wall':>9}   {'x hand-written':>14}   {'range':>11}   {'cpu x':>6}")
    for name, seconds in median.items():
        ratios = per_round(times, name)
        print(f"  {name:<25} {seconds:7.3f} s   {statistics.median(ratios):13.2f}x   {min(ratios):4.2f}-{max(ratios):4.2f}x"
              f"   {statistics.median(per_round(cpu, name)):5.2f}x")
    for name, (floor, *targets) in TARGETS.items():
        if floor in times:
            target = targets[0] if args.epochs < 300 else targets[1]
            ratio = statistics.median(per_round(times, name, floor))
            print(f"  {name} / {floor}: {ratio:.2f}x (target <= {target:.2f}x at {args.epochs} epochs)")
    for name, (workers, seconds) in leftovers.items():
        if workers:
            print(f"  {name} left {workers} DataLoader workers running after it returned; the garbage collector "
                  f"stopped them in {seconds:.1f} s, not counted above")
    if args.loader == "memory" and args.device == "cpu" and not any(name.startswith("lightning") for name in median):
        print("  (lightning is not installed: no Lightning figures)")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
