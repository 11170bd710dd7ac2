"""parallel=ddp: ``DistributedDataParallel``, one process per device.

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set) each process
joins the group torchrun set up, on one machine or several (--nnodes, --node_rank); in a job of
several tasks of hydra-submitit-launcher (``launcher=slurm``, SLURM or its local executor) each
task is a rank the same way, with those variables set from the job's own (SLURM_PROCID,
SLURM_NTASKS, ...); each such rank is a ``python run.py`` of its own and builds its ``DDP``
from the config. Otherwise ``python run.py parallel=ddp`` spawns ``parallel.world_size``
processes itself, on a free port per job so that the jobs of a multirun never collide, and
hands each the ``DDP`` it was launched by (pickled with the task); the Hydra job that spawned
them gets rank 0's metrics back.

Every rank reads its own slice of each global batch (data.BatchPlan), DDP averages the
gradients, so a step equals one step of parallel=none on the whole batch. Only rank 0 logs,
shows progress and writes files; the others log warnings only, prefixed with their rank.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import inspect
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from framework.config import chosen
from framework.errors import LOG_FORMAT, ConfigError, Interrupted, RunLogHandler, RunlabError
from framework.parallel import Compile, Environment, Mode, Task, compiled, resolve_device
from framework.paths import LOCK_FILE
from framework.private_apis import zero_gradient_buckets
from framework.signals import STOP_SIGNALS
from framework.startup import freeze_start_up, pause_collector

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # prctl(2)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# DDP's switch for its buffer broadcast before each forward: forward_sync_buffers from torch 2.13,
# broadcast_buffers (deprecated there) before it. The older one also skips the buffers in the
# initial broadcast, where every rank holds the same buffers anyway (same seed, same module), and
# after a failed step the next step's average makes them equal again.
NO_BUFFER_BROADCAST_IN_FORWARD = (
    {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False})


class OutOfMemoryAgreement:
    """How the processes of a ddp run agree after every step whether one ran out of memory
    (troubleshoot.oom_recovery), keeping DDP's overlap of the gradient all-reduce with backward.

    DDP all-reduces gradient buckets from inside the last micro-batch's backward, as each bucket
    fills. A process that ran out of memory in a forward or half-way through that backward
    would never join those all-reduces, and the others would wait in them until the timeout.
    So the bucket all-reduce is DDP's own (its default comm hook), counted; a process that ran
    out of memory all-reduces zeros for each bucket it did not send, in DDP's bucket order, and
    then every process all-reduces one small tensor: its out-of-memory flag. Nobody waits on
    a process that will not come, and a healthy step costs DDP's bucketed all-reduce plus
    that one small all-reduce.

    The same small all-reduce averages the floating-point buffers (batch-norm running
    statistics), so DDP's own buffer broadcast is off: DDP decides whether a forward broadcasts
    in the previous forward's epilogue, which a forward that ran out of memory never reaches.
    After a step that failed anywhere, every process wraps the module in a new DDP: the old
    reducer of a process that failed mid-backward is stuck half-way through an iteration.
    """

    def __init__(self, module: nn.Module, device: torch.device):
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        dtype = functools.reduce(torch.promote_types, (b.dtype for b in self.buffers), torch.float32)
        # Allocated up front, so that the agreement itself cannot run out of memory.
        self.flat = torch.zeros(sum(b.numel() for b in self.buffers) + 1, dtype=dtype, device=device)
        self.buffer_views = [view.view_as(b) for view, b in zip(self.flat[:-1].split([b.numel() for b in self.buffers]),
                                                                 self.buffers)]
        self.buckets_sent = 0

    def wrap(self, module: nn.Module, device_ids) -> DistributedDataParallel:
        model = DistributedDataParallel(module, device_ids=device_ids, **NO_BUFFER_BROADCAST_IN_FORWARD)
        model.register_comm_hook(self, all_reduce_bucket)
        return model

    def processes_out_of_memory(self, model: DistributedDataParallel, ran_out: bool, world_size: int) -> int:
        if ran_out:
            self.send_missed_buckets(model)
        else:
            for buffer, view in zip(self.buffers, self.buffer_views):
                view.copy_(buffer)
        self.flat[-1] = float(ran_out)  # a failed process's buffers ride along unread: nobody keeps this step
        dist.all_reduce(self.flat)
        self.buckets_sent = 0
        processes = int(self.flat[-1].item())
        if not processes:
            for buffer, view in zip(self.buffers, self.buffer_views):
                buffer.copy_(view.div_(world_size))
        return processes

    def send_missed_buckets(self, model: DistributedDataParallel) -> None:
        """Zeros for every gradient bucket this process had not sent when it failed, so the others' all-reduces end."""
        missed = zero_gradient_buckets(model)[self.buckets_sent:]
        for work in [all_reduce_bucket(self, bucket) for bucket in missed]:
            work.wait()


