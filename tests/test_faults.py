"""Faults are features: each fault a user can meet, started the way a user starts a run.

Every test types its command in a fresh copy of the repository (`user`, `cli`) and checks two
things: nothing was lost (the checkpoints on disk are the last good ones and resume from
them), and the user got one clear line with the documented exit code (README, "When
something goes wrong").
"""
from __future__ import annotations

import math
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest
import torch
import yaml

from conftest import one_line_error, read_metrics
from docs_pages import assert_in_page_order, assert_shown_lines_appear, console_steps, typed_as_shown
from framework.checkpoint import load_checkpoint

QUICK = ["logger=none", "trainer.progress_bar=false"]
FAULTY = "model._target_=faulty_model.FaultyMLP"


def weights(run_dir: Path, name: str = "last.pt") -> Dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / name)["model"]


def all_finite(state: Dict[str, torch.Tensor]) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in state.values())


def wait_for(condition, process: subprocess.Popen, log: Path, within: float = 150) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def trained_in_process(user, *overrides: str) -> None:
    """The run `python run.py OVERRIDES` makes in the user's copy (outputs/<name>/<date>_<time>/), made in
    this process (one process start fewer): a run before, or a resume after, what the test types."""
    from framework.entry import run

    run([*overrides, f"paths.output_dir={user.outputs}"])


def namespaced(command: str, setup: str) -> str:
    """``command`` typed after ``setup`` in a private mount namespace (a small disk, a read-only
    folder) that the test can make without touching the machine."""
    return f"unshare -rm bash -c {shlex.quote(f'{setup} && {command}')}"


def mount_namespaces_work(user) -> bool:
    probe = user.repo / ".mount-probe"
    probe.mkdir()
    works = user.run(namespaced("true", f"mount -t tmpfs -o size=1m tmpfs {probe.name}"), timeout=30).returncode == 0
    probe.rmdir()
    return works


# --- non-finite values -------------------------------------------------------------------------

# docs/training.md's runs that diverge, which tests/test_readme.py leaves to the tests below.
DOCS_DIVERGED = """$ python run.py lr=1e6 trainer.max_epochs=2
runlab: error: training diverged at step ... (epoch 1): loss ..., gradient norm .... Likely causes: a learning rate too high ...
$ echo $?
3"""
DOCS_MOSTLY_SKIPPED = """$ python run.py trainer.on_nonfinite=skip lr=1e6 trainer.max_epochs=2
runlab: error: ... of 38 steps (...%) were skipped as non-finite (trainer.on_nonfinite=skip)...
$ echo $?
3"""


def test_a_diverging_run_stops_at_the_step_and_keeps_the_last_finite_checkpoints(user, tmp_path, monkeypatch):
    # As typed, the docs' run diverges in its first epoch, before any checkpoint.
    (typed,) = typed_as_shown(user, DOCS_DIVERGED, "docs/training.md")
    line = one_line_error(typed, exit_code=3)
    assert "training diverged at step" in line and "Likely causes: a learning rate too high" in line
    assert line.endswith("No checkpoint was written before it.")
    # In-process: the lr grows 1e4-fold every epoch, finite for a while, then the loss explodes.
    monkeypatch.chdir(tmp_path)  # the checkpoint is named as a command typed there names it
    run_dir = tmp_path / "run"
    line = diverged_in_process(run_dir, "scheduler=step", "scheduler.step_size=1", "scheduler.gamma=1e4",
                               "trainer.max_epochs=6", *QUICK)
    assert "training diverged at step" in line and "Likely causes: a learning rate too high" in line
    assert not (run_dir / "metrics.json").exists()
    last, best = load_checkpoint(run_dir / "checkpoints/last.pt"), weights(run_dir, "best.pt")
    assert last["epoch"] >= 1 and all_finite(last["model"]) and all_finite(best)
    assert line.endswith(f"run/checkpoints/last.pt keeps the last finite state (epoch {last['epoch']}); resume=auto "
                         "with a lower lr continues from it.")


def test_a_diverging_ddp_run_stops_every_rank_with_one_line(cli, user):
    line = one_line_error(cli("parallel=ddp", "lr=1e6", *QUICK), exit_code=3)
    assert re.search(r"training diverged at step \d+ \(epoch 1\)", line) and line.endswith("No checkpoint was written before it.")


SKIPPED = "2 of 19 steps (11%) were skipped as non-finite (trainer.on_nonfinite=skip)"


def skipped_two_steps(run_dir: Path) -> None:
    metrics = read_metrics(run_dir)
    assert metrics["trainer/nonfinite_steps_skipped"] == 2 and math.isfinite(metrics["train/loss"])
    assert all_finite(weights(run_dir))
    log = (run_dir / "train.log").read_text()
    assert log.count("Skipped step") == 2 and SKIPPED in log


