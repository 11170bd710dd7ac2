"""parallel=fsdp (FSDP2, framework/parallel/fsdp.py) on CPU: 2 gloo processes.

It trains exactly like parallel=none (per-step losses and final weights, with gradient clipping
over the sharded gradients, with and without accumulation); its checkpoints move both ways
between fsdp and none; a run stopped by SIGTERM while it writes one-file checkpoints, resumed
with resume=auto writing sharded ones, killed with kill -9 and resumed again, reaches the
uninterrupted weights (tests/test_sharded_checkpoints.py has the rest of sharded checkpoints);
and each process holds about half the bytes of parameters, gradients and optimizer state that
ddp's do. (trainer.compile under fsdp: tests/test_compile.py.)
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn

from conftest import REPO, SHRINK, read_metrics
from framework import parallel
from framework.entry import resolved_run_config, run
from framework.errors import ConfigError, ResourceError
from framework.optimizer import fused_update_fits
from framework.parallel import Compile, plain_named_parameters
from framework.parallel.fsdp import ShardedEnvironment, compiled_blocks, shard_blocks
from framework.private_apis import compiled_original
from test_faults import wait_for
from test_parallel import EXACT, assert_same_training, final_weights, gone, running_losses, worker_pids
from test_schedule import saved_mid_epoch

sys.path.insert(0, str(REPO / "benchmarks"))
from parallel_modes import trained_state_bytes  # noqa: E402

# Clipping that binds at every step: a norm computed over one shard only would clip differently.
CLIPPED = [*EXACT, "trainer.gradient_clip_val=0.1"]
FSDP = ["parallel=fsdp", "parallel.world_size=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The parallel=none run fsdp is compared with."""
    root = tmp_path_factory.mktemp("reference")
    run([*SHRINK, *CLIPPED, f"paths.output_dir={root / 'outputs'}"], run_dir=str(root / "run"))
    return root / "run"


def test_blocks_are_top_level_children_or_the_named_classes():
    model = nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    assert shard_blocks(model, []) == [model[1], model[2]]  # Flatten holds no parameters
    assert shard_blocks(model, ["Linear"]) == [model[1][0], model[2]]
    assert shard_blocks(model, ["Sequential"]) == [model]  # outermost only
    with pytest.raises(ConfigError, match=r"parallel.shard_modules=\['Block'\] names no module of Sequential"):
        shard_blocks(model, ["Block"])