def all_reduce_bucket(agreement, bucket):  # no annotations: DDP refuses a hook whose are not its own objects
    """DDP's default all-reduce of one gradient bucket (the average over processes), counted: a DDP comm hook."""
    agreement.buckets_sent += 1
    return allreduce_hook(None, bucket)


@dataclass
class DistributedEnvironment(Environment):
    sync_batchnorm: bool = False
    agree_on_out_of_memory: bool = False  # troubleshoot.oom_recovery
    agreement: Optional[OutOfMemoryAgreement] = field(default=None, init=False, repr=False)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # Compiled inside DDP, as torch's guidance has it: dynamo still splits the graph at DDP's
        # gradient buckets (DDPOptimizer), so the all-reduce keeps overlapping backward.
        model = compiled(model.to(self.device), self.compile)
        if not self.agree_on_out_of_memory:
            return DistributedDataParallel(model, device_ids=self.device_ids)
        self.agreement = OutOfMemoryAgreement(model, self.device)
        return self.agreement.wrap(model, self.device_ids)

    @property
    def device_ids(self) -> Optional[List[int]]:
        return [self.device.index] if self.device.type == "cuda" else None

    def no_sync(self, model: nn.Module):
        return model.no_sync()

    def processes_out_of_memory(self, model: nn.Module, ran_out: bool) -> int:
        if self.agreement is None:  # recovery off: an out-of-memory error ends the run instead
            return int(ran_out)
        return self.agreement.processes_out_of_memory(model, ran_out, self.world_size)

    def after_failed_step(self, model: nn.Module) -> nn.Module:
        if self.agreement is None:
            return model
        return self.agreement.wrap(model.module, self.device_ids)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    def agree_to_stop(self, requested: bool, all_ranks_ask: bool) -> bool:
        if not all_ranks_ask:  # a collective here would hang: the other ranks are not in it
            return False
        return bool(self.all_reduce_sum(torch.tensor([float(requested)], device=self.device)).item())

    def barrier(self) -> None:
        dist.barrier(device_ids=[self.device.index]) if self.device.type == "cuda" else dist.barrier()

    def cleanup(self) -> None:
        if dist.is_initialized():
            # The finished Trainer, and with it the DDP reducer that holds the group, sits in a
            # reference cycle; left to the collector it could be freed during interpreter exit,
            # after the group is gone, where gloo's teardown can abort the process (SIGABRT).
            gc.collect()
            dist.destroy_process_group()


def under_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def outside_any_group(environ: Mapping[str, str]) -> Dict[str, str]:
    """``environ`` without what makes a process a rank of torchrun's group (its variables and its
    agent's TORCHELASTIC_*): for a process that a rank starts as a run of its own."""
    return {name: value for name, value in environ.items()
            if name not in TORCHRUN_VARIABLES and not name.startswith("TORCHELASTIC_")}


def join_job_tasks() -> None:
    """In a submitit job of several tasks, set the torchrun variables from the job's (submitit's
    own mapping: the first host is the master, the port follows from the job id)."""
    if under_torchrun() or not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    import submitit
    from submitit.helpers import TorchDistributedEnvironment

    if submitit.JobEnvironment().num_tasks > 1:
        # Each task sees every GPU of its node and takes cuda:LOCAL_RANK (join_group).
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


@dataclass(frozen=True)
class DDP(Mode):
    """parallel=ddp: the task runs in every process of the group, each in its DistributedEnvironment.
    Built from conf/parallel/ddp.yaml's keys."""

    world_size: int
    backend: str
    sync_batchnorm: bool
    timeout_s: int

    def launch(self, task: Task, cfg: DictConfig, run_dir: Path) -> Any:
        join_job_tasks()
        if under_torchrun():
            return join_torchrun(self, task, cfg, run_dir)
        return spawn_workers(self, task, cfg, run_dir)

    def launched_rank(self) -> int:
        """This process's rank in a group started outside runlab (torchrun, submitit tasks); 0 otherwise."""
        join_job_tasks()
        return int(os.environ["RANK"]) if under_torchrun() else 0

    def launched_world_size(self) -> int:
        join_job_tasks()
        return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1

    def group_environment(self, cfg: DictConfig, **joined: Any) -> DistributedEnvironment:
        """This process's environment once it joined the group; ``joined`` holds what join_group set up."""
        return DistributedEnvironment(**joined)


