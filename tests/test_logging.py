import csv
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

from conftest import REPO
from framework.errors import ResourceError
from framework.logger import CSVLogger, TensorBoardLogger
from framework.parallel import Compile, compiled
from framework.parallel.fsdp import compiled_blocks

# The group TensorBoard opens on, in the order it shows the cards.
OVERVIEW = ["overview/loss/train", "overview/loss/val", "overview/metric/val/acc", "overview/metric/val/acc_top5",
            "overview/metric/val/f1", "overview/optimizer/lr",
            "overview/system/memory_peak_mb", "overview/system/samples_per_second"]


def event_dir(run_dir):
    """The folder under tensorboard/ that holds the run's events; its name is the run's name in TensorBoard."""
    [folder] = (run_dir / "tensorboard").iterdir()
    return folder


def read_events(run_dir):
    accumulator = EventAccumulator(str(event_dir(run_dir)),
                                   size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def session_start(events):
    content = events.PluginTagToContent("hparams")
    # No experiment summary: TensorBoard builds the HPARAMS table from all the runs it reads.
    assert set(content) == {"_hparams_/session_start_info"}
    return plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info


def test_tensorboard_holds_scalars_histograms_images_graph_and_hparams(train):
    metrics, run_dir = train("model=cnn", "model.channels=[4,8]", "logger.histogram_every_n_epochs=1", "lr=3e-3")
    events = read_events(run_dir)
    tags = events.Tags()
    assert set(OVERVIEW) <= set(tags["scalars"]) and "train/loss_running" in tags["scalars"]
    assert [e.value for e in events.Scalars("overview/metric/val/acc")][-1] == pytest.approx(metrics["val/acc"])
    assert events.Scalars("test/acc")[-1].value == pytest.approx(metrics["test/acc"])
    assert len(events.Histograms("weights/head.weight")) == 3 and len(events.Histograms("weights/head.weight/grad")) == 3
    assert tags["images"] == ["predictions/pred_true"]
    assert tags["graph"]
    start = session_start(events)
    assert start.hparams["lr"].number_value == pytest.approx(3e-3)
    assert start.hparams["model"].string_value == "CNN"


def test_tensorboard_opens_on_the_overview_and_keeps_hparams_out_of_the_charts(train):
    metrics, run_dir = train()
    events = read_events(run_dir)
    tags = events.Tags()
    every = tags["scalars"] + tags["histograms"] + tags["images"]
    # TensorBoard lists groups (the text before the first "/") alphabetically and opens on the first;
    # in a group it orders cards by tag: train and val loss side by side first.
    assert min(tag.split("/")[0] for tag in every) == "overview"
    assert sorted(tag for tag in every if tag.startswith("overview/")) == OVERVIEW
    # Every chart is a curve but the test split's, scored once; the hparams metrics are the curves' last values.
    assert sorted(tag for tag in tags["scalars"] if len(events.Scalars(tag)) == 1) == ["test/acc", "test/acc_top5", "test/f1", "test/loss"]
    assert not any(tag.startswith("hparam") for tag in every)
    # CUSTOM SCALARS: train and val loss in one chart, then the monitored metric, lr, throughput and memory.
    [config] = events.Tensors("custom_scalars__config__")
    [category] = layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item()).category
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert category.title == "overview"
    assert list(charts) == ["loss (train, val)", "val/acc (checkpoint.monitor)", "learning rate", "throughput (samples/s)",
                            "peak memory (MB)"]
    assert charts["loss (train, val)"] == ["^overview/loss/train$", "^overview/loss/val$"]
    for patterns in charts.values():
        assert all(any(re.match(pattern, tag) for tag in tags["scalars"]) for pattern in patterns), patterns
    # The run is named by its name and run dir (by default its start time), as a folder and as an HPARAMS row.
    assert event_dir(run_dir).name == session_start(events).group_name == f"train {run_dir.name}"


