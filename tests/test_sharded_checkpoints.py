"""checkpoint.sharded=true (parallel=fsdp, 2 gloo processes on CPU): each process writes its shards.

docs/parallelism.md's run, typed in a fresh copy: its checkpoint resumes exactly, under fsdp
and in one process (parallel=none, which consolidates it); task=eval and task=export read it; a
damaged or foreign one is refused in one line, and a .metadata naming code is never unpickled.
tests/test_fsdp.py has the kill -9 then resume=auto with sharded checkpoints, as a user types it.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import UserShell, read_metrics
from framework.checkpoint import load_checkpoint
from framework.entry import run
from framework.errors import CheckpointError, ConfigError, ResourceError
from test_parallel import final_weights, running_losses

FSDP = ["parallel=fsdp", "parallel.world_size=2", "checkpoint.sharded=true"]
# docs/parallelism.md's command, which tests/test_readme.py leaves to the fixture below.
DOCS_SHARDED_RUN = "python run.py parallel=fsdp checkpoint.sharded=true trainer.max_epochs=2"
# The runs that go on from it keep its model, data and batch size, and log each step's loss.
EACH_STEP = ["trainer.progress_bar=false", "logger=csv", "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, fresh_copy) -> Path:
    """docs/parallelism.md's two epochs of fsdp on 2 processes, with sharded checkpoints, as a user types it."""
    user = UserShell(Path(shutil.copytree(fresh_copy, tmp_path_factory.mktemp("sharded") / "runlab", symlinks=True)))
    done = user.run(DOCS_SHARDED_RUN, timeout=250)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (run_dir,) = user.runs("train")
    return run_dir


def third_epoch(*overrides: str, run_dir: Path) -> Path:
    run([*EACH_STEP, "trainer.max_epochs=3", f"paths.output_dir={run_dir.parent / 'outputs'}", *overrides],
        run_dir=str(run_dir))
    return run_dir


@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_resumes_under_fsdp_and_in_one_process_as_the_single_file_run_goes_on(sharded_run,
                                                                                                  tmp_path):
    last = sharded_run / "checkpoints/last.pt"
    assert last.is_symlink() and last.resolve().parent.name == "sharded"
    shards = [path.stat().st_size for path in last.resolve().glob("__*.distcp")]
    assert len(shards) == 2 and max(shards) < 0.7 * sum(shards)  # each process wrote its own part, none the whole
    # What resuming parallel=none's own single file gives (the same weights as fsdp's after two epochs).
    run(["trainer.max_epochs=2", "trainer.progress_bar=false", f"paths.output_dir={tmp_path / 'outputs'}"],
        run_dir=str(tmp_path / "single_file"))
    expected = third_epoch(f"resume={tmp_path / 'single_file/checkpoints/last.pt'}", run_dir=tmp_path / "expected")
    resumed = {"fsdp": third_epoch(*FSDP, f"resume={last}", run_dir=tmp_path / "fsdp"),
               "none": third_epoch(f"resume={last}", run_dir=tmp_path / "none")}
    for mode, run_dir in resumed.items():
        assert "Resumed from" in (run_dir / "train.log").read_text(), mode
        # Each step of the third epoch equal: the optimizer's moments came back too, not only the weights.
        torch.testing.assert_close(torch.tensor(running_losses(run_dir)),
                                   torch.tensor(running_losses(expected)), rtol=0, atol=1e-5)
        for name, value in final_weights(expected).items():
            torch.testing.assert_close(final_weights(run_dir)[name], value, rtol=0, atol=1e-5, msg=f"{mode}: {name}")
    assert (resumed["fsdp"] / "checkpoints/best.pt").is_symlink()


def test_task_eval_and_export_read_a_sharded_checkpoint_in_one_process(sharded_run, tmp_path):
    evaluated = run(["task=eval", f"ckpt={sharded_run}", f"paths.output_dir={tmp_path}"], run_dir=str(tmp_path / "eval"))
    trained = read_metrics(sharded_run)  # its test after fit read best.pt under fsdp, each process its shards
    for name in ("test/loss", "test/acc"):
        assert evaluated.metrics[name] == pytest.approx(trained[name], abs=1e-6), name
    exported = run(["task=export", f"ckpt={sharded_run / 'checkpoints/last.pt'}", f"paths.output_dir={tmp_path}"],
                   run_dir=str(tmp_path / "export"))
    assert exported.metrics["export/max_abs_diff_weights"] == 0
    manifest = json.loads((tmp_path / "export/artifact/manifest.json").read_text())
    weights = load_file(str(tmp_path / "export/artifact" / manifest["weights"]))
    for name, value in load_checkpoint(sharded_run / "checkpoints/last.pt")["model"].items():
        assert torch.equal(weights[name], value), name


def test_a_damaged_or_foreign_sharded_checkpoint_is_refused_in_one_line(sharded_run, tmp_path):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(sharded_run / "checkpoints/last.pt", tmp_path / name))  # the directory it links to

    truncated = copy("truncated")
    with open(truncated / "__1_0.distcp", "r+b") as handle:
        handle.truncate(1000)
    without_rest = copy("without_rest")
    (without_rest / "runlab.pt").unlink()
    crafted, ran = copy("crafted"), tmp_path / "ran"
    with open(crafted / ".metadata", "wb") as handle:
        pickle.dump(RunsCode(ran), handle)
    pointing_out = copy("pointing_out")  # its metadata names another checkpoint's shard file as its own
    metadata = pickle.loads((pointing_out / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = str((truncated / info.relative_path).resolve())
    (pointing_out / ".metadata").write_bytes(pickle.dumps(metadata))
    refusals = {truncated: "is damaged, or is not this model's sharded checkpoint: its shards cannot be read",
                without_rest: "is damaged: it lacks runlab.pt", crafted: "was refused and not executed",
                pointing_out: r"was refused: its \.metadata names '/.+/truncated/__\d_0\.distcp' as a shard, not one "
                              "of its own"}
    for path, message in refusals.items():
        with pytest.raises(CheckpointError, match=message) as refused:
            load_checkpoint(path)
        assert "\n" not in str(refused.value)
    assert not ran.exists()


def test_a_shard_that_cannot_be_written_ends_in_one_line_naming_why(tmp_path):
    import torch.distributed.checkpoint as dcp

    from framework.parallel.fsdp import shards_not_written

    last, tmp = tmp_path / "checkpoints/last.pt", tmp_path / "checkpoints/sharded/.last.pt.tmp"
    tmp.mkdir(parents=True)
    failed = lambda error: dcp.CheckpointException("save", {1: (error, None)})  # noqa: E731  (as dcp.save raises)
    full = shards_not_written(last, tmp, failed(OSError(errno.ENOSPC, "No space left on device")))
    assert isinstance(full, ResourceError) and str(full).startswith("no space left on device writing")
    denied = shards_not_written(last, tmp, failed(PermissionError(errno.EACCES, "Permission denied")))
    assert isinstance(denied, CheckpointError)
    assert str(denied).endswith("failed (PermissionError: [Errno 13] Permission denied); the previous one is kept.")


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_sharded_checkpoints_are_refused_outside_fsdp_before_any_work(train):
    with pytest.raises(ConfigError, match="checkpoint.sharded=true is only for parallel=fsdp"):
        train("parallel=ddp", "checkpoint.sharded=true")