# --- checks ------------------------------------------------------------------------------

def process_count(ddp: DDP, cfg: DictConfig) -> int:
    """parallel.world_size, where 0 means one process per GPU (or 2 on CPU); checked against the machine."""
    on_cuda = resolve_device(cfg.device).type == "cuda"
    gpus = torch.cuda.device_count() if on_cuda else 0
    count = ddp.world_size or gpus or 2
    if on_cuda and count > gpus:
        raise ConfigError(f"parallel.world_size={count} is larger than the {gpus} visible GPUs; "
                          f"use at most {gpus}, or device=cpu to run the processes on the CPU.")
    check_distributed(ddp, cfg, count, on_cuda)
    return count


def check_distributed(ddp: DDP, cfg: DictConfig, world_size: int, on_cuda: bool) -> None:
    if cfg.batch_size % world_size:
        raise ConfigError(f"batch_size={cfg.batch_size} does not divide among {world_size} processes; "
                          f"use a multiple of {world_size} (batch_size is the global batch).")
    if ddp.backend == "nccl" and not on_cuda:
        raise ConfigError("parallel.backend='nccl' needs CUDA devices but this run is on cpu; use backend=auto or gloo.")
    if ddp.sync_batchnorm and not on_cuda:
        raise ConfigError("parallel.sync_batchnorm=true needs CUDA devices (PyTorch's SyncBatchNorm does not run on cpu); "
                          "set it to false on this machine.")


# --- one process of the group ------------------------------------------------------------

def join_group(ddp: DDP, cfg: DictConfig, rank: int, world_size: int, local_rank: int) -> DistributedEnvironment:
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = resolve_device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    backend = ddp.backend if ddp.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=ddp.timeout_s))
    return ddp.group_environment(cfg, device=device, rank=rank, world_size=world_size, sync_batchnorm=ddp.sync_batchnorm,
                                 agree_on_out_of_memory=cfg.troubleshoot.oom_recovery, compile=Compile.of(cfg.trainer))


def log_as_rank(rank: int, log_file: Path) -> None:
    """Rank 0 logs everything to the console and train.log; the others only warnings, prefixed with their rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    prefix = f"[rank {rank}]" if rank else ""
    formatter = logging.Formatter(prefix + LOG_FORMAT)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for handler in (logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr), RunLogHandler(log_file)):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


# --- torchrun ----------------------------------------------------------------------------

def join_torchrun(ddp: DDP, task: Task, cfg: DictConfig, run_dir: Path) -> Any:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if ddp.world_size and ddp.world_size != world_size:
        log.warning("parallel.world_size=%d is ignored: torchrun started %d processes.", ddp.world_size, world_size)
    check_distributed(ddp, cfg, world_size, resolve_device(cfg.device).type == "cuda")
    env = join_group(ddp, cfg, rank, world_size, int(os.environ["LOCAL_RANK"]))
    log.info("%s: rank %d of %d joined the group at %s:%s.", chosen("parallel", cfg.parallel), rank, world_size,
             os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    try:
        run_dir = adopt_main_run_dir(env, run_dir)
        return task(cfg, run_dir, env)
    finally:
        env.cleanup()


def adopt_main_run_dir(env: DistributedEnvironment, own: Path) -> Path:
    """Every rank uses rank 0's run dir; a dir Hydra made for another rank a second later is removed."""
    shared = [str(own)]
    dist.broadcast_object_list(shared, src=0)
    main = Path(shared[0])
    if env.rank:
        log_as_rank(env.rank, main / "train.log")
        if main != own and own.is_dir() and {p.name for p in own.iterdir()} <= {".hydra", "train.log", LOCK_FILE}:
            shutil.rmtree(own)
    return main