def test_a_histogram_summarises_the_finite_values(tmp_path):
    logger = TensorBoardLogger(tmp_path, "run", "val/acc", histogram_every_n_epochs=1, log_graph=False, log_images=False)
    weights = torch.nn.Linear(2, 2)
    weights.weight.data = torch.tensor([[0.5, -1.0], [float("nan"), 2.0]])
    weights.bias.data = torch.full((2,), float("inf"))  # no finite value: no histogram
    weights.weight.grad = torch.ones(2, 2)
    logger.log_histograms(weights, epoch=0)
    logger.close()
    events = read_events(tmp_path)
    assert events.Tags()["histograms"] == ["weights/weight", "weights/weight/grad"]
    grad = events.Histograms("weights/weight/grad")[0].histogram_value
    assert (grad.min, grad.max, grad.num) == (1.0, 1.0, 4) and sum(grad.bucket) == 4  # one value: a bin around it
    histogram = events.Histograms("weights/weight")[0].histogram_value
    assert (histogram.min, histogram.max, histogram.num, histogram.sum, histogram.sum_squares) == (-1.0, 2.0, 3, 1.5, 5.25)
    assert sum(histogram.bucket) == 3 and histogram.bucket_limit[-1] == 2.0


def test_histogram_tags_are_the_parameters_plain_names_under_trainer_compile(tmp_path):
    """torch.compile's wrapper puts "_orig_mod." in its parameters' names: fsdp compiles each block, none the model."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 1)))
    compiled_blocks(model, [model[1]], Compile("aot_eager", None))
    model = compiled(model, Compile("aot_eager", None))
    assert [name for name, _ in model.named_parameters()][2] == "_orig_mod.1._orig_mod.0.weight"
    logger = TensorBoardLogger(tmp_path, "run", "val/acc", histogram_every_n_epochs=1, log_graph=False, log_images=False)
    logger.log_histograms(model, epoch=0)
    logger.close()
    assert read_events(tmp_path).Tags()["histograms"] == ["weights/0.weight", "weights/0.bias", "weights/1.0.weight",
                                                          "weights/1.0.bias"]


def test_tracing_the_graph_changes_nothing_that_is_trained(train):
    # A trace runs the model: before or during training it would draw dropout's random numbers.
    traced, _ = train("model.dropout=0.5", "logger.log_graph=true")
    untraced, _ = train("model.dropout=0.5", "logger.log_graph=false")
    assert traced["val/loss"] == untraced["val/loss"]


def test_the_prediction_grid_is_large_enough_to_read(train):
    _, run_dir = train()
    [grid] = read_events(run_dir).Images("predictions/pred_true")
    # 16 samples in 4 columns of 64-pixel cells under 21-pixel captions (the 3x5 font drawn at 3x), 1-pixel borders.
    assert (grid.width, grid.height) == (4 * 66, 4 * 87)


@pytest.mark.timeout(240)
def test_a_grid_sweep_names_each_job_by_number_and_swept_values(cli, user):
    result = cli("-m", "lr=1e-3,3e-3", "trainer.max_epochs=1", "trainer.progress_bar=false", "model.width=32")
    assert result.returncode == 0, result.stderr[-2000:]
    [sweep_dir] = (user.outputs / "train" / "multirun").iterdir()
    for number, lr in ((0, "0.001"), (1, "0.003")):
        events = read_events(sweep_dir / str(number))
        assert event_dir(sweep_dir / str(number)).name == session_start(events).group_name == f"trial {number} lr={lr}"


def test_tabular_data_logs_no_image_grid(train):
    _, run_dir = train("data=synthetic", "data.num_samples=300")
    assert read_events(run_dir).Tags()["images"] == []


def test_csv_logger_writes_one_row_per_value(train):
    metrics, run_dir = train("logger=csv")
    with open(run_dir / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    val_acc = [float(r["value"]) for r in rows if r["metric"] == "val/acc"]
    assert len(val_acc) == 3 and val_acc[-1] == pytest.approx(metrics["val/acc"])
    assert not (run_dir / "tensorboard").exists()


def test_logger_none_writes_only_the_run_files(train):
    _, run_dir = train("logger=none")
    assert not (run_dir / "tensorboard").exists() and (run_dir / "metrics.json").is_file()


@pytest.mark.timeout(180)
def test_wandb_runs_offline_without_an_account(train, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    metrics, run_dir = train("logger=wandb", "trainer.max_epochs=1")
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_the_tensorboard_logger_leaves_botocore_unimported_but_importable():
    """TensorBoard imports botocore for s3:// log dirs (0.1-0.2 s), which a run never has; code that
    needs botocore afterwards still imports it."""
    script = ("import sys; from framework.logger import summary_writer_class; summary_writer_class()\n"
              "assert 'botocore' not in sys.modules, 'botocore was imported'\n"
              "import botocore.exceptions")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device every write to fails with ENOSPC")
@pytest.mark.parametrize("logger", ["tensorboard", "csv"])
def test_a_logger_that_finds_the_disk_full_ends_the_run_with_one_line(tmp_path, logger, monkeypatch):
    """Writes that fail for want of space (here: to /dev/full) end the run as a checkpoint's do; TensorBoard's
    writer thread hands its error to the writer's next call."""
    caught_thread_errors = []
    monkeypatch.setattr(threading, "excepthook", caught_thread_errors.append)
    if logger == "tensorboard":  # its writer opens the events file for every write
        writer = TensorBoardLogger(tmp_path, "run", "val/acc", histogram_every_n_epochs=1, log_graph=False, log_images=False)
        writer.writer.flush()  # nothing queued is written after the file is replaced
        [events] = writer.directory.iterdir()
        events.unlink()
        events.symlink_to("/dev/full")
    else:
        (tmp_path / "metrics.csv").symlink_to("/dev/full")
        writer = CSVLogger(tmp_path)
    with pytest.raises(ResourceError) as raised:
        for step in range(100):
            writer.log_metrics({"train/loss": 1.0}, step)
            time.sleep(0.01)
        writer.close()
    assert str(raised.value) == (f"no space left on device writing {writer.directory}; the checkpoints written before "
                                 "it are kept. Free some space, then continue with resume=auto.")
    assert raised.value.exit_code == 4
    assert not caught_thread_errors  # TensorBoard's thread dies quietly: the run's one line says it all