def test_skip_drops_the_non_finite_steps_and_counts_them(train, caplog):
    """In-process (test_a_run_that_skipped_most_of_its_steps_ends_non_zero_in_one_line types a skipping run)."""
    caplog.set_level("INFO")
    _, run_dir = train(FAULTY, "+model.nan_at_steps=[3,7]", "trainer.on_nonfinite=skip", "trainer.max_epochs=1",
                       *QUICK, shrink=False)
    skipped_two_steps(run_dir)
    assert SKIPPED in caplog.text  # the run's last lines, which the command line prints


def test_skip_drops_the_steps_with_a_finite_loss_and_non_finite_gradients_too(train):
    """In-process: the loss is finite, its gradients are not."""
    _, run_dir = train(FAULTY, "+model.nan_grad_at_steps=[3,7]", "trainer.on_nonfinite=skip", "trainer.max_epochs=1",
                       *QUICK, shrink=False)
    skipped_two_steps(run_dir)


def diverged_in_process(run_dir: Path, *overrides: str) -> str:
    """The one line a run with ``overrides`` ends with, from a run in this process, whose exit code
    is 3 (test_a_diverging_run_stops_at_the_step_and_keeps_the_last_finite_checkpoints and the ddp one
    type theirs: exit 3, that one line, no traceback)."""
    from framework.entry import run
    from framework.errors import DivergedError

    with pytest.raises(DivergedError) as raised:
        run([*overrides, f"paths.output_dir={run_dir.parent / 'outputs'}"], run_dir=str(run_dir))
    assert raised.value.exit_code == 3
    return raised.value.line


def test_a_run_that_skipped_most_of_its_steps_ends_non_zero_in_one_line(user):
    (typed,) = typed_as_shown(user, DOCS_MOSTLY_SKIPPED, "docs/training.md")
    line = one_line_error(typed, exit_code=3)
    (run_dir,) = user.runs()
    skipped = read_metrics(run_dir)["trainer/nonfinite_steps_skipped"]  # its results are kept, for a look
    assert skipped > 19
    assert line.startswith(f"runlab: error: {skipped} of 38 steps ({skipped / 38:.0%}) were skipped as non-finite")
    assert "more than half skipped the result is not a trained model" in line


def test_a_finite_loss_with_non_finite_gradients_stops_at_that_step(tmp_path):
    line = diverged_in_process(tmp_path / "run", FAULTY, "+model.nan_grad_at_steps=[3]", *QUICK)
    assert re.search(r"training diverged at step 3 \(epoch 1\): loss \d[^,]*, gradient norm nan\.", line), line
    assert line.endswith("No checkpoint was written before it.")


def test_a_non_finite_validation_metric_stops_the_run_before_any_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    line = diverged_in_process(run_dir, FAULTY, "+model.nan_in_eval=true", *QUICK)
    assert "training diverged at the validation after step 19 (epoch 1): val/loss nan" in line
    assert line.endswith("No checkpoint was written before it.")
    assert (run_dir / "train.log").is_file() and not (run_dir / "checkpoints").exists()


# --- resume means continue -----------------------------------------------------------------------

