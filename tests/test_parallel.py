"""parallel=none|dp|ddp|model: each mode trains exactly like parallel=none, on CPU.

Equivalence is checked on the shipped MLP (no dropout, no BatchNorm) with the same seed and
data order: the training loss of every step (the CSV logger at log_every_n_steps=1) and the
final weights in checkpoints/last.pt. Multi-process tests carry time limits, so a hang fails loudly.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import pickle
import re
import shlex
import signal
import socket
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from hydra.utils import get_object
from omegaconf import OmegaConf
from torch import nn

from conftest import SHRINK, aids_on_path, composed, read_metrics
from framework.checkpoint import load_checkpoint
from framework.config import OPTIONS
from framework.errors import ConfigError
from framework.entry import run
from framework.model import MLP
from framework.parallel import mode
from framework.parallel.pipeline import Pipeline, balanced_boundaries, check_boundaries, stage_boundaries
from parallel_models import TwoBranch
from test_logging import read_events

# Two short epochs of 9 steps, every step logged, so losses can be compared step by step.
EXACT = ["trainer.max_epochs=2", "batch_size=128", "logger=csv", "trainer.log_every_n_steps=1"]


def running_losses(run_dir: Path) -> List[float]:
    """The epoch's running mean training loss after every step, as the CSV logger recorded it.

    Two runs agree here at every step exactly when their per-step losses agree; the means are
    compared rather than losses recovered from them, which would multiply the float32 rounding
    of the logged means by the step's position in its epoch.
    """
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [float(row["value"]) for row in csv.DictReader(handle) if row["metric"] == "train/loss_running"]


def final_weights(run_dir: Path) -> Dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


def assert_same_training(run_dir: Path, reference: Path, tolerance: float) -> None:
    losses, expected = running_losses(run_dir), running_losses(reference)
    assert len(losses) == len(expected) > 10
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=tolerance)
    weights, expected_weights = final_weights(run_dir), final_weights(reference)
    assert list(weights) == list(expected_weights)  # the same keys: no "module." prefix
    for name in expected_weights:
        torch.testing.assert_close(weights[name], expected_weights[name], rtol=0, atol=tolerance, msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The parallel=none run every mode is compared with."""
    root = tmp_path_factory.mktemp("reference")
    run([*SHRINK, *EXACT, f"paths.output_dir={root / 'outputs'}"], run_dir=str(root / "run"))
    return root / "run"


# --- split and balance arithmetic (no process group) ----------------------------------------

def test_balanced_boundaries_minimise_the_largest_stage():
    assert balanced_boundaries([1, 4, 4, 1], 2) == [2]
    # The default MLP on digits: flatten, block0, block1, head.
    assert balanced_boundaries([0, 16640, 65792, 2570], 2) == [2]
    assert balanced_boundaries([0, 16640, 65792, 2570], 3) == [2, 3]
    assert balanced_boundaries([5, 1, 1, 1, 1, 1], 3) == [1, 2]  # ties: the earliest cut points
    assert balanced_boundaries([3, 3, 3], 3) == [1, 2]
    assert balanced_boundaries([7], 1) == []
    with pytest.raises(ValueError):
        balanced_boundaries([1, 2], 3)


def test_explicit_split_is_checked():
    check_boundaries([1, 3], layers=4, stages=3)
    for bad in ([1], [3, 1], [0, 2], [1, 4], [2, 2]):
        with pytest.raises(ConfigError, match="parallel.split"):
            check_boundaries(bad, layers=4, stages=3)


def test_a_model_that_cannot_be_split_is_refused_clearly():
    with pytest.raises(ConfigError, match="TwoBranch is not one"):
        stage_boundaries(TwoBranch([8], 3), 2, [])
    with pytest.raises(ConfigError, match="only 4 top-level layers"):
        stage_boundaries(MLP([8], 3, width=4, depth=2, dropout=0.0, batch_norm=False), 5, [])


