"""Fine-tuning (finetune.*), task=eval and task=export, and refusing files that would run code."""
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SHRINK, one_line_error, read_metrics
from docs_pages import assert_in_page_order
from framework.errors import CheckpointError
from framework.checkpoint import load_checkpoint, load_model, save_checkpoint
from framework.errors import ConfigError
from framework.entry import run
from framework.export import load_artifact
from framework.config import TRIAL_VARIABLES

QUIET = ["logger=none"]
LOW_DIGITS, HIGH_DIGITS = "data.classes=[0,1,2,3,4]", "data.classes=[5,6,7,8,9]"


def weights(run_dir: Path, name: str = "last.pt"):
    return load_checkpoint(run_dir / "checkpoints" / name)["model"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A CNN with BatchNorm trained on digits 0-4, shared by the tests that only read it: (metrics, run_dir)."""
    root = tmp_path_factory.mktemp("pretrained")
    overrides = [*SHRINK, f"paths.output_dir={root / 'outputs'}", "model=cnn", "model.batch_norm=true", LOW_DIGITS,
                 "trainer.max_epochs=2", *QUIET]
    result = run(overrides, run_dir=str(root / "run"))
    return result.metrics, result.run_dir


def test_frozen_weights_stay_bit_identical_while_the_new_head_trains(train, pretrained):
    _, source = pretrained
    metrics, run_dir = train(HIGH_DIGITS, f"finetune.from={source}", "finetune.freeze=[conv*]", "lr=5e-3",
                             "trainer.max_epochs=2", *QUIET)
    before, after = weights(source, "best.pt"), weights(run_dir)
    frozen = [k for k in before if k.startswith("conv")]
    assert any("running_mean" in k for k in frozen)  # frozen BatchNorm kept its statistics: it stayed in eval mode
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert not torch.equal(before["head.weight"], after["head.weight"])
    assert not torch.equal(before["dense.0.weight"], after["dense.0.weight"])
    # Frozen parameters never entered the optimizer: it holds the dense block and the head only.
    optimizer = load_checkpoint(run_dir / "checkpoints" / "last.pt")["optimizer"]
    assert [len(g["params"]) for g in optimizer["param_groups"]] == [4]
    frozen_count = sum(before[k].numel() for k in frozen if k.endswith(("weight", "bias")))
    assert f"{frozen_count:,} frozen parameters" in (run_dir / "train.log").read_text()
    assert "Head 'head' re-initialised: the labels differ from the pretraining run" in (run_dir / "train.log").read_text()
    assert metrics["val/acc"] > 0.3


def test_unfreeze_at_epoch_trains_the_backbone_afterwards_at_its_own_rate(train, pretrained):
    _, source = pretrained
    overrides = [HIGH_DIGITS, f"finetune.from={source}", "finetune.freeze=[conv*]", "finetune.unfreeze_at_epoch=1",
                 "finetune.backbone_lr_factor=0.25", *QUIET]
    _, first = train(*overrides, "trainer.max_epochs=1")
    _, full = train(*overrides, "trainer.max_epochs=3", "trainer.max_steps=18")  # stops after epoch 2 of 3
    before = weights(source, "best.pt")
    assert torch.equal(before["conv0.0.weight"], weights(first)["conv0.0.weight"])  # still frozen in epoch 0
    assert not torch.equal(before["conv0.0.weight"], weights(full)["conv0.0.weight"])  # trained from epoch 1
    assert not torch.equal(before["conv0.1.running_mean"], weights(full)["conv0.1.running_mean"])
    groups = load_checkpoint(full / "checkpoints" / "last.pt")["optimizer"]["param_groups"]
    assert groups[1]["lr"] == pytest.approx(groups[0]["lr"] * 0.25)
    # The optimizer had both groups from the start, so a resumed run loads its state as is.
    metrics, resumed = train(*overrides, f"resume={full / 'checkpoints' / 'last.pt'}")
    assert metrics["epoch"] == 3 and not torch.equal(weights(full)["conv0.0.weight"], weights(resumed)["conv0.0.weight"])


def test_strict_loading_reports_mismatched_keys_and_non_strict_loads_the_rest(train):
    _, source = train(LOW_DIGITS, "trainer.max_epochs=1", *QUIET)  # an MLP of width 32, depth 2
    deeper = [LOW_DIGITS, f"finetune.from={source}", "model.depth=3", "trainer.max_epochs=1", *QUIET]
    with pytest.raises(CheckpointError, match=r"missing: block2\.0\.weight, block2\.0\.bias\); set finetune\.strict=false"):
        train(*deeper)
    _, run_dir = train(*deeper, "finetune.strict=false")
    assert "matched 6 tensors; re-initialised 2 (head 0, missing 2, shape-mismatched 0); ignored 0 from the file (none)" \
        in (run_dir / "train.log").read_text()
    _, run_dir = train(LOW_DIGITS, f"finetune.from={source}", "model.width=48", "finetune.strict=false",
                       "trainer.max_epochs=1", *QUIET)
    assert "matched 0 tensors; re-initialised 6 (head 2, missing 0, shape-mismatched 4); ignored 6 from the file " \
           "(block0.0.weight, block0.0.bias, block1.0.weight, block1.0.bias, head.weight ...)" in (run_dir / "train.log").read_text()


def test_a_freeze_pattern_that_matches_nothing_is_refused(train, pretrained):
    with pytest.raises(ConfigError, match=r"finetune.freeze pattern 'features\.\*' matches no parameter of CNN.*conv0"):
        train(HIGH_DIGITS, f"finetune.from={pretrained[1]}", "finetune.freeze=[features.*]", *QUIET)


def test_a_model_without_head_name_needs_finetune_head_when_the_labels_change(train):
    _, source = train("model=custom", "model._target_=usermodels.TinyNet", LOW_DIGITS, "trainer.max_epochs=1", *QUIET, shrink=False)
    with pytest.raises(ConfigError, match="TinyNet declares no head_name.*finetune.head=MODULE"):
        train(HIGH_DIGITS, f"finetune.from={source}", "trainer.max_epochs=1", *QUIET)
    _, run_dir = train(HIGH_DIGITS, f"finetune.from={source}", "finetune.head=net.3", "finetune.freeze=[net.1.*]",
                       "trainer.max_epochs=1", *QUIET)
    assert "matched 2 tensors; re-initialised 2 (head 2, missing 0, shape-mismatched 0)" in (run_dir / "train.log").read_text()
    before, after = weights(source), weights(run_dir)
    assert torch.equal(before["net.1.weight"], after["net.1.weight"]) and not torch.equal(before["net.3.weight"], after["net.3.weight"])


# docs/finetune.md's fine-tuning and from-scratch commands, and the block that loads the result, which
# test_readme leaves to the test below (the page's first command, the pretraining, stays a README step).
DOCS_FINETUNE = 'python run.py experiment=digits_finetune'
DOCS_SCRATCH = 'python run.py experiment=digits_finetune finetune.from="" "finetune.freeze=[]"'
DOCS_LOAD = """import framework

model = framework.load_model("outputs/digits_finetune")  # its latest run's best.pt
print(model.classes)  # ['1', '3', '5', '7', '9']: the label of each output"""


def test_the_example_pair_beats_the_same_budget_from_scratch_by_5_points_as_a_user_types_it(user):
    """The two commands of experiments/digits_finetune.yaml's comment (and of docs/finetune.md), verbatim,
    at the default seed: fine-tuning (which runs digits_pretrain first, as there is none yet), then the
    same budget from scratch, then the page's load of the latest. benchmarks/transfer_vs_scratch.py gives
    the gain over 10 seeds."""
    example = (user.repo / "experiments" / "digits_finetune.yaml").read_text()
    commands = [line.lstrip("#").strip() for line in example.splitlines() if line.startswith("#   python run.py")]
    assert commands == [DOCS_FINETUNE, DOCS_SCRATCH]
    assert_in_page_order("docs/finetune.md", DOCS_FINETUNE, DOCS_SCRATCH, DOCS_LOAD)
    for command in commands:
        done = user.run(command, timeout=400)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    loaded = user.run(f"python -c {shlex.quote(DOCS_LOAD)}")
    assert loaded.stdout.splitlines()[-1] == "['1', '3', '5', '7', '9']", loaded.stderr[-3000:]
    assert len(user.runs("digits_pretrain")) == 1
    tuned_dir, scratch_dir = user.runs("digits_finetune")
    tuned, scratch = read_metrics(tuned_dir), read_metrics(scratch_dir)
    log = (tuned_dir / "train.log").read_text()
    assert "architecture framework.model.ResNet from the checkpoint" in log and "25 train / 136 val samples" in log
    assert "Head 'head' re-initialised: the labels differ from the pretraining run" in log
    assert "Frozen by finetune.freeze=['stem.*']" in log
    assert "trainable, 0 frozen parameters; 25 train / 136 val samples" in (scratch_dir / "train.log").read_text()
    assert tuned["epoch"] == scratch["epoch"] == 30
    # The bar. With the suite's one thread this measured 0.882 against 0.750; with two, 0.868 against 0.750.
    assert tuned["test/acc"] - scratch["test/acc"] >= 0.05, (tuned["test/acc"], scratch["test/acc"])


def test_eval_scores_the_test_split_and_reproduces_the_training_runs_metrics_exactly(train, cli, user):
    metrics, run_dir = train("data.classes=[1,3,5,7]", *QUIET)
    best = cli("task=eval", f"ckpt={run_dir}")  # a run dir means its best checkpoint
    assert best.returncode == 0, best.stderr
    written = read_metrics(user.runs("eval")[0])
    assert written["test/acc"] == metrics["test/acc"] and written["test/loss"] == metrics["test/loss"]
    assert f"test/acc {metrics['test/acc']:.6f}" in best.stdout + best.stderr
    assert "test/acc by label: 1 " in best.stdout and {"test/acc/1", "test/acc/7"} <= set(written)
    last, _ = train("task=eval", f"ckpt={run_dir / 'checkpoints' / 'last.pt'}", "eval.split=val", shrink=False)
    assert last["val/acc"] == metrics["val/acc"] and last["val/loss"] == metrics["val/loss"]


def test_export_round_trip_gives_equal_outputs_without_this_project(train, tmp_path):
    _, run_dir = train("model=cnn", "model.batch_norm=true", "trainer.max_epochs=1", *QUIET)
    metrics, export_dir = train("task=export", f"ckpt={run_dir}", shrink=False)
    artifact = export_dir / "artifact"
    assert metrics == {"export/max_abs_diff_weights": 0.0, "export/max_abs_diff_program": 0.0}
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["program"] == "model.pt2" and manifest["weights"] == "weights.safetensors"
    assert manifest["labels"] == [str(digit) for digit in range(10)]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in artifact.iterdir()), "readable by the group and others"
    original = load_model(run_dir / "checkpoints" / "best.pt")
    batch = torch.randn(5, 1, 8, 8)
    assert torch.equal(load_artifact(artifact)(batch), original(batch))
    assert all(torch.equal(v, original.state_dict()[k]) for k, v in load_file(str(artifact / "weights.safetensors")).items())
    torch.save(batch, tmp_path / "batch.pt")
    # A clean interpreter, outside the repo and without it on the path, runs the program.
    script = ("import sys, torch; m = torch.export.load(sys.argv[1]).module(); "
              "torch.save(m(torch.load(sys.argv[2])), sys.argv[3]); print('framework' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script, str(artifact / "model.pt2"), str(tmp_path / "batch.pt"),
                           str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt"), original(batch))


def test_export_falls_back_to_torchscript_when_torch_export_fails(train, monkeypatch):
    _, run_dir = train("trainer.max_epochs=1", *QUIET)

    def cannot_capture(*args, **kwargs):
        raise RuntimeError("unsupported operator")

    monkeypatch.setattr(torch.export, "export", cannot_capture)
    metrics, export_dir = train("task=export", f"ckpt={run_dir}", shrink=False)
    assert json.loads((export_dir / "artifact" / "manifest.json").read_text())["program"] == "model.ts"
    assert metrics["export/max_abs_diff_program"] == 0.0


class Payload:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_files_that_would_run_code_are_refused_and_never_executed(train, cli, tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"format": "runlab-checkpoint", "model": Payload(marker)}, evil)
    # The payload is live: the same kind of file loaded without weights_only runs it.
    torch.save({"model": Payload(tmp_path / "live")}, tmp_path / "live.pt")
    torch.load(tmp_path / "live.pt", weights_only=False)
    assert (tmp_path / "live").is_dir()

    with pytest.raises(CheckpointError, match="refused and not executed"):
        load_model(evil)
    with pytest.raises(CheckpointError, match="refused and not executed"):
        train(f"finetune.from={evil}", *QUIET)
    result = cli("task=eval", f"ckpt={evil}")
    assert result.returncode == 2 and "refused and not executed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one clear line, no traceback
    # A checkpoint of plain data can still name code to call through its model spec.
    crafted = tmp_path / "crafted.pt"
    save_checkpoint({"model": {}, "model_spec": {"_target_": "os.mkdir", "path": str(marker)}}, crafted)
    with pytest.raises(CheckpointError, match=r"model_spec\._target_='os\.mkdir' is not an importable torch\.nn\.Module"):
        load_model(crafted)
    nested = {"_target_": "framework.model.MLP", "width": {"_target_": "os.mkdir", "path": str(marker)}}
    save_checkpoint({"model": {}, "model_spec": nested}, crafted)
    with pytest.raises(CheckpointError, match="nested _target_"):
        load_model(crafted)
    (tmp_path / "artifact").mkdir()
    (tmp_path / "artifact" / "manifest.json").write_text('{"weights": "weights.pt"}')
    (tmp_path / "artifact" / "model_spec.json").write_text('{"_target_": "framework.model.MLP"}')
    with pytest.raises(CheckpointError, match="not a runlab export"):
        load_artifact(tmp_path / "artifact")
    assert not marker.exists()


