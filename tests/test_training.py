import contextlib
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from conftest import REPO, composed, read_metrics
from framework.checkpoint import Checkpointer, load_checkpoint
from framework.errors import ConfigError
from framework.entry import run
from framework.optimizer import fused_update_fits
from framework.parallel import Environment

# The experiments the repository holds (git tracks), not files a sweep exported there
# (hydra.sweeper.export_dir=experiments). digits_finetune starts from a digits_pretrain run;
# the sweep below and test_transfer.py run it. folder_resnet18 needs the image folders and the
# weights file that the README's commands before it make; tests/test_readme.py runs them all.
AFTER_README = "folder_resnet18"
EXPERIMENTS = sorted(Path(name).stem for name in subprocess.run(["git", "ls-files", "experiments/*.yaml"], cwd=REPO,
                                                                 capture_output=True, text=True, check=True).stdout.split()
                     if Path(name).stem not in ("digits_finetune", AFTER_README))


def final_weights(run_dir: Path):
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


def assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), key


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_runs(train, name):
    # A synthetic set is generated whole before the first step: a smaller one for 3 steps.
    smaller = ["data.num_samples=1024"] if "num_samples" in composed(f"experiment={name}").data else []
    metrics, run_dir = train(f"experiment={name}", "trainer.max_steps=3", *smaller)
    assert metrics["step"] == 3 and (run_dir / "metrics.json").is_file()


@pytest.mark.timeout(600)
def test_every_experiment_runs_in_one_sweep_on_a_fresh_clone(cli, user):
    """lightning-hydra-template's smoke test; digits_finetune runs digits_pretrain first, as there is none yet."""
    result = cli("-m", f"experiment=glob(*,exclude={AFTER_README})", "trainer.max_steps=1", "trainer.progress_bar=false")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(user.outputs.glob("*/multirun/*/*/metrics.json"))
    assert len(jobs) == len(list((REPO / "experiments").glob("*.yaml"))) - 1
    assert ("finetune.pretrain runs first: python run.py experiment=digits_pretrain trainer.max_steps=1 "
            "trainer.progress_bar=False") in result.stdout
    pretrained = user.runs("digits_pretrain")
    assert len(pretrained) == 1 and read_metrics(pretrained[0])["step"] == 1  # the command line's budget


def test_the_default_experiment_learns_digits(train):
    metrics, _ = train("trainer.max_epochs=6", shrink=False)
    assert metrics["val/acc"] >= 0.95
    assert metrics["best/val/acc"] >= metrics["val/acc"]
    assert metrics["test/acc"] >= 0.9
    for key in ("val/loss", "train/loss", "epoch", "step", "train_seconds", "samples_per_second"):
        assert metrics[key] > 0, key


def test_gradient_accumulation_keeps_the_effective_batch(train):
    _, whole = train("trainer.accumulate_grad_batches=1")
    _, split = train("trainer.accumulate_grad_batches=4")
    assert_same_weights(final_weights(whole), final_weights(split), atol=1e-5)


RESUME = ["trainer.max_epochs=4", "model.dropout=0.2", "early_stopping.enabled=false"]


def test_resume_after_an_interruption_equals_an_uninterrupted_run(train, monkeypatch, tmp_path):
    _, full_dir = train(*RESUME)
    save = Checkpointer.maybe_save

    def interrupt_after_epoch_2(self, state, metrics):
        save(self, state, metrics)
        if metrics["epoch"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(Checkpointer, "maybe_save", interrupt_after_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        train(*RESUME)
    monkeypatch.undo()
    interrupted = tmp_path / "run1" / "checkpoints" / "last.pt"
    assert load_checkpoint(interrupted)["epoch"] == 2
    resumed, resumed_dir = train(*RESUME, f"resume={interrupted}")
    assert resumed["epoch"] == 4
    assert_same_weights(final_weights(full_dir), final_weights(resumed_dir))


def test_a_run_stopped_mid_epoch_by_max_steps_resumes_exactly(train, tmp_path):
    _, full_dir = train(*RESUME)
    stopped, stopped_dir = train(*RESUME, "trainer.max_steps=30")
    assert stopped["step"] == 30
    _, resumed_dir = train(*RESUME, f"resume={stopped_dir / 'checkpoints' / 'last.pt'}")
    assert_same_weights(final_weights(full_dir), final_weights(resumed_dir))


def test_resume_auto_continues_the_latest_run_of_the_same_name(tmp_path):
    common = ["trainer.max_epochs=2", "trainer.progress_bar=false", "model.width=16", "logger=none",
              f"paths.output_dir={tmp_path}", "name=auto_demo"]
    first = run(common, run_dir=str(tmp_path / "auto_demo" / "a"))
    assert first["epoch"] == 2
    second = run([*common, "trainer.max_epochs=3", "resume=auto"], run_dir=str(tmp_path / "auto_demo" / "b"))
    assert second["epoch"] == 3 and second["step"] == first["step"] * 3 // 2


def test_early_stopping_stops_a_run_that_does_not_improve(train):
    metrics, run_dir = train("lr=1e-12", "trainer.max_epochs=20", "early_stopping.patience=2")
    assert metrics["epoch"] == 3
    assert "early stopping" in (run_dir / "train.log").read_text()


@contextlib.contextmanager
def linear_output_dtypes(seen: set):
    """Records the dtype of every nn.Linear output computed with gradients (the training steps)."""
    def hook(module, inputs, output):
        if isinstance(module, torch.nn.Linear) and torch.is_grad_enabled():
            seen.add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("32", torch.float32)])