def test_pipeline_overlaps_stages_and_matches_the_plain_model():
    torch.manual_seed(0)
    model = MLP([8], 3, width=16, depth=2, dropout=0.0, batch_norm=False)
    x = torch.randn(12, 8)
    expected = model(x)
    pipeline = Pipeline(model, [torch.device("cpu")] * 2, balanced_boundaries([1, 1, 1, 1], 2), microbatches=3)
    calls = []
    for s, stage in enumerate(pipeline.stages):
        stage.register_forward_hook(lambda _module, _input, _output, s=s: calls.append(s))
    torch.testing.assert_close(pipeline(x), expected, rtol=0, atol=1e-6)
    # Tick 1 runs stage 0 on micro-batch 1 and stage 1 on micro-batch 0, and so on (GPipe);
    # without pipelining it would be 0, 0, 0, 1, 1, 1.
    assert calls == [0, 0, 1, 0, 1, 1]
    assert {k for k in pipeline.state_dict()} == {f"module.{k}" for k in model.state_dict()}


# --- single-process modes --------------------------------------------------------------------

@pytest.mark.parametrize("stages, microbatches, split", [(2, 1, ""), (2, 4, ""), (3, 3, ""), (3, 5, "[1,3]")])
def test_model_parallel_equals_one_device(train, reference, stages, microbatches, split):
    devices = "[" + ",".join(["cpu"] * stages) + "]"
    overrides = [*EXACT, "parallel=model", f"parallel.devices={devices}", f"parallel.microbatches={microbatches}"]
    _, run_dir = train(*overrides, *([f"parallel.split={split}"] if split else []))
    assert_same_training(run_dir, reference, tolerance=1e-6)
    assert f"stage {stages - 1} on cpu" in (run_dir / "train.log").read_text()


def test_model_parallel_refuses_a_model_it_cannot_split(train):
    with pytest.raises(ConfigError, match="nn.Sequential-like"):
        train("parallel=model", "model._target_=parallel_models.TwoBranch")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="parallel=dp runs the model unwrapped on fewer than 2 GPUs")
def test_dp_equals_one_device(train, reference):
    _, run_dir = train(*EXACT, "parallel=dp")
    assert_same_training(run_dir, reference, tolerance=1e-5)


def test_dp_wraps_the_model_in_data_parallel_only_over_two_gpus_or_more(caplog):
    """Which environment parallel=dp picks, and what its wrap makes of a model: nn.DataParallel over
    the GPUs where there are 2 or more, the plain model on cpu."""
    from framework.parallel import DataParallelEnvironment, setup

    model = nn.Linear(2, 2)
    on_cpu = setup(composed("parallel=dp", "device=cpu"))
    assert not isinstance(on_cpu, DataParallelEnvironment) and on_cpu.wrap(model) is model
    assert caplog.text.count("parallel=dp needs at least 2 GPUs but this run is on cpu") == 1
    if torch.cuda.device_count() >= 2:
        on_gpus = setup(composed("parallel=dp", "device=cuda"))
        wrapped = on_gpus.wrap(model)
        assert isinstance(wrapped, nn.DataParallel) and wrapped.device_ids == list(range(torch.cuda.device_count()))
        assert wrapped.module is model


@pytest.mark.parametrize("name", sorted(OPTIONS["parallel"]))
def test_a_parallel_option_s_keys_are_its_mode_s_constructor_arguments(train, name):
    """``instantiate(cfg.parallel)`` builds the option's Mode from exactly its keys, which the mode
    carries (the code reads them there); a spawned ddp worker gets it pickled."""
    cfg = composed(f"parallel={name}")
    keys = OmegaConf.to_container(cfg.parallel)
    built = mode(cfg)
    assert type(built) is get_object(keys.pop("_target_"))
    assert {f.name: getattr(built, f.name) for f in dataclasses.fields(built)} == keys
    assert pickle.loads(pickle.dumps(built)) == built
    with pytest.raises(ConfigError, match=f"parallel.extra is not a key of parallel={name}"):
        composed(f"parallel={name}", "parallel.extra=1")  # refused while composing, by the option's schema
    with pytest.raises(ConfigError, match="parallel.extra is not an argument of"):
        train(f"parallel={name}", "+parallel.extra=1")  # added with +: refused before the mode is built


