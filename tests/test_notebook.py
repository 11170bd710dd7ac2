"""Notebooks and scripts as people use them: examples/quickstart.ipynb executed cell by cell on a
real Jupyter kernel in a fresh copy of the repository, and framework.run / framework.sweep from Python."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import urllib.request
from pathlib import Path

import pytest

from conftest import one_line_error, read_metrics
from framework.entry import run
from framework.errors import ConfigError

NEEDS = "needs the notebook extra (make install)"


def kernel_env(user) -> dict:
    """The user's environment without any folder holding a `tensorboard` executable on PATH: a kernel
    started by a Jupyter that was never activated in the project's environment."""
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "tensorboard").exists())
    env = user.env({"PATH": path})
    env.pop("TENSORBOARD_BINARY", None)
    return env


def kernel_client(notebook, user, keep_going: bool = False):
    """An nbclient client for ``notebook``, whose kernel setup_kernel starts in the copy."""
    from nbclient import NotebookClient

    client = NotebookClient(notebook, timeout=180, kernel_name="python3", allow_errors=keep_going,
                            resources={"metadata": {"path": str(user.repo)}})
    client.reset_execution_trackers()
    return client


def texts(cell, name: str = "stdout") -> str:
    return "".join(output.text for output in cell.outputs if output.output_type == "stream" and output.name == name)


def data(cell, mime: str) -> list:
    return [output.data[mime] for output in cell.outputs if mime in output.get("data", {})]


def value(cell, mime: str = "text/plain") -> str:
    """What the cell's last expression showed."""
    [shown] = [output.data[mime] for output in cell.outputs if output.output_type == "execute_result"]
    return shown


def http_json(url: str, body: dict = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def stop_tensorboard(port: int) -> None:
    """End the server %tensorboard started (SIGTERM: it removes its entry from TensorBoard's list)."""
    from tensorboard import manager

    for info in manager.get_all():
        if info.port == port:
            # An entry can outlive its server: one killed with SIGKILL (a README step's, shut down
            # under load) leaves it behind, and this one may have reused its port.
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGTERM)


@pytest.mark.timeout(300)
def test_quickstart_notebook_runs_on_a_real_kernel(user):
    nbformat = pytest.importorskip("nbformat", reason=NEEDS)
    pytest.importorskip("nbclient", reason=NEEDS)
    notebook = nbformat.read(user.repo / "examples" / "quickstart.ipynb", as_version=4)
    client = kernel_client(notebook, user)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    with client.setup_kernel(env=kernel_env(user), cwd=str(user.repo)):
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        # %tensorboard found the server through framework's import, with no .venv/bin on PATH.
        frames = data(code[-1], "text/html")
        assert frames, code[-1].outputs  # e.g. "ERROR: Could not find `tensorboard`"
        port = int(re.search(r"const port = (\d+);", frames[0]).group(1))
        try:
            with urllib.request.urlopen(f"http://localhost:{port}/", timeout=30) as page:
                assert page.status == 200
            runs = http_json(f"http://localhost:{port}/data/runs")
            experiment = http_json(f"http://localhost:{port}/data/plugin/hparams/experiment",
                                   {"experimentName": "", "includeMetrics": True})
        finally:
            stop_tensorboard(port)

    train, show, search, predict = code[1:5]
    # framework.run: a progress bar (a widget), the per-epoch lines, and a RunResult.
    assert data(train, "application/vnd.jupyter.widget-view+json")
    assert [line.split(" - ")[1].split("  step")[0] for line in texts(train).splitlines() if "] - epoch " in line] == \
        [f"epoch {n}" for n in range(1, 6)]
    [single] = [run for run in user.runs("train")]
    assert value(train).startswith("RunResult(val/acc=")
    assert f"run dir:         {single}\n" in texts(show)
    assert f"best checkpoint: {single / 'checkpoints' / 'best.pt'}\n" in texts(show)
    assert read_metrics(single)["epoch"] == 5
    # framework.sweep: the trials table, 3 complete trials.
    table = value(search, "text/html")
    assert table.count("<tr>") == 4 and table.count("COMPLETE") == 3
    assert "Trials of study 'train_random'" in texts(search)
    # The best model predicts digits.
    assert data(predict, "image/png") and "predicted: [" in texts(predict)
    # TensorBoard: the run named by name and time, each trial by its number and swept values; HPARAMS shows the
    # swept params first (the five it shows by default) and its metrics are curves, not hparam/* copies.
    assert f"train/{single.name}/tensorboard/train {single.name}" in runs
    for number in range(3):
        assert any(run.startswith(f"train/multirun/train_random/{number}/tensorboard/trial {number} batch_size=")
                   for run in runs), runs
    swept = {"batch_size", "lr", "model.depth", "model.width", "optimizer.weight_decay"}
    infos = experiment["hparamInfos"]
    assert {info["name"] for info in infos[:5]} == swept and all(info["differs"] for info in infos[:5])
    assert not any(info["differs"] for info in infos[5:])
    metrics = [info["name"]["tag"] for info in experiment["metricInfos"]]
    assert metrics[:3] == ["overview/loss/train", "overview/loss/val", "overview/metric/val/acc"]
    assert not any(tag.startswith("hparam") for tag in metrics)