def test_resume_auto_on_a_run_early_stopping_ended_trains_nothing_and_exits_0(cli, user):
    """(A run that reached its budget: test_the_docs_resumes_..., as docs/training.md types it.)"""
    first = ["lr=1e-12", "early_stopping.patience=1"]
    trained_in_process(user, *first, *QUICK)
    (done,) = user.runs()
    before = (done / "metrics.json").read_text()
    result = cli(*first, *QUICK, "resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert user.runs() == [done] and (done / "metrics.json").read_text() == before  # nothing made, nothing changed
    (line,) = [line.split(" - ", 1)[1] for line in result.stdout.splitlines() if " - " in line]
    assert line.startswith(f"The run in {done.relative_to(user.repo)} is complete (")
    assert line.endswith(f"); nothing left to train; its results are in {done.relative_to(user.repo)}/metrics.json.")


# docs/training.md's resumes, which tests/test_readme.py leaves to the test below (the later steps read
# the earlier ones' runs): a run, a larger budget, another lr; the complete run and another model (console);
# the model shared (python).
DOCS_RESUMES = ["python run.py name=demo trainer.max_epochs=3",
                "python run.py name=demo trainer.max_epochs=6 resume=auto",
                "python run.py name=demo trainer.max_epochs=8 resume=auto lr=3e-4"]
DOCS_COMPLETE = """$ python run.py name=demo trainer.max_epochs=8 resume=auto
... The run in outputs/demo/... is complete (it reached trainer.max_epochs=8); nothing left to train; its results are in outputs/demo/.../metrics.json.
$ echo $?
0
$ python run.py name=demo trainer.max_epochs=9 resume=auto model.width=64
runlab: error: resume=outputs/demo/.../checkpoints/last.pt holds a model with model.width=256, but this config builds model.width=64; ..."""
DOCS_SHARED = """import framework

model = framework.load_model("outputs/demo")  # the latest demo run's best.pt; or a run dir, or a .pt file
print(model)"""


def logged_lr_by_step(run_dir: Path) -> Dict[int, float]:
    """The lr TensorBoard shows at each logged step of the run and of those it continues (one TensorBoard run)."""
    from test_logging import read_events

    return {event.step: event.value for event in read_events(run_dir).Scalars("overview/optimizer/lr")}


def cosine(lr: float, epoch: int, epochs: int) -> float:
    return lr * 0.5 * (1 + math.cos(math.pi * epoch / epochs))


@pytest.mark.timeout(400)
def test_the_docs_resumes_continue_on_a_rebuilt_schedule_at_the_new_lr_then_end_complete_or_refused(user):
    assert_in_page_order("docs/training.md", *DOCS_RESUMES, DOCS_COMPLETE, DOCS_SHARED)
    for command in DOCS_RESUMES:
        done = user.run(command)
        assert done.returncode == 0, done.stderr[-3000:]
    first, longer, faster = user.runs("demo")
    longer_log, faster_log = ((run_dir / "train.log").read_text() for run_dir in (longer, faster))
    assert "trainer.max_epochs: 3 -> 6" in longer_log and "scheduler.T_max: 3 -> 6" in longer_log
    assert "lr: 0.001 -> 0.0003" in faster_log and "scheduler.T_max: 6 -> 8" in faster_log
    # Epochs 4 to 6 on a cosine over 6, not the cosine over 3 that had reached 0; then epochs 7 and 8 on a
    # cosine over 8 restarted from 3e-4 (logged every 10 steps, 19 steps an epoch).
    lr = logged_lr_by_step(faster)
    assert {step: lr[step] for step in lr if step > 57} == pytest.approx(
        {step: cosine(1e-3, (step - 1) // 19, 6) if step <= 114 else cosine(3e-4, (step - 1) // 19, 8)
         for step in range(60, 153, 10)}, rel=1e-6)
    assert yaml.safe_load((faster / ".hydra/config.yaml").read_text())["lr"] == 0.0003
    assert load_checkpoint(faster / "checkpoints/last.pt")["config"]["lr"] == 0.0003
    assert read_metrics(faster)["epoch"] == 8
    before = (faster / "metrics.json").read_text()
    complete, refused = typed_as_shown(user, DOCS_COMPLETE, "docs/training.md")
    assert complete.returncode == 0, complete.stderr[-3000:]
    (line,) = [line.split(" - ", 1)[1] for line in complete.stdout.splitlines() if " - " in line]
    assert line == (f"The run in {faster.relative_to(user.repo)} is complete (it reached trainer.max_epochs=8); nothing "
                    f"left to train; its results are in {faster.relative_to(user.repo)}/metrics.json.")
    assert "holds a model with model.width=256, but this config builds model.width=64" in one_line_error(refused)
    assert user.runs("demo") == [first, longer, faster]  # the complete run and the refused one made no run dir
    assert (faster / "metrics.json").read_text() == before  # nor changed the run
    shared = user.run(f"python -c {shlex.quote(DOCS_SHARED)}")
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert "Linear(in_features=64, out_features=256" in shared.stdout


RESUME_REFUSALS = {
    "model.width=64": "holds a model with model.width=32, but this config builds model.width=64",
    "data.classes=[0,1]": "holds a model with num_classes=10, but this config builds num_classes=2",
    "batch_size=32": "resume: batch_size=32 differs from the checkpoint's 64",
    "seed=7": "resume: seed=7 differs from the checkpoint's 42",
    "model=cnn": "holds a model with model._target_='framework.model.MLP', but this config builds "
                 "model._target_='framework.model.CNN'",
}


def test_resume_refuses_a_different_run_naming_the_key(train):
    """In-process: the refusals' words (test_the_docs_resumes_... types one: one line, no run dir)."""
    from framework.errors import ConfigError

    _, first = train("trainer.max_epochs=1", "logger=none")
    for override, named in RESUME_REFUSALS.items():
        with pytest.raises(ConfigError, match=re.escape(named)):
            train("trainer.max_epochs=2", "logger=none", override, f"resume={first / 'checkpoints/last.pt'}")


def test_a_checkpoint_with_the_marker_but_missing_keys_is_one_line(train, tmp_path):
    """In-process (test_a_damaged_checkpoint_given_to_resume_is_one_line_and_leaves_no_run_dir types one)."""
    from framework.errors import CheckpointError

    path = crafted_checkpoint(tmp_path / "damaged.pt", optimizer=None, rng=None)
    with pytest.raises(CheckpointError, match=re.escape(f"{path} has the runlab marker but lacks optimizer, rng")):
        train(f"resume={path}", *QUICK)


# --- signals -------------------------------------------------------------------------------------

# Enough epochs (about 20 ms each here) that the signal, sent 0.1 s after the first checkpoint, lands in
# training: with 6 the run could finish first.
SIGNALLED = ["trainer.max_epochs=40", "model.dropout=0.2", "early_stopping.enabled=false", *QUICK]


@pytest.fixture(scope="module")
def never_signalled(tmp_path_factory) -> Path:
    """The run, never signalled, whose weights each signalled and resumed run must reach (one for both signals)."""
    from framework.entry import run

    root = tmp_path_factory.mktemp("never_signalled")
    return run([*SIGNALLED, f"paths.output_dir={root / 'outputs'}"], run_dir=str(root / "run")).run_dir


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_resume_ends_where_an_uninterrupted_run_ends(never_signalled, user, tmp_path,
                                                                                 signum):
    args = ["name=signalled", *SIGNALLED]
    log = tmp_path / "first.log"
    process = user.start(shlex.join(["python", "run.py", *args]), log)
    wait_for(lambda: list(user.outputs.glob("signalled/*/checkpoints/last.pt")), process, log)
    time.sleep(0.1)  # into the next epoch, so the saved point is mid-epoch
    process.send_signal(signum)
    assert process.wait(timeout=60) == 128 + signum, log.read_text()[-3000:]
    (first,) = user.runs("signalled")
    saved = load_checkpoint(first / "checkpoints/last.pt")
    lines = [line for line in log.read_text().splitlines() if "runlab: interrupted:" in line]
    assert lines == [f"runlab: interrupted: {signal.Signals(signum).name} at step {saved['step']} (epoch "
                     f"{saved['epoch'] + 1}); saved {first.relative_to(user.repo)}/checkpoints/last.pt. "
                     "Continue with resume=auto."]
    assert not (first / "run.lock").exists() and not (first / "metrics.json").exists()
    # The resume in-process (one process start fewer): test_the_docs_resumes_... types resume=auto.
    trained_in_process(user, *args, "resume=auto")
    resumed = weights(user.runs("signalled")[-1])
    for name, value in weights(never_signalled).items():
        assert torch.equal(resumed[name], value), name


# --- one run, one dir ---------------------------------------------------------------------------

def test_two_runs_started_together_get_a_dir_each(user, tmp_path):
    command = "python run.py trainer.max_epochs=2 logger=none trainer.progress_bar=false"
    first, second = (user.start(command, tmp_path / f"{n}.log") for n in (1, 2))
    assert first.wait(timeout=200) == 0 and second.wait(timeout=200) == 0
    runs = user.runs()
    assert len(runs) == 2  # in the same second, the second one is <date>_<time>_1
    for run_dir in runs:
        log = (run_dir / "train.log").read_text()
        assert log.count("Run dir: ") == 1 and f"Run dir: {run_dir.relative_to(user.repo)}" in log
        assert read_metrics(run_dir)["epoch"] == 2


# docs/training.md's run stopped by SIGTERM, which tests/test_readme.py leaves to the test below.
DOCS_STOPPED = """$ timeout --preserve-status -s TERM 15 python run.py name=long trainer.max_epochs=1000 early_stopping.enabled=false
runlab: interrupted: SIGTERM at step ... (epoch ...); saved outputs/long/.../checkpoints/last.pt. Continue with resume=auto.
$ echo $?
143"""


@pytest.mark.timeout(300)
def test_a_live_run_holds_its_lock_and_resume_auto_refuses_it(user, tmp_path, monkeypatch):
    """The docs' run, stopped by SIGTERM after 15 s, as typed; while it lives, resume=auto is refused in-process
    (test_the_docs_resumes_... types a refused resume: one line, exit 2)."""
    from framework.entry import run
    from framework.errors import ConfigError

    ((command, shown, exit_code),) = console_steps(DOCS_STOPPED)
    log = tmp_path / "live.log"
    live = user.start(command, log)  # timeout, which starts the run and sends SIGTERM after 15 s
    wait_for(lambda: list(user.outputs.glob("long/*/checkpoints/last.pt")), live, log)
    (run_dir,) = user.runs("long")
    (pid,) = map(int, Path(f"/proc/{live.pid}/task/{live.pid}/children").read_text().split())
    assert (run_dir / "run.lock").read_text().startswith(f"pid {pid} on ")
    monkeypatch.chdir(user.repo)  # the run dir is named as a command typed there names it
    named = f"the latest run of 'long', {run_dir.relative_to(user.repo)}, is still running (pid {pid} on"
    with pytest.raises(ConfigError, match=re.escape(named)):  # (trainer.max_steps=1: little to do, were it not refused)
        run(["name=long", "trainer.max_epochs=1000", "trainer.max_steps=1", "resume=auto",
             f"paths.output_dir={user.outputs}", *QUICK], run_dir=str(tmp_path / "refused"))
    assert live.wait(timeout=60) == exit_code == 143
    assert_shown_lines_appear(shown, log.read_text(), command, "docs/training.md")
    assert not (run_dir / "run.lock").exists()


def test_a_killed_runs_lock_is_not_held_by_the_workers_it_forked(tmp_path):
    """DataLoader workers are forked from the run: killed with kill -9, the run must read as dead at
    once, not while its orphaned workers live on."""
    from framework.paths import live_run

    script = ("import os, sys, time\n"
              "from framework.paths import RunLock\n"
              "with RunLock(sys.argv[1]):\n"
              "    started, ready = os.pipe()\n"
              "    if os.fork() == 0:\n"
              "        os.write(ready, b'x')\n"  # the fork hooks have run in the child by now
              "        time.sleep(30)\n"  # a worker that outlives its parent
              "        os._exit(0)\n"
              "    os.read(started, 1)\n"
              "    print('locked', flush=True)\n"
              "    time.sleep(60)\n")
    run = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert run.stdout.readline() == "locked\n"
    assert live_run(tmp_path) == f"pid {run.pid} on {socket.gethostname()}"
    run.kill()
    run.wait(timeout=10)
    assert live_run(tmp_path) is None  # the forked child still sleeps, holding no lock


# --- errors a user can cause: one line, once ---------------------------------------------------

def test_an_experiment_with_a_yaml_syntax_error_names_the_file_and_line(cli, user):
    (user.repo / "experiments" / "broken.yaml").write_text("# @package _global_\nname: broken\n  lr: 1\n")
    line = one_line_error(cli("experiment=broken"))
    assert line == (f"runlab: error: {user.repo.resolve()}/experiments/broken.yaml, line 3, column 5: not valid YAML "
                    "(mapping values are not allowed here).")


CSV_FILES = {
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "is not a text CSV file: byte 0 is not UTF-8 text"),
    "label only": (b"label\n0\n1\n", "has only its label column 'label'; it needs feature columns too"),
    "ragged": (b"a,b,label\n1,2,0\n3,1\n5,6,0\n", "is ragged: line 3 has 2 values but the header has 3 columns"),
    "empty cell": (b"a,b,label\n1,2,0\n3,,1\n5,6,0\n", "line 3, column 'b' is empty"),
    "nan cell": (b"a,b,label\n1,2,0\n3,nan,1\n5,6,0\n", "line 3, column 'b' holds 'nan'"),
}


@pytest.mark.parametrize("kind", CSV_FILES)
def test_a_broken_csv_is_refused_naming_what_and_where(train, tmp_path, kind):
    from framework.errors import ConfigError

    content, message = CSV_FILES[kind]
    (tmp_path / "mine.csv").write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(f"data.path='{tmp_path / 'mine.csv'}' {message}")):
        train("data=csv", f"data.path={tmp_path / 'mine.csv'}", *QUICK)


