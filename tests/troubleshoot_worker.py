"""Processes the troubleshooting tests start (not a test module).

    python tests/troubleshoot_worker.py ddp RANK WORLD INIT_FILE RUN_DIR OVERRIDES...
        one rank of a gloo process group, training through a real DistributedDataParallel
    python tests/troubleshoot_worker.py limited HEADROOM_MB RUN_DIR OVERRIDES...
        a run whose address space is capped at what it holds after set-up plus HEADROOM_MB
        (HEADROOM_MB=0: no cap), so a too-large micro-batch fails to allocate for real

Each writes RUN_DIR/result{rank}.json (the final micro-batch and metrics) and the trained
weights to RUN_DIR/weights{rank}.pt.
"""
from __future__ import annotations

import json
import resource
import sys
from datetime import timedelta
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.nn.parallel import DistributedDataParallel

from framework.entry import compose
from framework.parallel import Environment, unwrap
from framework.trainer import Trainer


def resolved_config(overrides: List[str]) -> DictConfig:
    """The config ``framework.run(overrides)`` would train with."""
    cfg = compose(overrides)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.resolve(cfg)
    return cfg


class GlooEnvironment(Environment):
    """What parallel=ddp provides, built here on this test's own process group."""

    def wrap(self, model):
        # OOM recovery averages buffers in its own all-reduce; see AgreedSync.
        return DistributedDataParallel(model.to(self.device), broadcast_buffers=False)

    def no_sync(self, model):
        return model.no_sync()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor


def address_space_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) / 1024


def finish(trainer: Trainer, run_dir: Path, rank: int) -> None:
    metrics = trainer.fit()
    torch.save(unwrap(trainer.model).state_dict(), run_dir / f"weights{rank}.pt")
    (run_dir / f"result{rank}.json").write_text(json.dumps({"micro_batch": trainer.micro_batch, **metrics}))


def ddp_rank(rank: int, world_size: int, init_file: str, run_dir: Path, overrides: List[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))  # a rank left waiting fails the test instead of hanging it
    cfg = resolved_config(overrides)
    finish(Trainer(cfg, run_dir, GlooEnvironment(torch.device("cpu"), rank, world_size)), run_dir, rank)
    dist.destroy_process_group()


def limited_run(headroom_mb: int, run_dir: Path, overrides: List[str]) -> None:
    trainer = Trainer(resolved_config(overrides), run_dir, Environment(torch.device("cpu")))
    if headroom_mb:
        limit = int((address_space_mb() + headroom_mb) * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    finish(trainer, run_dir, 0)


if __name__ == "__main__":
    torch.set_num_threads(1)  # one thread: the same float order in every process, and no thread stacks to budget for
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "ddp":
        ddp_rank(int(args[0]), int(args[1]), args[2], Path(args[3]), args[4:])
    else:
        limited_run(int(args[0]), Path(args[1]), args[2:])
