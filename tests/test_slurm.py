"""launcher=slurm: jobs through hydra-submitit-launcher, typed in a fresh copy of the repository.

There is no SLURM here: the jobs run for real with submitit's local executor
(``hydra.launcher.cluster=local``, the same jobs as processes on this machine), and what SLURM
would be given is read from a stand-in ``sbatch``. A job of two tasks that are one fsdp run (ranks
0 and 1), ending with its result and run dir as every job does, is in test_parallel.py.
"""
from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import one_line_error, read_metrics
from test_search import TINY, end_session, study_states, sweep_dir

pytestmark = pytest.mark.usefixtures("source_tree_stays_clean")


def test_the_slurm_preset_reaches_sbatch_with_its_settings_and_a_refusal_is_one_line(user, tmp_path):
    # A stand-in for SLURM: srun is only looked for; sbatch keeps the job script and refuses it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/job.sh\n'
                                    'echo "sbatch: error: invalid partition specified: gpu" >&2\nexit 1\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    done = user.run("python run.py launcher=slurm parallel=ddp hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=4 "
                    "hydra.launcher.tasks_per_node=4 hydra.launcher.cpus_per_task=8 hydra.launcher.mem_gb=64 "
                    "hydra.launcher.timeout_min=30",
                    env={"PATH": f"{bin_dir}{os.pathsep}{user.repo / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"})
    assert "invalid partition specified: gpu" in one_line_error(done, 5)
    script = (tmp_path / "job.sh").read_text()
    for option in ("--partition=gpu", "--nodes=1", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8",
                   "--mem=64GB", "--time=30", "--requeue", "--signal=USR2@120"):
        assert f"#SBATCH {option}\n" in script, (option, script)


def test_without_slurm_launcher_slurm_says_how_to_run_the_jobs_here(cli):
    line = one_line_error(cli("launcher=slurm", "trainer.max_epochs=1"), 2)
    assert "sbatch and srun, which are not on PATH here" in line and "hydra.launcher.cluster=local" in line


@pytest.mark.timeout(400)
def test_a_sweep_runs_as_jobs_and_a_requeued_trial_continues_from_its_checkpoint(user, tmp_path):
    args = ["search=random", "launcher=slurm", "hydra.launcher.cluster=local", "hydra.sweeper.n_trials=2",
            "hydra.sweeper.n_jobs=2", "trainer.max_epochs=6", "early_stopping.enabled=false"]
    driver = user.start(shlex.join(["python", "run.py", *TINY, *args]), tmp_path / "driver.log")
    directory = sweep_dir(user, "train_random")
    try:  # once a trial is past its first checkpoint, its job gets what SLURM sends before a time limit
        deadline = time.monotonic() + 200
        while (task := checkpointed_task(directory)) is None:
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.1)
        number, pid = task
        os.kill(pid, signal.SIGUSR2)  # submitit requeues the job (its local executor: starts it again)
        assert driver.wait(timeout=240) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        end_session(driver.pid)
    assert study_states(directory) == {0: "COMPLETE", 1: "COMPLETE"}
    log = (directory / str(number) / "train.log").read_text()
    assert "Resumed from" in log  # resume=auto (the preset's): the requeued job continued its own run dir
    assert read_metrics(directory / str(number))["epoch"] == 6


def checkpointed_task(directory: Path) -> Optional[tuple]:
    """(trial number, pid of its job's task) for a trial past its first checkpoint and not done."""
    for number in (0, 1):
        run = directory / str(number)
        if (run / "checkpoints" / "last.pt").is_file() and not (run / "metrics.json").exists():
            pid = task_writing(run / "train.log")
            if pid:
                return number, pid
    return None


def task_writing(log: Path) -> Optional[int]:
    """The submitit task process (python -m submitit.core._submit) that has ``log`` open."""
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            if "submitit.core._submit" not in (fds.parent / "cmdline").read_text():
                continue
            if any(os.readlink(fd) == str(log.resolve()) for fd in fds.iterdir()):
                return int(fds.parent.name)
        except OSError:
            continue
    return None
