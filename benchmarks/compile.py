"""What trainer.compile costs and gains: compile seconds and the steady-state step time, compiled over eager.

    python benchmarks/compile.py [--steps 30] [--rounds 5] [--threads 1] [--backend inductor] [--warm-cache]

Two models, side by side in one process: experiment=digits_cnn's CNN (batch 64 of 8x8 digits)
and a mid-size MLP (width 1024, 4 layers, 3.4M parameters, batch 256 of 256 synthetic features).
Each is built by runlab as a run builds it (``Trainer``: the config composed, the model wrapped by
parallel=none, compiled there when trainer.compile=true) and timed on runlab's own training step
(``TrainStep``: forward, backward, optimizer step) over the same batches, eager and compiled.

  compile s   the compiled model's first step minus its steady-state step: dynamo's trace plus
              the backend's build of the forward and backward graphs (inductor: C++ kernels on
              CPU), from a cold cache unless --warm-cache
  step ms     the median over rounds of the mean step time over --steps steps; eager and compiled
              alternate round by round, so both see the machine's drift alike
  x eager     each round's compiled step time over the eager one beside it, median and range

Validation is not timed: it compiles a graph of its own, once, on its first pass.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {
    "digits_cnn": ["experiment=digits_cnn"],
    "mlp 1024x4": ["data=synthetic", "data.num_samples=4096", "data.input_shape=[256]", "model=mlp",
                   "model.width=1024", "model.depth=4", "batch_size=256"],
}
QUIET = ["logger=none", "checkpoint.enabled=false", "trainer.progress_bar=false", "device=cpu"]


def build_step(overrides: List[str], workdir: str):
    """runlab's training step for the model, and full batches to feed it (on the device already)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from framework.config import validate
    from framework.entry import compose
    from framework.parallel import setup
    from framework.trainer import Trainer

    cfg = compose([*overrides, *QUIET])
    HydraConfig.instance().set_config(cfg)  # as framework.run prepares a config: ${hydra:...} resolved, then dropped
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.resolve(cfg)
    validate(cfg)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(dir=workdir)), setup(cfg))
    trainer.train_batches.set_epoch(0)
    full = [batch for batch in trainer.train_batches][:-1]  # the last may be short: another shape, another graph
    return trainer, full


def timed_steps(trainer, full: list, steps: int) -> float:
    """Seconds per optimizer step, mean over ``steps`` steps."""
    started = time.perf_counter()
    for index in range(steps):
        trainer.train_step(full[index % len(full)], index, f"step {index + 1}")
    return (time.perf_counter() - started) / steps


def measure(overrides: List[str], backend: str, steps: int, rounds: int, workdir: str) -> Tuple[float, List[float], List[float]]:
    """(compile seconds, eager step times, compiled step times) for one model."""
    import torch

    torch.compiler.reset()
    eager, batches = build_step(overrides, workdir)
    compiled, _ = build_step([*overrides, "trainer.compile=true", f"trainer.compile_backend={backend}"], workdir)
    timed_steps(eager, batches, 3)  # warm-up: the allocator, the optimizer's state
    first = timed_steps(compiled, batches, 1)
    timed_steps(compiled, batches, 2)
    eager_times, compiled_times = [], []
    for _ in range(rounds):
        eager_times.append(timed_steps(eager, batches, steps))
        compiled_times.append(timed_steps(compiled, batches, steps))
    return first - statistics.median(compiled_times), eager_times, compiled_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--warm-cache", action="store_true", help="reuse inductor's on-disk cache of compiled kernels")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        if not args.warm_cache:  # before torch reads it
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(workdir) / "inductor-cache")
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        results: Dict[str, Tuple[float, List[float], List[float]]] = {
            name: measure(overrides, args.backend, args.steps, args.rounds, workdir) for name, overrides in MODELS.items()}
    cache = "warm" if args.warm_cache else "cold"
    print(f"trainer.compile_backend={args.backend}, {cache} cache, torch threads {torch.get_num_threads()}, "
          f"{args.steps} training steps x {args.rounds} rounds, runlab's TrainStep, parallel=none on cpu")
    print(f"  {'':<12} {'compile s':>9}   {'eager ms':>8}   {'compiled ms':>11}   {'x eager':>7}   {'range':>11}")
    for name, (compile_seconds, eager_times, compiled_times) in results.items():
        ratios = [c / e for c, e in zip(compiled_times, eager_times)]
        print(f"  {name:<12} {compile_seconds:9.1f}   {1e3 * statistics.median(eager_times):8.2f}   "
              f"{1e3 * statistics.median(compiled_times):11.2f}   {statistics.median(ratios):6.2f}x   "
              f"{min(ratios):4.2f}-{max(ratios):4.2f}x")


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