def test_unfreezing_later_under_ddp_is_refused_before_any_work(train):
    from framework.errors import ConfigError

    with pytest.raises(ConfigError, match="finetune.unfreeze_at_epoch=1 is not supported with parallel=ddp"):
        train("parallel=ddp", "finetune.freeze=[block0.*]", "finetune.unfreeze_at_epoch=1")


def test_a_pretrain_experiment_that_fails_ends_this_run_in_one_line_with_its_error(cli):
    line = one_line_error(cli("finetune.from=outputs/nothing", "finetune.pretrain=no_such_experiment", "logger=none"))
    assert line.startswith("runlab: error: finetune.pretrain=no_such_experiment failed: In 'config': Could not find "
                           "'experiment/no_such_experiment' Available options in 'experiment': char_lm ")


def test_the_pretraining_is_a_run_of_its_own_not_the_sweep_trial_or_the_rank_that_starts_it(train, monkeypatch):
    import framework.entry

    group = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
             "TORCHELASTIC_RUN_ID": "job"}
    trial = dict(zip(TRIAL_VARIABLES, ("study", "sqlite:///study.db", "3")))
    for name, value in {**group, **trial}.items():
        monkeypatch.setenv(name, value)
    started = []
    monkeypatch.setattr(framework.entry, "run_command", lambda command, env: started.append((command, env)))
    with pytest.raises(ConfigError, match="did not leave a checkpoint"):  # the stand-in pretrained nothing
        train("finetune.from=nothing_yet", "finetune.pretrain=digits_pretrain", *QUIET)
    ((command, env),) = started
    assert command[2] == "experiment=digits_pretrain"
    assert not set(env) & {*group, *trial} and env["PATH"] == os.environ["PATH"]


def test_a_pretraining_in_each_of_torchruns_processes_is_refused_before_any_work(train, monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="cannot run in each of the 2 processes torchrun or the SLURM job started: "
                                          "run python run.py experiment=digits_pretrain first"):
        train("parallel=ddp", "finetune.from=nothing_yet", "finetune.pretrain=digits_pretrain", *QUIET)