def test_a_broken_csv_is_one_line(cli, user):
    (user.repo / "mine.csv").write_bytes(CSV_FILES["ragged"][0])
    line = one_line_error(cli("data=csv", "data.path=mine.csv", *QUICK))
    assert f"data.path='mine.csv' {CSV_FILES['ragged'][1]}" in line
    assert not user.outputs.exists()  # refused before any work: nothing left behind


@pytest.mark.parametrize("override, message", [
    ("lr=inf", "lr=inf is invalid; the learning rate must be a positive number."),
    ("model.width=0", "model.width=0 is invalid; layer sizes and counts must be at least 1."),
    ("data.classes=[3]", "data.classes=[3] is invalid; keep at least 2 distinct labels"),
    ("early_stopping.min_delta=nan", "early_stopping.min_delta=nan is invalid"),
    ("seed=-1", "seed=-1 is invalid; it must be an integer from 0 to 2**32 - 1."),
    ("seed=4294967296", "seed=4294967296 is invalid"),
    ("device=gpu", "device='gpu' is not a device; use auto, cpu, cuda or cuda:N."),
])
def test_a_value_that_cannot_work_is_refused_before_any_work(train, tmp_path, override, message):
    """In-process: the refusals' words (test_cli types one, and sees its one line and exit code 2)."""
    from framework.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        train(override)
    assert not list(tmp_path.glob("**/checkpoints"))


