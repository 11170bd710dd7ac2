"""Every benchmark script runs to its table, as a user types it, with the smallest arguments it takes.

The figures of so short a run mean nothing and are not checked; what is checked is that the script
still runs against today's code (a signature it calls may have changed: ddp_overhead.py's hand-written
loop once failed at its start unseen), prints every row of its table, and appends what it printed to
benchmarks/RESULTS.md under the command that ran. startup.py is not run: it prints the table that
``step_overhead.py --cold-start`` prints, with the same code.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal

import pytest

SCRIPTS = {
    "step_overhead.py --epochs 2 --rounds 1": [
        "hand-written ", "hand-written + checkpoint", "hand-written, unfused", "runlab defaults", "runlab bare",
        "runlab defaults / hand-written + checkpoint:", "runlab bare / hand-written:"],
    "step_overhead.py --loader dataloader --workers 1 --epochs 1 --rounds 1": [
        "DataLoaders, 1 workers", "hand-written ", "runlab defaults", "runlab bare / hand-written:"],
    "step_overhead.py --cold-start --rounds 1": [
        "import torch", "hand-written 1 step", "Hydra app 1 step", "... collector paused", "run.py max_steps=1",
        "run.py --help", "run.py --cfg job", "(target <= +0.15 s)"],
    "compile.py --steps 2 --rounds 1 --backend aot_eager": ["digits_cnn", "mlp 1024x4"],
    "ddp_overhead.py --steps 2 --repeats 1 --width 64 --depth 2 --input 64 --batch 32": [
        "| hand-written DDP |", "| runlab, oom_recovery=true |", "| runlab, oom_recovery=false |", "OOM recovery's cost"],
    "oom_recovery.py --repeats 1 --epochs 1": ["wall recovering / settled:", "cpu  restarting / settled:"],
    "parallel_modes.py --steps 2": ["| none |", "| ddp x2 |", "| fsdp x2 |", "| model x2 (cpu,cpu) |", "| dp (cpu: unwrapped) |"],
    "pruning.py --trials 2 --epochs 2 --seeds 0": ["seed 0: without pruning", "1 pairs of 2-trial TPE sweeps"],
    "transfer_vs_scratch.py --seeds 0": ["| 0 |", "| **mean** |", "fine-tuning won"],
    "ray_parallel.py --trials 2 --epochs 2": ["sequential", "Ray on 2 CPUs"],
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("command", SCRIPTS)
def test_a_benchmark_runs_to_its_table_and_records_it(user, command, tmp_path):
    results = user.repo / "benchmarks" / "RESULTS.md"
    before = results.read_text()
    log = tmp_path / "printed.txt"
    started = user.start(f"python benchmarks/{command}", log)  # in a session of its own
    try:
        returncode = started.wait(timeout=360)
    finally:  # whatever it left running (its ddp workers, Ray's processes) goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(started.pid, signal.SIGKILL)
    printed = log.read_text()
    assert returncode == 0, printed[-3000:]
    missing = [row for row in SCRIPTS[command] if row not in printed]
    assert not missing, f"rows not printed: {missing}\n{printed}"
    assert "DataLoader workers running" not in printed  # workers a run left behind
    added = results.read_text()
    assert added.startswith(before)
    section = added[len(before):]
    assert section.startswith(f"\n### `python benchmarks/{command}`\n")
    assert all(row in section for row in SCRIPTS[command])
    if command.startswith("ddp_overhead.py"):  # its three ways are compared: they must train the same model
        trained = re.findall(r"mean train loss ([\d.]+), val acc ([\d.]+)", printed)
        assert len(trained) == 3 and len(set(trained)) == 1, trained

