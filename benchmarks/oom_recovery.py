"""What OOM recovery costs: a run that starts at a micro-batch that runs out of memory and
backs off, against a run configured from the start with the micro-batch it settles on.

    python benchmarks/oom_recovery.py [--repeats 3] [--epochs 3]

The out-of-memory errors come from troubleshoot.inject_oom_above_batch (the fault-injection
testing aid), so every run fails at the same sizes. It also times the decorator-style
alternative (catch the error, restart the whole training function at half the batch):
every failed attempt pays the set-up again before it fails. Prints the ratios, measured side
by side in this process.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from framework import run  # noqa: E402
from framework.troubleshoot.oom import is_out_of_memory  # noqa: E402

START, SETTLES_AT = 1024, 128  # the injected limit makes 1024, 512 and 256 fail


def clock() -> tuple:
    """Wall time and this process's CPU time: on a shared machine the CPU time is the steadier of the two."""
    return time.perf_counter(), time.process_time()


def since(started: tuple) -> tuple:
    now = clock()
    return now[0] - started[0], now[1] - started[1]


def overrides(epochs: int, output_dir: str, *extra: str) -> list:
    return ["data=synthetic", "data.num_samples=65536", f"batch_size={START}", f"trainer.max_epochs={epochs}",
            "trainer.progress_bar=false", "logger=none", "checkpoint.enabled=false", "trainer.test_after_fit=false",
            f"paths.output_dir={output_dir}", f"troubleshoot.inject_oom_above_batch={SETTLES_AT}", *extra]


def recovering_run(epochs: int, tmp: str) -> tuple:
    started = clock()
    metrics = run(overrides(epochs, tmp), str(Path(tmp) / "recover"))
    assert metrics["troubleshoot/micro_batch"] == SETTLES_AT, metrics
    return since(started)


def settled_run(epochs: int, tmp: str) -> tuple:
    started = clock()
    metrics = run(overrides(epochs, tmp, f"trainer.accumulate_grad_batches={START // SETTLES_AT}",
                            f"data.eval_batch_size={SETTLES_AT}"), str(Path(tmp) / "settled"))
    assert metrics["troubleshoot/oom_backoffs"] == 0, metrics
    return since(started)


def restarting_run(epochs: int, tmp: str) -> tuple:
    """The decorator-style approach: on OOM, rebuild everything at half the batch and start over."""
    started, batch = clock(), START
    while True:
        try:
            run(overrides(epochs, tmp, f"trainer.accumulate_grad_batches={START // batch}",
                          f"data.eval_batch_size={batch}", "troubleshoot.oom_recovery=false"), str(Path(tmp) / f"restart{batch}"))
            return since(started)
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
        batch //= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # no idle threads spinning on a shared machine: CPU time then tracks the work done
    times = {"recovering": [], "settled": [], "restarting": []}
    with TemporaryDirectory() as tmp:
        settled_run(1, tmp)  # warm-up: imports, allocator, data generation code paths
        for _ in range(args.repeats):  # interleaved, so machine load hits all three alike
            times["settled"].append(settled_run(args.epochs, tmp))
            times["recovering"].append(recovering_run(args.epochs, tmp))
            times["restarting"].append(restarting_run(args.epochs, tmp))
    print(f"start at micro-batch {START}, OOM above {SETTLES_AT}, {args.epochs} epochs, median of {args.repeats}:")
    for kind, index in (("wall", 0), ("cpu", 1)):
        median = {name: statistics.median(v[index] for v in values) for name, values in times.items()}
        for name, seconds in median.items():
            print(f"  {kind:4s} {name:11s} {seconds:7.2f} s   ({', '.join(f'{v[index]:.2f}' for v in times[name])})")
        print(f"  {kind:4s} recovering / settled: {median['recovering'] / median['settled']:.3f}x  (target <= 1.2x)")
        print(f"  {kind:4s} restarting / settled: {median['restarting'] / median['settled']:.3f}x  "
              "(whole-run restart, decorator style)")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