def test_a_resumed_training_is_one_tensorboard_run_whose_curves_go_on(train):
    common = ["trainer.max_epochs=3", "trainer.log_every_n_steps=5", "early_stopping.enabled=false"]
    _, first = train(*common, "trainer.max_steps=30")
    _, second = train(*common, f"resume={first / 'checkpoints' / 'last.pt'}")
    assert (second / "tensorboard").resolve() == (first / "tensorboard").resolve()
    events = read_events(first)
    steps = [event.step for event in events.Scalars("train/loss_running")]
    assert steps == list(range(5, 58, 5))  # one curve, each step once, on to the end of epoch 3
    assert [event.step for event in events.Scalars("overview/metric/val/acc")] == [19, 30, 38, 57]
    # TensorBoard reads the files in name order, which starts with the second each was made in: the resume's is
    # named after a later second, even here, where it follows at once (in the same second its file could sort first).
    seconds = [int(path.name.split(".")[3]) for path in sorted(event_dir(first).glob("events.out.tfevents.*"))]
    assert len(seconds) == 2 and seconds[0] < seconds[1]


def test_every_log_line_has_the_one_format_and_a_ddp_worker_its_rank_prefix(tmp_path):
    from conftest import composed
    from framework.errors import LOG_FORMAT
    from framework.parallel.distributed import log_as_rank

    assert composed().hydra.job_logging.formatters.simple.format == LOG_FORMAT  # python run.py's console and train.log
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        log_as_rank(1, tmp_path / "train.log")
        assert {handler.formatter._fmt for handler in root.handlers} == {"[rank 1]" + LOG_FORMAT}
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    # Written once: a second copy of the format would drift from this one.
    sources = [*REPO.joinpath("framework").rglob("*.py"), *REPO.joinpath("conf").rglob("*.yaml")]
    assert [path.name for path in sources if "%(asctime)" in path.read_text()] == ["errors.py"]