def test_bf16_autocast_trains_on_cpu(train, precision, dtype):
    seen = set()
    with linear_output_dtypes(seen):  # logger=none: tensorboard traces the model's graph, in float32, at the end
        metrics, _ = train(f"trainer.precision={precision}", "device=cpu", "logger=none")
    assert seen == {dtype}
    assert metrics["val/acc"] > 0.5


def test_fp16_without_cuda_is_refused(train):
    with pytest.raises(ConfigError, match="trainer.precision=fp16 needs a CUDA device"):
        train("trainer.precision=fp16", "device=cpu")


@contextlib.contextmanager
def update_norms(norms: list):
    """Records, for every optimizer step, the norm of the change it made to the parameters, over the
    step's learning rate (plain SGD: the norm of the gradient it applied)."""
    def before(optimizer, args, kwargs):
        optimizer.before = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]

    def after(optimizer, args, kwargs):
        params = [p.detach() for group in optimizer.param_groups for p in group["params"]]
        change = torch.cat([(p - b).flatten() for p, b in zip(params, optimizer.before)])
        norms.append(change.norm().item() / optimizer.param_groups[0]["lr"])

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("clip", [0.01, 0.0])
def test_gradient_clipping_bounds_the_update(train, clip):
    norms = []
    plain_sgd = ["optimizer=sgd", "optimizer.momentum=0.0", "optimizer.nesterov=false", "scheduler=none", "lr=0.05"]
    with update_norms(norms):
        train(*plain_sgd, f"trainer.gradient_clip_val={clip}", "trainer.max_steps=5", "trainer.max_epochs=1")
    assert len(norms) == 5
    if clip:  # every update is the clipped gradient, at most clip long; the gradients were longer
        assert max(norms) == pytest.approx(clip, rel=1e-3)
    else:  # the control: unclipped, the same steps apply gradients far longer than 0.01
        assert min(norms) > 10 * 0.01


def test_the_optimizer_updates_in_one_kernel_where_its_class_has_one(train):
    """optimizer.fused (true by default): torch's fused update for the classes that have one; a class
    without it (RMSprop) is built as before, not refused; optimizer.fused=false keeps torch's loop."""
    def fused(*overrides: str):
        _, run_dir = train("trainer.max_steps=2", "trainer.max_epochs=1", "logger=none", *overrides)
        saved = load_checkpoint(run_dir / "checkpoints" / "last.pt")
        return saved["optimizer"]["param_groups"][0].get("fused", "absent")

    assert fused() is True
    assert fused("optimizer=sgd") is True
    assert fused("optimizer.fused=false") is None  # torch's default
    assert fused("optimizer._target_=torch.optim.RMSprop") == "absent"


def test_what_the_fused_update_cannot_take_gets_torchs_loop():
    adamw, model = {"_target_": "torch.optim.AdamW"}, torch.nn.Linear(2, 2)
    assert fused_update_fits(adamw, [{"params": list(model.parameters())}], model)  # fine-tuning's groups
    assert not fused_update_fits(adamw, [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], model)
    assert not fused_update_fits({**adamw, "foreach": True}, list(model.parameters()), model)  # torch refuses both
    sparse = torch.nn.Embedding(4, 2, sparse=True)
    assert not fused_update_fits({"_target_": "torch.optim.SGD"}, list(sparse.parameters()), sparse)
    # A function that builds the optimizer, not a class: it takes fused, and gets it for plain parameters.
    assert fused_update_fits({"_target_": "test_training.adamw_of"}, list(model.parameters()), model)


def adamw_of(params, lr: float = 1e-3, fused: Optional[bool] = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, fused=fused)


def test_an_unfused_updates_state_is_loaded_as_the_fused_update_needs_it():
    """torch puts a loaded step count where the fused update reads it (the parameter's device, float32) only
    where the saved group says fused. A float64 count stands for one on another device: both move together."""
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    unfused = torch.optim.AdamW(model.parameters(), fused=False)
    unfused.step()
    state = unfused.state_dict()
    for saved in state["state"].values():
        saved["step"] = saved["step"].double()
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    Environment(torch.device("cpu")).load_optimizer_state(model, fused, state)
    assert [saved["step"].dtype for saved in fused.state.values()] == [torch.float32, torch.float32]
    fused.step()


def test_a_run_of_the_unfused_update_resumes_with_the_fused_one(train):
    """What a checkpoint written before optimizer.fused, or with it false, becomes on resume: its state under
    the update this config builds (on a GPU, torch then moves each step count to its parameter's device)."""
    _, first = train("trainer.max_epochs=1", "logger=none", "optimizer.fused=false")
    _, resumed = train("trainer.max_epochs=2", "logger=none", f"resume={first / 'checkpoints' / 'last.pt'}")
    saved = load_checkpoint(resumed / "checkpoints" / "last.pt")
    assert saved["epoch"] == 2 and saved["optimizer"]["param_groups"][0]["fused"] is True


def test_metrics_json_is_one_flat_object(train):
    _, run_dir = train()
    metrics = read_metrics(run_dir)
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    assert {"val/acc", "val/loss", "best/val/acc", "train/loss", "epoch", "step", "train_seconds",
            "samples_per_second"} <= metrics.keys()