def test_with_trainer_compile_each_block_is_compiled_in_its_place_and_keeps_its_plain_names():
    model = nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    blocks = shard_blocks(model, [])
    plain = {id(parameter): name for name, parameter in model.named_parameters()}
    compiled = compiled_blocks(model, blocks, Compile("aot_eager", None))
    assert [compiled_original(block) for block in compiled] == blocks and list(model.children())[1:] == compiled
    assert [name for name, _ in model.named_parameters()][0] == "1._orig_mod.0.weight"
    assert {id(value): name for name, value in plain_named_parameters(model)} == plain  # the names checkpoints hold
    with pytest.raises(ConfigError, match=r"parallel.shard_modules names Sequential, the model itself"):
        compiled_blocks(model, [model], Compile("aot_eager", None))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.precision=fp16"], "trainer.precision=fp16 is not supported with parallel=fsdp"),
    (["checkpoint.every_minutes=5"], "checkpoint.every_minutes=5.0 is not supported with parallel=fsdp"),
])
def test_what_fsdp_cannot_do_is_refused_before_any_process_starts(train, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(*FSDP, *overrides)


def test_over_sharded_parameters_adam_and_adamw_get_the_fused_update_and_sgd_torchs_loop():
    """torch shards Adam's and AdamW's fused update over DTensors, not SGD's: optimizer.fused gives it
    where it runs (the equality with one device below trains with it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
        params = list(model.parameters())
        assert fused_update_fits({"_target_": "torch.optim.AdamW"}, params, model)
        assert fused_update_fits({"_target_": "torch.optim.Adam"}, params, model)
        assert not fused_update_fits({"_target_": "torch.optim.SGD"}, params, model)
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(NotImplementedError, match="_fused_sgd_.default does not have a sharding strategy"):
            torch.optim.SGD(params, lr=0.1, fused=True).step()
        # An unfused update's checkpoint is loaded as the fused one needs it (test_training.py's case, under fsdp):
        # a float64 step count stands for one on another device, which torch moves only where the group says fused.
        env, unfused = ShardedEnvironment(device=torch.device("cpu")), torch.optim.AdamW(params, fused=False)
        unfused.step()
        state = env.optimizer_state(model, unfused)
        for saved in state["state"].values():
            saved["step"] = saved["step"].double()
        unfused.zero_grad(set_to_none=True)  # as at a resume, before any step: torch builds the state to load into
        fused = torch.optim.AdamW(params, fused=True)
        env.load_optimizer_state(model, fused, state)
        assert [saved["step"].dtype for saved in fused.state.values()] == [torch.float32, torch.float32]
        fused.step()
    finally:
        dist.destroy_process_group()


def test_a_training_step_out_of_memory_ends_the_run_without_a_collective():
    """A process that ran out cannot meet the others (they wait inside FSDP's collectives); a healthy one asks
    nobody (no process group here: a collective would fail)."""
    env = ShardedEnvironment(device=torch.device("cpu"))
    assert env.processes_out_of_memory(nn.Linear(2, 2), ran_out=False) == 0
    with pytest.raises(ResourceError, match="parallel=fsdp cannot retry it at a smaller micro-batch"):
        env.processes_out_of_memory(nn.Linear(2, 2), ran_out=True)


@pytest.mark.timeout(300)
def test_fsdp_equals_one_device_moves_its_checkpoints_both_ways_and_holds_half_the_bytes(train, reference, tmp_path):
    # Each process also splits its half of the batch into 2 micro-batches (no gradient sync on the first).
    metrics, run_dir = train(*CLIPPED, *FSDP, "trainer.accumulate_grad_batches=2")
    assert_same_training(run_dir, reference, tolerance=1e-5)
    assert metrics == read_metrics(run_dir)
    assert "parallel=fsdp: starting 2 processes" in (run_dir / "train.log").read_text()
    for trained in (run_dir, reference):  # both with AdamW's fused update (optimizer.fused, the default)
        assert torch.load(trained / "checkpoints/last.pt", weights_only=False)["optimizer"]["param_groups"][0]["fused"]
    # A third epoch: from the fsdp checkpoint under none, and from the none checkpoint under fsdp
    # (without accumulation), each equal to none continuing its own.
    third = [*SHRINK, *CLIPPED, "trainer.max_epochs=3", f"paths.output_dir={tmp_path}"]
    expected, replica = continued(third, reference, tmp_path / "expected")
    from_fsdp, _ = continued(third, run_dir, tmp_path / "from_fsdp")
    to_fsdp, shard = continued([*third, *FSDP], reference, tmp_path / "to_fsdp")
    # Equal losses at each step of the third epoch: the optimizer's moments came along too.
    torch.testing.assert_close(torch.tensor(running_losses(to_fsdp)), torch.tensor(running_losses(expected)), rtol=0,
                               atol=1e-5)
    for run_dir in (to_fsdp, from_fsdp):
        for name, value in final_weights(expected).items():
            torch.testing.assert_close(final_weights(run_dir)[name], value, rtol=0, atol=1e-5, msg=name)
    # ddp holds a whole replica of the parameters, gradients and optimizer state on every process, as
    # parallel=none's one process does; each fsdp process holds a shard of each, the loaded state included.
    assert replica["optimizer state"] > replica["parameters"] > 10_000  # AdamW: two moments per parameter
    for kind, size in replica.items():
        assert 0.45 < shard[kind] / size < 0.55, (kind, shard, replica)


def continued(overrides: List[str], run_dir: Path, new_run_dir: Path) -> Tuple[Path, Dict[str, int]]:
    """A run resumed from ``run_dir``'s last.pt, and the bytes of state its rank 0 held at the end."""
    cfg = resolved_run_config([*overrides, f"resume={run_dir / 'checkpoints/last.pt'}"])
    return new_run_dir, parallel.launch(trained_state_bytes, cfg, new_run_dir)["bytes"]


# 95 steps, checkpointed every 4: each stop comes mid-run.
STOPPED = ["trainer.max_epochs=5", "batch_size=64", "model.width=32", "early_stopping.enabled=false", "logger=none",
           "checkpoint.every_n_steps=4"]


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory) -> Path:
    """The parallel=none run, never stopped, whose weights each stopped and resumed run must reach."""
    root = tmp_path_factory.mktemp("never_stopped")
    run([*SHRINK, *STOPPED, f"paths.output_dir={root / 'outputs'}"], run_dir=str(root / "run"))
    return root / "run"


@pytest.mark.timeout(300)
def test_sigterm_then_kill_9_each_resumed_with_resume_auto_reach_the_uninterrupted_weights(never_stopped, user,
                                                                                          tmp_path):
    """One run, stopped twice, covers both faults and both checkpoint formats: it writes one-file checkpoints
    and is stopped by SIGTERM (to the launcher alone, as `kill PID` sends it: it passes it on to the workers,
    which save the step they are at), exiting 143 with one line; resumed with resume=auto and
    checkpoint.sharded=true (a resume may change the format: it reads the single file and writes shards), it is
    killed with kill -9 after a later, sharded, mid-epoch checkpoint; resumed again from that one, it ends on the
    weights of a run never stopped. Covered: SIGTERM with a one-file checkpoint, kill -9 with a sharded one."""
    args = ["parallel=fsdp", "name=stopped", *STOPPED, "trainer.progress_bar=false"]
    log = tmp_path / "first.log"
    process = user.start(shlex.join(["python", "run.py", *args]), log)
    wait_for(lambda: saved_mid_epoch(lambda: user.outputs.glob("stopped/*/checkpoints/last.pt")), process, log)
    stop(process, os.kill, signal.SIGTERM, exits=128 + signal.SIGTERM)  # the launcher alone, as `kill PID` does
    console = log.read_text()
    (line,) = [line for line in console.splitlines() if "runlab: interrupted:" in line]
    assert console.rstrip().endswith(line) and "Traceback" not in console, console[-3000:]
    stopped_at = int(re.fullmatch(r"runlab: interrupted: SIGTERM at step (\d+) \(epoch \d+\); saved outputs/stopped/"
                                  r"\S+\. Continue with resume=auto\.", line)[1])
    (first,) = user.runs("stopped")
    sharded = [*args, "checkpoint.sharded=true", "resume=auto"]
    log = tmp_path / "second.log"
    process = user.start(shlex.join(["python", "run.py", *sharded]), log)
    wait_for(lambda: saved_mid_epoch(lambda: (path for path in user.outputs.glob("stopped/*/checkpoints/last.pt")
                                              if first not in path.parents)), process, log)
    stop(process, os.killpg, signal.SIGKILL, exits=-signal.SIGKILL)
    # The last resume=auto in this process (one process start fewer: the two above were typed as a user types them).
    run([*sharded, f"paths.output_dir={user.outputs}"])
    second, third = user.runs("stopped")[1:]
    # SIGTERM saved one file, which its resume read (saying the format changed); kill -9 left shards, read last.
    assert resumed(second) == (f"{first.name}/checkpoints/last.pt", stopped_at)
    assert "checkpoint.sharded: False -> True" in (second / "train.log").read_text()
    source, step = resumed(third)
    assert source == f"{second.name}/checkpoints/last.pt" and step > stopped_at
    assert (second / "checkpoints/last.pt").is_symlink() and not (first / "checkpoints/last.pt").is_symlink()
    assert read_metrics(third)["step"] == 5 * 19  # 1,257 train samples: 19 batches of 64
    for name, value in final_weights(never_stopped).items():
        torch.testing.assert_close(final_weights(third)[name], value, rtol=0, atol=1e-5, msg=name)


def stop(launcher: subprocess.Popen, send: Callable[[int, int], None], signum: int, exits: int) -> None:
    """``send(launcher.pid, signum)`` (os.kill or os.killpg) stops the fsdp run ``launcher`` leads: it exits
    with ``exits``, and no worker outlives it."""
    workers = worker_pids(launcher.pid)
    send(launcher.pid, signum)
    assert launcher.wait(timeout=60) == exits
    assert all(gone(pid) for pid in workers), "an fsdp worker outlived its launcher"


def resumed(run_dir: Path) -> Tuple[str, int]:
    """The checkpoint ``run_dir``'s run resumed (from its run dir on) and its step."""
    found = re.search(r"Resumed from \S+/stopped/(\S+) at step (\d+) \(epoch \d+\)\.",
                      (run_dir / "train.log").read_text())
    return found[1], int(found[2])