# --- spawned by the Hydra job --------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn_workers(ddp: DDP, task: Task, cfg: DictConfig, run_dir: Path) -> Any:
    world_size, port = process_count(ddp, cfg), free_port()
    config = OmegaConf.to_container(cfg, resolve=True)
    context = mp.get_context("spawn")
    reports = context.SimpleQueue()
    log.info("%s: starting %d processes on 127.0.0.1:%d.", chosen("parallel", cfg.parallel), world_size, port)
    # When one worker fails, torch ends the others and says so; the failure's own message is what counts.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    workers = mp.start_processes(_worker, args=(ddp, world_size, port, config, str(run_dir), task, reports, os.getpid()),
                                 nprocs=world_size, join=False, start_method="spawn")
    forwarded: List[int] = []
    try:
        with signals_forwarded(workers.pids(), forwarded):
            while not workers.join():
                pass
    except ProcessException as failure:
        if getattr(failure, "exit_code", 0) in [-signum for signum in forwarded]:
            raise SystemExit(128 - failure.exit_code) from None  # as below, in a worker's last instant
        raise worker_failure(reports, failure) from None
    reported = drain(reports)
    for kind, _, value in reported:
        if kind == "error":  # the workers stopped on a signal and exited cleanly (Interrupted)
            raise value[0]
    if forwarded:
        # The signal came after the training had ended (its last lines), where it ends a single process
        # at once: the launcher ends as that process would, quietly, with 128 + its number.
        raise SystemExit(128 + forwarded[0])
    return next(value for kind, _, value in reported if kind == "result")


@contextlib.contextmanager
def signals_forwarded(pids: List[int], forwarded: List[int]) -> Iterator[None]:
    """SIGINT and SIGTERM sent to the launcher go on to every worker, which stop together at a step,
    save last.pt and exit; the launcher then ends with their Interrupted. ``forwarded`` gets each
    signal sent on."""
    def forward(signum: int, frame) -> None:
        forwarded.append(signum)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def drain(reports) -> list:
    items = []
    while not reports.empty():
        items.append(reports.get())
    return items


def worker_failure(reports, failure: ProcessException) -> Exception:
    """The first error a worker reported (a user error stays one, for its one-line message)."""
    errors = {rank: value for kind, rank, value in drain(reports) if kind == "error"}  # in the order they failed
    if failure.error_index not in errors:  # killed by a signal or exited without a Python exception
        return RuntimeError(f"parallel=ddp: a worker process died: {failure}.")
    rank, (user_error, trace) = next(iter(errors.items()))
    if user_error is not None:
        return user_error
    return RuntimeError(f"parallel=ddp: process {rank} failed; its error follows.\n{trace}")


def die_with_launcher(launcher: int) -> None:
    """No worker outlives its launcher, not even one killed with SIGKILL (Linux: the parent-death signal)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:  # it died before the line above took effect
        os._exit(1)


def _worker(rank: int, ddp: DDP, world_size: int, port: int, config: dict, run_dir: str, task: Task, reports,
            launcher: int) -> None:
    pause_collector()  # until it joined the group (framework/startup.py; its imports came while unpickling)
    die_with_launcher(launcher)
    # Out of the terminal's process group: Ctrl-C reaches the launcher alone, which forwards it once.
    os.setpgrp()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    run_path = Path(run_dir)
    log_as_rank(rank, run_path / "train.log")
    cfg = OmegaConf.create(config)
    OmegaConf.set_struct(cfg, True)
    if "OMP_NUM_THREADS" not in os.environ:  # the processes share the cores instead of each taking all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ended = threading.Event()

    def stop(signum: int, frame) -> None:
        # The launcher forwards SIGINT and SIGTERM; the task owns them while it trains. Once it has
        # ended, the worker finishes quietly (the launcher then ends on the signal); a worker killed
        # there would read as a crash and leave its semaphores behind.
        if not ended.is_set():
            raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} while the processes started.")

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    try:
        env = join_group(ddp, cfg, rank, world_size, rank)
        freeze_start_up()
        try:
            result = task(cfg, run_path, env)
            ended.set()
        finally:
            env.cleanup()
    except Interrupted as error:
        # All ranks stopped at the same step and saved: a clean exit, so the launcher does not
        # terminate the others mid-exit, and the stop is reported like an error.
        reports.put(("error", rank, (error, "")))
        return
    except Exception as error:
        reports.put(("error", rank, (error if isinstance(error, RunlabError) else None, traceback.format_exc())))
        raise
    if rank == 0:
        reports.put(("result", rank, result))