def test_a_name_too_long_for_the_file_system_is_one_line(cli, user):
    line = one_line_error(cli(f"name={'x' * 300}"))
    assert "is too long for the file system" in line and "choose a shorter name" in line


def test_a_hydra_run_dir_that_cannot_be_made_is_one_line(cli, user):
    line = one_line_error(cli("hydra.run.dir=/proc/relrun"))
    assert line == ("runlab: error: cannot create the run dir /proc/relrun (No such file or directory); choose a "
                    "writable hydra.run.dir, or fix the permissions of that folder.")
    assert not user.outputs.exists()


def test_an_unwritable_run_dir_is_one_line(user):
    if not mount_namespaces_work(user):
        pytest.skip("this machine cannot make a private mount namespace (unshare -rm)")
    (user.outputs).mkdir()
    result = user.run(namespaced("python run.py", "mount --bind outputs outputs && mount -o remount,bind,ro outputs"))
    line = one_line_error(result)
    assert "cannot create the run dir" in line and "(Read-only file system)" in line


@pytest.mark.timeout(300)
def test_a_full_disk_keeps_the_previous_checkpoint_and_is_one_line(user):
    if not mount_namespaces_work(user):
        pytest.skip("this machine cannot make a private mount namespace (unshare -rm)")
    # The run writes to a 30 MB tmpfs; once its first last.pt exists, the disk is filled.
    fill = ("python run.py trainer.max_epochs=50 early_stopping.enabled=false trainer.progress_bar=false & "
            "until ls outputs/train/*/checkpoints/last.pt; do sleep 0.05; done; "
            "head -c 100M /dev/zero > outputs/filler 2>/dev/null; wait $!; status=$?; "
            "python -c 'import framework, glob; print(\"epoch\", framework.checkpoint.load_checkpoint("
            "glob.glob(\"outputs/train/*/checkpoints/last.pt\")[0])[\"epoch\"])'; exit $status")
    user.outputs.mkdir()
    result = user.run(namespaced(fill, "mount -t tmpfs -o size=30m tmpfs outputs"), timeout=280)
    line = one_line_error(result, exit_code=4)
    # Whichever write finds the disk full first, last.pt, its copy best.pt or TensorBoard's events,
    # the checkpoints written before stay.
    assert re.search(r"no space left on device writing outputs/train/[^/]+/(checkpoints/(last|best)\.pt; the previous "
                     r"\2\.pt is kept|tensorboard/[^;]+; the checkpoints written before it are kept)\. Free some space, "
                     r"then continue with resume=auto\.$", line), line
    assert "epoch " in result.stdout  # the kept checkpoint loads