@pytest.mark.timeout(180)
def test_a_mistake_in_a_notebook_shows_the_command_lines_one_line(user, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason=NEEDS)
    pytest.importorskip("nbclient", reason=NEEDS)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('import framework\nframework.run(["lr=-1"])')])
    client = kernel_client(notebook, user, keep_going=True)
    with client.setup_kernel(env=kernel_env(user), cwd=str(user.repo)):
        client.execute_cell(notebook.cells[0], 0)
    [error] = [output for output in notebook.cells[0].outputs if output.output_type == "error"]
    assert error.ename == "ConfigError"
    # No traceback through the framework: the line the command line prints (which error.line is, as
    # test_the_docs_run_from_a_script_prints_each_epoch_and_returns_the_run checks), taken in this process.
    with pytest.raises(ConfigError) as refused:
        run(["lr=-1", f"paths.output_dir={tmp_path}"])
    assert error.traceback == [refused.value.line]


# docs/notebook.md's Training and Errors blocks, which test_readme leaves to the test below.
DOCS_RUN = """import framework

result = framework.run(["name=quickstart", "trainer.max_epochs=2"])  # the config `python run.py ...` builds
print(result["val/acc"], result.run_dir, result.best_checkpoint)
model = framework.load_model(result.best_checkpoint)"""
DOCS_ERROR = """import framework
from framework.errors import RunlabError

try:
    framework.run(["lr=-1"])
except RunlabError as error:
    print(error.line)  # what `python run.py lr=-1` prints"""


@pytest.mark.timeout(180)
def test_the_docs_run_from_a_script_prints_each_epoch_and_returns_the_run(user, cli):
    # The two blocks verbatim, in one script (one process start fewer), and then the last checkpoint.
    script = f"{DOCS_RUN}\n{DOCS_ERROR}\nprint(result.last_checkpoint)"
    done = user.run(f"python -c {shlex.quote(script)}")
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = user.runs("quickstart")  # the refused run leaves no dir of its own
    assert [line for line in done.stdout.splitlines() if "] - epoch " in line][-1].split(" - ")[1].startswith("epoch 2 ")
    *_, result, refused, last = done.stdout.splitlines()
    val_acc, *paths = result.split()
    assert float(val_acc) == read_metrics(run_dir)["val/acc"]
    assert [*paths, last] == [str(run_dir), str(run_dir / "checkpoints" / "best.pt"), str(run_dir / "checkpoints" / "last.pt")]
    assert refused == one_line_error(cli("lr=-1"))


def test_sweep_refuses_what_is_not_a_search_preset(user):
    script = "import framework\ntry:\n    framework.sweep(['search=grid'])\nexcept framework.errors.ConfigError as error:\n" \
             "    print(error.line)"
    done = user.run(f"python -c {shlex.quote(script)}")
    assert done.stdout.strip() == ("runlab: error: framework.sweep runs the Optuna searches (search=random or search=tpe, "
                                   "or hydra/sweeper=runlab); run a grid with python run.py -m instead.")
    assert not (user.outputs / "train").exists()


def test_a_failed_command_becomes_the_error_it_printed():
    from framework.errors import ConfigError, Interrupted, SweepError, error_from_exit

    stopped = error_from_exit(5, "runlab: error: Stopped the sweep: 2 of 3 trials failed.")
    assert isinstance(stopped, SweepError) and stopped.line == "runlab: error: Stopped the sweep: 2 of 3 trials failed."
    assert isinstance(error_from_exit(2, "runlab: error: lr=-1.0 is invalid."), ConfigError)
    interrupted = error_from_exit(130, "runlab: interrupted: SIGINT at step 3 (epoch 1); saved last.pt.")
    assert isinstance(interrupted, Interrupted) and interrupted.exit_code == 130
    assert interrupted.line == "runlab: interrupted: SIGINT at step 3 (epoch 1); saved last.pt."
    assert error_from_exit(-9, "").line == "runlab: interrupted: the command was ended by SIGKILL."


def test_hydra_full_error_gives_a_notebook_the_traceback(monkeypatch):
    from framework.errors import ConfigError

    error = ConfigError("lr=-1.0 is invalid.")
    assert error._render_traceback_() == ["runlab: error: lr=-1.0 is invalid."]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    assert not hasattr(error, "_render_traceback_")  # IPython then shows its own traceback