@pytest.mark.parametrize("overrides, message", [
    (["parallel=pipeline"], "Could not find 'parallel/pipeline' Available options in 'parallel': ddp dp fsdp model none"),
    (["parallel=model", "parallel.microbatches=0"], "parallel.microbatches=0 is invalid"),
    (["parallel=model", "parallel.split=[2,1]"], "parallel.split=[2, 1] is invalid"),
    (["parallel=ddp", "parallel.world_size=-1"], "parallel.world_size=-1 is invalid"),
    (["parallel=ddp", "parallel.backend=mpi"], "parallel.backend='mpi' is not allowed; choose one of auto, nccl, gloo."),
    # Each mode has only its own keys.
    (["parallel.world_size=2"], "parallel.world_size is not a key of parallel=none; it has none to set."),
    (["parallel=dp", "parallel.microbatches=2"], "parallel.microbatches is not a key of parallel=dp; its keys are: devices."),
])
def test_invalid_parallel_values_are_refused_in_one_sentence(train, overrides, message):
    with pytest.raises(ConfigError) as error:
        train(*overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["batch_size=63"], "batch_size=63 does not divide among 2 processes"),
    (["parallel.sync_batchnorm=true"], "parallel.sync_batchnorm=true needs CUDA"),
    (["parallel.backend=nccl"], "parallel.backend='nccl' needs CUDA"),
    (["device=cuda"], "CUDA is not available"),
])
def test_impossible_ddp_combinations_are_refused_before_spawning(train, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train("parallel=ddp", *overrides)


def test_more_ddp_processes_than_gpus_is_refused(monkeypatch):
    from framework.parallel.distributed import process_count

    def count(*overrides: str) -> int:
        cfg = composed("parallel=ddp", *overrides)
        return process_count(mode(cfg), cfg)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert count("device=cuda") == 2  # world_size=0: one per GPU
    with pytest.raises(ConfigError, match="parallel.world_size=4 is larger than the 2 visible GPUs"):
        count("device=cuda", "parallel.world_size=4")
    assert count("device=cpu", "parallel.world_size=4") == 4


# --- ddp: 2 gloo processes --------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_ddp_equals_one_device_and_its_checkpoint_resumes_under_another_mode(train, reference):
    # Each process also splits its half of the batch into 2 micro-batches (no_sync on the first).
    metrics, run_dir = train(*EXACT, "parallel=ddp", "parallel.world_size=2", "trainer.accumulate_grad_batches=2")
    assert_same_training(run_dir, reference, tolerance=1e-5)
    assert metrics == read_metrics(run_dir)  # rank 0's metrics came back to the caller
    # Each rank scored its share of val and test: the metrics summed over both are the whole split's.
    scores = {key: value for key, value in read_metrics(reference).items() if key.startswith(("val/", "test/"))}
    assert {key: metrics[key] for key in scores} == pytest.approx(scores, abs=1e-5)
    log = (run_dir / "train.log").read_text()
    assert "starting 2 processes" in log and log.count("epoch 2  step") == 1  # rank 0 alone logs
    # One more epoch from each checkpoint: the ddp one under parallel=model, the other under none.
    _, continued = train(*EXACT, "trainer.max_epochs=3", "parallel=model", f"resume={run_dir / 'checkpoints/last.pt'}")
    _, expected = train(*EXACT, "trainer.max_epochs=3", f"resume={reference / 'checkpoints/last.pt'}")
    for name, value in final_weights(expected).items():
        torch.testing.assert_close(final_weights(continued)[name], value, rtol=0, atol=1e-5)


# docs/parallelism.md's torchrun command, which tests/test_readme.py leaves to this test.
DOCS_TORCHRUN = "torchrun --nproc_per_node=2 run.py parallel=ddp trainer.max_steps=5"


@pytest.mark.timeout(240)
def test_the_docs_torchrun_command_equals_one_device_in_one_run_dir(train, user):
    """Each torchrun process is a Hydra app: rank 1 makes a run dir of its own, then uses rank 0's and
    removes its own; the 5 steps end on parallel=none's weights and metrics. (Two epochs, each step's
    loss compared, under torchrun: the two-node test below.)"""
    done = user.run(DOCS_TORCHRUN, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = user.runs("train")
    assert "rank 1 of 2 joined the group" in (done.stdout + done.stderr)
    _, expected = train("trainer.max_steps=5", shrink=False)
    assert read_metrics(run_dir)["step"] == 5
    for key in SAME_UNDER_EITHER:
        assert read_metrics(run_dir)[key] == pytest.approx(read_metrics(expected)[key], abs=1e-5), key
    for name, value in final_weights(expected).items():
        torch.testing.assert_close(final_weights(run_dir)[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("source_tree_stays_clean")
def test_two_torchrun_nodes_on_localhost_are_one_fsdp_run_equal_to_one_device_in_one_run_dir(reference, user, tmp_path):
    # Two machines, as a user types it on each: torchrun with node_rank 0 and 1, one process each. fsdp
    # joins torchrun's group through ddp's own code (as in the SLURM job below), so ddp's joining on two
    # nodes is covered too; ddp's wrapping under torchrun is the docs' one-node command above.
    port = free_port()
    nodes = [user.start(shlex.join(["torchrun", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
                                    "--master_addr=127.0.0.1", f"--master_port={port}", "run.py", "parallel=fsdp",
                                    *SHRINK, *EXACT]), tmp_path / f"node{rank}.log") for rank in (0, 1)]
    try:
        for rank, node in enumerate(nodes):
            assert node.wait(timeout=200) == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    (run_dir,) = user.runs("train")  # node 1's rank used node 0's run dir and removed its own
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run_dir.name)  # the name a plain run gets, no _1
    assert "parallel=fsdp: rank 1 of 2 joined the group at 127.0.0.1" in (tmp_path / "node1.log").read_text()
    assert_same_training(run_dir, reference, tolerance=1e-5)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("source_tree_stays_clean")
def test_a_slurm_job_of_two_tasks_is_one_fsdp_run_of_two_ranks(reference, user):
    # launcher=slurm with submitit's local executor: the job's two tasks are ranks 0 and 1, as on SLURM.
    # fsdp launches through ddp's own code (FSDP.launch is DDP.launch after its checks), so this job
    # covers a ddp job of tasks too; ddp's own wrapping is tested above.
    done = user.run(shlex.join(["python", "run.py", "launcher=slurm", "hydra.launcher.cluster=local",
                                "hydra.launcher.tasks_per_node=2", "parallel=fsdp", *SHRINK, *EXACT]), timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = user.outputs.glob("train/multirun/*/0")
    assert [p.name for p in run_dir.parent.iterdir() if p.is_dir() and not p.name.startswith(".")] == ["0"]
    log = (run_dir / "train.log").read_text()
    assert "parallel=fsdp: rank 0 of 2 joined the group" in log and "parallel=fsdp: rank 1 of 2 joined the group" in log
    assert_same_training(run_dir, reference, tolerance=1e-5)
    # The job ends as any run on the cluster does: with its result (rank 0's) and its run dir.
    last = done.stdout.splitlines()[-1]
    assert last.startswith(f"Best job #0: val/acc {read_metrics(run_dir)['val/acc']:.4g} with ")
    assert last.endswith(f"its run dir: {run_dir.relative_to(user.repo)}")
    assert [path.name for path in (run_dir.parent / ".submitit").iterdir() if "%" in path.name] == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# docs/parallelism.md's command, which tests/test_readme.py leaves to this test.
DOCS_DDP_SWEEP = "python run.py -m parallel=ddp,fsdp trainer.max_steps=5"
SAME_UNDER_EITHER = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "step")


@pytest.mark.timeout(240)
def test_the_docs_ddp_sweep_gives_one_complete_run_dir_per_job(user):
    # The jobs run one after the other in the sweep's process, each spawning its own processes.
    done = user.run(DOCS_DDP_SWEEP, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(p for p in (user.outputs / "train" / "multirun").glob("*/*") if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    for job, name, traced in zip(jobs, ("ddp", "fsdp"), (True, False)):
        for path in (".hydra/config.yaml", "train.log", "metrics.json", "checkpoints/last.pt", "tensorboard"):
            assert (job / path).exists(), job / path
        assert f"parallel={name}: starting 2 processes" in (job / "train.log").read_text()
        # What the job's processes did, not only what its config said: fsdp's trace no graph for TensorBoard.
        assert read_events(job).Tags()["graph"] == traced
    ddp, fsdp = ({key: read_metrics(job)[key] for key in SAME_UNDER_EITHER} for job in jobs)
    assert fsdp == pytest.approx(ddp, abs=1e-5)  # the same 5 steps, each equal to parallel=none's


@pytest.mark.timeout(300)
def test_a_ddp_run_stopped_by_sigterm_resumes_with_resume_auto(train, user, tmp_path):
    """SIGTERM to the launcher alone reaches both workers, which save the step they are at; resume=auto
    ends where an uninterrupted run ends, and no worker outlives the launcher. (kill -9 of a ddp run:
    test_schedule.py, from a mid-epoch checkpoint.)"""
    args = ["parallel=ddp", "name=stopped", "trainer.max_epochs=10", "batch_size=128", "early_stopping.enabled=false",
            "logger=none", "model.width=32"]
    launcher = user.start(shlex.join(["python", "run.py", *args]), tmp_path / "first.log")
    deadline = time.monotonic() + 150
    while not list(user.outputs.glob("stopped/*/checkpoints/last.pt")):
        assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.05)
    workers = worker_pids(launcher.pid)
    os.kill(launcher.pid, signal.SIGTERM)  # the launcher alone, as `kill PID` does
    assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
    assert all(gone(pid) for pid in workers), "a ddp worker outlived its launcher"
    (first,) = user.runs("stopped")
    assert not (first / "metrics.json").exists()  # it really stopped before the end
    assert "runlab: interrupted: SIGTERM at step" in (tmp_path / "first.log").read_text()
    # resume=auto in this process (one process start fewer: the stopped run was typed as a user types it).
    run([*args, "resume=auto", f"paths.output_dir={user.outputs}"])
    second = user.runs("stopped")[-1]
    log = (second / "train.log").read_text()
    resumed_step = int(re.search(r"Resumed from \S+ at step (\d+) \(epoch \d+\)\.", log)[1])
    assert 1 <= resumed_step < 90
    _, reference = train("trainer.max_epochs=10", "batch_size=128", "early_stopping.enabled=false", "logger=none")
    for name, value in final_weights(reference).items():
        torch.testing.assert_close(final_weights(second)[name], value, rtol=0, atol=1e-5)


def worker_pids(launcher: int) -> List[int]:
    """The ddp worker processes the launcher spawned (they leave its process group)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return [int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]


def gone(pid: int, within: float = 30) -> bool:
    """Whether the process ends (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(180)
def test_a_crashing_ddp_worker_takes_the_job_down_with_its_error(cli, user):
    started = time.monotonic()
    done = cli("parallel=ddp", "model._target_=parallel_models.CrashingMLP", "trainer=debug", "trainer.progress_bar=false",
               "model.width=32", "parallel.timeout_s=60", timeout=150, env=aids_on_path(user))
    assert done.returncode != 0
    assert "rank 1 crashed on purpose at its third step" in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 120  # taken down, not left to the 60 s collective timeout


@pytest.mark.timeout(180)
def test_a_ddp_worker_dying_without_a_traceback_takes_the_job_down(train):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="process 1 terminated with exit code 3"):
        train("parallel=ddp", "model._target_=parallel_models.CrashingMLP", "+model.crash=exit", "trainer=debug",
              "parallel.timeout_s=60")
    assert time.monotonic() - started < 120


@pytest.mark.timeout(180)
def test_a_user_error_in_a_ddp_worker_stays_a_config_error(train):
    # Found only when the processes build their trainers (64 samples each, in 3 micro-batches), and
    # re-raised as itself, so run.py prints its one sentence instead of a worker's traceback.
    with pytest.raises(ConfigError, match="accumulate_grad_batches=3 does not divide the per-process batch of 64"):
        train("parallel=ddp", "batch_size=128", "trainer.accumulate_grad_batches=3")