@pytest.mark.timeout(300)
@pytest.mark.parametrize("switched_off, full", [
    (["checkpoint.enabled=false"], r"tensorboard/[^;]+; the checkpoints written before it are kept"),
    (["checkpoint.enabled=false", "logger=none"], r"metrics\.json; no metrics\.json was written before"),
])
def test_a_full_disk_without_checkpoints_is_one_line_too(user, switched_off, full):
    """With checkpoints off the disk fills under TensorBoard's writer thread, or under train.log (whose
    lines are then dropped, without a traceback for each) until metrics.json is written."""
    if not mount_namespaces_work(user):
        pytest.skip("this machine cannot make a private mount namespace (unshare -rm)")
    fill = (f"python run.py trainer.max_epochs=50 early_stopping.enabled=false trainer.progress_bar=false "
            f"{' '.join(switched_off)} & until grep -qs 'epoch 1 ' outputs/train/*/train.log; do sleep 0.05; done; "
            "head -c 100M /dev/zero > outputs/filler 2>/dev/null; wait $!")
    user.outputs.mkdir()
    result = user.run(namespaced(fill, "mount -t tmpfs -o size=30m tmpfs outputs"), timeout=280)
    line = one_line_error(result, exit_code=4)
    assert re.search(rf"no space left on device writing outputs/train/[^/]+/{full}\. Free some space", line), line


def test_a_disk_full_before_the_run_starts_is_one_line(user):
    """Hydra writes the run's config into the new run dir before runlab's code runs; a full disk
    there would end in Hydra's traceback, so the run dir is not taken when no space is left."""
    if not mount_namespaces_work(user):
        pytest.skip("this machine cannot make a private mount namespace (unshare -rm)")
    user.outputs.mkdir()
    fill = "head -c 10M /dev/zero > outputs/filler 2>/dev/null; python run.py trainer.max_epochs=1"
    result = user.run(namespaced(fill, "mount -t tmpfs -o size=1m tmpfs outputs"), timeout=120)
    line = one_line_error(result, exit_code=4)
    assert re.search(r"no space left on device to create the run dir outputs/train/[^;]+; free some space", line), line


def test_an_unreachable_ray_cluster_is_one_line(cli):
    result = cli("search=random", "launcher=ray_local", "+hydra.launcher.ray.init.address=127.0.0.1:9",
                 "hydra.sweeper.n_trials=1", *QUICK)
    line = one_line_error(result, exit_code=5)
    assert "The Ray cluster at 127.0.0.1:9 cannot be reached" in line


