"""Processes the troubleshooting tests start (not a test module).

    python tests/troubleshoot_worker.py ddp RANK WORLD INIT_FILE RUN_DIR OVERRIDES...
        one rank of a gloo process group, training through parallel=ddp's DistributedEnvironment
    python tests/troubleshoot_worker.py watched RANK WORLD INIT_FILE RUN_DIR OVERRIDES...
        the same, watching an MLP of depth 3 train: whether each training forward synchronises
        its gradients, how many gradient buckets were all-reduced when the first layer's
        gradient arrived (then backward is not over yet), and, on rank 1, an out-of-memory
        error raised half-way through the second step's backward; written to RUN_DIR/watch{rank}.json
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

from framework.entry import resolved_run_config
from framework.parallel import Environment, unwrap
from framework.parallel.distributed import DistributedEnvironment
from framework.trainer import Trainer


def address_space_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) / 1024


def finish(trainer: Trainer, run_dir: Path, rank: int) -> None:
    metrics = trainer.fit()
    torch.save(unwrap(trainer.model).state_dict(), run_dir / f"weights{rank}.pt")
    (run_dir / f"result{rank}.json").write_text(json.dumps({"micro_batch": trainer.train_step.micro_batch, **metrics}))


def ddp_trainer(rank: int, world_size: int, init_file: str, run_dir: Path, overrides: List[str]) -> Trainer:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))  # a rank left waiting fails the test instead of hanging it
    cfg = resolved_run_config(overrides)
    # What parallel=ddp provides, on this test's own process group.
    env = DistributedEnvironment(torch.device("cpu"), rank, world_size, agree_on_out_of_memory=cfg.troubleshoot.oom_recovery)
    return Trainer(cfg, run_dir, env)


def ddp_rank(rank: int, world_size: int, init_file: str, run_dir: Path, overrides: List[str]) -> None:
    finish(ddp_trainer(rank, world_size, init_file, run_dir, overrides), run_dir, rank)
    dist.destroy_process_group()


def watched_rank(rank: int, world_size: int, init_file: str, run_dir: Path, overrides: List[str]) -> None:
    trainer = ddp_trainer(rank, world_size, init_file, run_dir, overrides)
    model, agreement = unwrap(trainer.model), trainer.env.agreement
    seen = {"synchronised": [], "buckets_sent_at_first_layer": [], "buckets_sent_at_failure": []}

    def forward(module, inputs):
        if module.training and torch.is_grad_enabled():
            seen["synchronised"].append(trainer.model.require_backward_grad_sync)  # False inside no_sync

    def first_layer(grad):  # the last gradient of a backward
        if trainer.model.require_backward_grad_sync:
            seen["buckets_sent_at_first_layer"].append(agreement.buckets_sent)

    synchronised_backwards = 0

    def fail_once(grad):  # in the second step's synchronising backward (DDP's first iteration has one bucket)
        nonlocal synchronised_backwards
        synchronised_backwards += trainer.model.require_backward_grad_sync
        if synchronised_backwards == 2 and not seen["buckets_sent_at_failure"]:
            seen["buckets_sent_at_failure"].append(agreement.buckets_sent)
            raise torch.OutOfMemoryError("synthetic out-of-memory half-way through backward")

    model.register_forward_pre_hook(forward)
    model.block0[0].weight.register_hook(first_layer)
    if rank == 1:
        model.block1[0].weight.register_hook(fail_once)  # after block2's and the head's gradients
    finish(trainer, run_dir, rank)
    (run_dir / f"watch{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def limited_run(headroom_mb: int, run_dir: Path, overrides: List[str]) -> None:
    trainer = Trainer(resolved_run_config(overrides), run_dir, Environment(torch.device("cpu")))
    if headroom_mb:
        limit = int((address_space_mb() + headroom_mb) * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    finish(trainer, run_dir, 0)


if __name__ == "__main__":
    torch.set_num_threads(1)  # one thread: the same float order in every process, and no thread stacks to budget for
    mode, args = sys.argv[1], sys.argv[2:]
    if mode in ("ddp", "watched"):
        (ddp_rank if mode == "ddp" else watched_rank)(int(args[0]), int(args[1]), args[2], Path(args[3]), args[4:])
    else:
        limited_run(int(args[0]), Path(args[1]), args[2:])