# --- the end of a run says where things are ---------------------------------------------------

# The README's run and what it prints last, which tests/test_readme.py leaves to the test below.
README_LAST_LINES = """$ python run.py trainer.max_epochs=2
... epoch 1  step 19  train/loss 1.7200  val/loss 0.9515  val/acc 0.8259  val/acc_top5 1.0000  val/f1 0.8276
... epoch 2  step 38  train/loss 0.6257  val/loss 0.4547  val/acc 0.9296  val/acc_top5 1.0000  val/f1 0.9347
... Run dir: outputs/train/...
... Stopped: reached trainer.max_epochs=2, at step 38 (epoch 2), after ... s of training.
... Best val/acc: 0.9296 (epoch 2)   test/acc 0.8889  test/loss 0.4771
... Checkpoints: outputs/train/.../checkpoints/best.pt, outputs/train/.../checkpoints/last.pt
... TensorBoard: tensorboard --logdir outputs/train/.../tensorboard"""


def test_the_last_lines_of_a_run_say_where_everything_is(user):
    (result,) = typed_as_shown(user, README_LAST_LINES, "README.md")
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = user.runs()
    shown = run_dir.relative_to(user.repo)
    metrics = read_metrics(run_dir)
    last = [line.split(" - ", 1)[1] for line in result.stdout.strip().splitlines()[-5:]]
    assert last == [f"Run dir: {shown}",
                    f"Stopped: reached trainer.max_epochs=2, at step 38 (epoch 2), after "
                    f"{metrics['train_seconds']:.1f} s of training.",
                    f"Best val/acc: {metrics['best/val/acc']:.4f} (epoch {metrics['best_epoch']})   test/acc "
                    f"{metrics['test/acc']:.4f}  test/loss {metrics['test/loss']:.4f}",
                    f"Checkpoints: {shown}/checkpoints/best.pt, {shown}/checkpoints/last.pt",
                    f"TensorBoard: tensorboard --logdir {shown}/tensorboard"]


# --- checkpoints that are not what they claim: every path refuses them alike --------------------

def crafted_checkpoint(path: Path, **changes) -> Path:
    """A file with runlab's marker and every key a training run writes (of the right types, unless
    ``changes`` say otherwise; a value of None removes the key)."""
    from framework.checkpoint import FORMAT, TRAINING_STATE

    state = {key: {} for key in TRAINING_STATE}
    state.update(format=FORMAT, version=1, epoch=1, step=19, batch_in_epoch=0, micro_batch=64,
                 model={"w": torch.zeros(1)}, model_spec={"_target_": "framework.model.MLP", "width": 32})
    state.update(changes)
    torch.save({key: value for key, value in state.items() if value is not None}, path)
    return path


DAMAGED = {
    "epoch a string": ({"epoch": "three"}, "has the runlab marker but is damaged: epoch is str, not int."),
    "model_spec a list": ({"model_spec": ["framework.model.MLP"]}, "is damaged: model_spec is list, not dict."),
    "only the weights": ({key: None for key in ("model_spec", "optimizer", "scheduler", "scaler", "epoch", "step",
                                                "batch_in_epoch", "micro_batch", "checkpointer", "early_stopping",
                                                "rng", "config")}, "has the runlab marker but lacks model_spec"),
}


@pytest.mark.parametrize("kind", DAMAGED)
def test_a_damaged_checkpoint_is_refused_alike_by_resume_eval_finetune_and_load_model(train, tmp_path, kind):
    from framework import load_model
    from framework.entry import run
    from framework.errors import CheckpointError

    changes, message = DAMAGED[kind]
    path = crafted_checkpoint(tmp_path / "damaged.pt", **changes)
    refusals = [lambda: load_model(path), lambda: run(["task=eval", f"ckpt={path}"], run_dir=str(tmp_path / "eval")),
                lambda: train(f"finetune.from={path}", "logger=none"), lambda: train(f"resume={path}", "logger=none")]
    for refused in refusals:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            refused()


def test_a_damaged_checkpoint_given_to_resume_is_one_line_and_leaves_no_run_dir(cli, user):
    crafted_checkpoint(user.repo / "damaged.pt", epoch="three")
    line = one_line_error(cli("resume=damaged.pt", *QUICK))
    assert line == "runlab: error: damaged.pt has the runlab marker but is damaged: epoch is str, not int."
    assert not user.outputs.exists()  # nor outputs/train/: the refused run made them, and took them back


# --- set-up on a full disk -----------------------------------------------------------------------

def test_a_run_started_on_a_full_disk_in_a_dir_of_its_own_is_one_line_and_leaves_nothing(user):
    """Resuming a job in its own run dir, and a new hydra.run.dir, on a disk already full: Hydra
    would write its config there and end in a traceback, and the lock would be left empty."""
    if not mount_namespaces_work(user):
        pytest.skip("this machine cannot make a private mount namespace (unshare -rm)")
    user.outputs.mkdir()
    commands = ("mkdir -p outputs/train/old/checkpoints && head -c 10M /dev/zero > outputs/filler 2>/dev/null; "
                "python run.py hydra.run.dir=outputs/train/old resume=auto; echo exit $?; "
                "python run.py hydra.run.dir=outputs/new trainer.max_epochs=1; echo exit $?; "
                "find outputs -mindepth 1 | sort")
    result = user.run(namespaced(commands, "mount -t tmpfs -o size=1m tmpfs outputs"), timeout=120)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("exit ")] == ["exit 4", "exit 4"]
    assert result.stderr.splitlines() == [
        "runlab: error: no space left on device to start a run in outputs/train/old; free some space, then run the "
        "command again.",
        "runlab: error: no space left on device to start a run in outputs/new; free some space, then run the "
        "command again."]
    # Nothing left behind: no run.lock, no .hydra/ or train.log in the old run dir, no outputs/new.
    assert result.stdout.splitlines()[-4:] == ["outputs/filler", "outputs/train", "outputs/train/old",
                                               "outputs/train/old/checkpoints"]


# --- signals at the very end ------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_sigterm_to_a_ddp_launcher_after_training_ends_exits_143_quietly(user, tmp_path):
    log = tmp_path / "ddp.log"
    process = user.start("python run.py parallel=ddp trainer.max_epochs=1 model.width=32 logger=none "
                         "trainer.progress_bar=false", log)
    wait_for(lambda: "Checkpoints: " in log.read_text(), process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143, log.read_text()[-3000:]
    after = log.read_text().split("Checkpoints: ", 1)[1]
    assert "runlab:" not in after and "Traceback" not in after and "leaked" not in after, after


# --- the sweeper ----------------------------------------------------------------------------

def test_a_tpe_sweep_that_repeats_itself_still_runs_n_trials(tmp_path, caplog):
    """hydra-optuna-sweeper's sphere example: 69 configurations, TPE with seed 123 proposes only tried
    ones after 19 trials; the 20th is a random untried one, and the log says so."""
    import optuna
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from framework.search.slots import TrialSlots
    from framework.search.study import load_sweep_study
    from framework.search.sweeper import StudySweeper

    class Sphere(TrialSlots):
        def __init__(self):
            self.started = []

        def submit(self, overrides, number):
            point = dict(override.split("=") for override in overrides)
            self.started.append((number, float(point["x"]) ** 2 + float(point["y"]) ** 2))
            return number

        def next_finished(self, handles):
            number, value = self.started.pop(0)
            result = JobReturn()
            result.status, result.return_value = JobStatus.COMPLETED, value
            return number, result

        def cancel(self, handles):
            pass

    sampler = {"_target_": "optuna.samplers.TPESampler", "seed": 123}
    sweeper = StudySweeper(sampler=optuna.samplers.TPESampler(seed=123), pruner=None, direction="minimize", storage="",
                           study_name="sphere", n_trials=20, n_jobs=1, max_failure_rate=0.0, custom_search_space=None,
                           params=OmegaConf.create({"x": "range(-5.5, 5.5, step=0.5)", "y": "choice(-5, 0, 5)"}),
                           export_dir="")
    sweeper.config = OmegaConf.create({"hydra": {"sweeper": {"pruner": None, "sampler": sampler}}})
    sweeper.sweep_dir, sweeper.launcher = tmp_path, Sphere()
    caplog.set_level("INFO", logger="framework.search.sweeper")
    sweeper.sweep([])
    run = [t for t in load_sweep_study(tmp_path).trials if "duplicate_of" not in t.user_attrs]
    assert len(run) == 20 and all(t.state.name == "COMPLETE" for t in run)
    assert len({(t.params["x"], t.params["y"]) for t in run}) == 20
    assert "is a random untried one instead" in caplog.text and "no untried configuration left" not in caplog.text


def test_a_sweep_sent_elsewhere_leaves_no_folder_in_the_working_directory(tmp_path, monkeypatch):
    """The search presets set hydra.sweep.dir by a merge, which resolves the default one too: it and the
    folders made above it go when the process ends."""
    from framework.entry import compose
    from framework.paths import remove_unused_dirs

    monkeypatch.chdir(tmp_path)
    assert compose(["search=tpe", "hydra.sweep.dir=elsewhere/sweep"]).hydra.sweep.dir == "elsewhere/sweep"
    remove_unused_dirs()  # as at the end of the process
    assert list(tmp_path.iterdir()) == []
