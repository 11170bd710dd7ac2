"""Experiment loggers (conf/logger/): TensorBoard, CSV, Weights & Biases, or none.

The trainer calls every method unconditionally; each logger decides what to keep (for
example, histograms only every ``histogram_every_n_epochs``). Only rank 0 gets a real
logger; the other ranks get the silent base class.
"""
from __future__ import annotations

import csv
import functools
import logging
import math
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping

import torch
import torch.nn.functional as F
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.config import accepted_keys
from framework.errors import ResourceError, disk_full, instantiate
from framework.parallel import plain_named_parameters
from framework.paths import shown
from framework.private_apis import quiet_writer_thread_errors, summary_writer_class
from framework.search.trial import NoTrial

log = logging.getLogger(__name__)

Scalars = Mapping[str, float]


class Logger:
    """The silent logger (logger=none, and every rank but 0).

    Each option of conf/logger/ names its class in ``_target_``; ``build_logger`` builds it with the
    option's keys and, as keyword arguments, what of the run (``run_arguments``) its constructor takes.
    """

    def log_metrics(self, metrics: Scalars, step: int) -> None: ...

    def log_graph(self, model: nn.Module, example: torch.Tensor) -> None: ...

    def log_histograms(self, model: nn.Module, epoch: int) -> None: ...

    def log_predictions(self, images: torch.Tensor, labels: torch.Tensor, predictions: torch.Tensor, epoch: int) -> None: ...

    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None: ...

    def continue_run(self, previous_run_dir: Path, step: int) -> None:
        """A resumed training goes on logging where the run it continues logged, from ``step`` on."""

    def close(self) -> None: ...


def after_the_second_of_the_last_events_file(directory: Path) -> None:
    """Wait, less than a second, until the clock is past the second the newest events file in ``directory``
    is named after. TensorBoard reads a run's files in name order: the second each was made in, then the
    host, the process id and a count of the writers that process made. A resume in the same second (a run
    continued from Python just after it ended) could sort first, and its steps would then come before the
    stopped run's, which TensorBoard drops as out of order."""
    seconds = [int(name.split(".")[3]) for name in os.listdir(directory) if name.startswith("events.out.tfevents.")]
    while seconds and time.time() < max(seconds) + 1:
        time.sleep(0.05)


def stops_on_a_full_disk(write):
    """A logger's write that finds the disk full ends the run with its one line (exit code 4), as a
    checkpoint's does; TensorBoard's writer thread raises its error at the writer's next call."""
    @functools.wraps(write)
    def guarded(self, *args, **kwargs):
        try:
            return write(self, *args, **kwargs)
        except OSError as error:
            if not disk_full(error, self.directory):
                raise
            raise ResourceError(f"no space left on device writing {shown(self.directory)}; the checkpoints written "
                                "before it are kept. Free some space, then continue with resume=auto.") from None

    return guarded


# A 3x5 pixel font for the characters of "pred/true" captions: drawing them directly keeps
# matplotlib (and its ~0.7 s import) out of every run.
GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "/": "001001010100100",
}
RIGHT, WRONG = torch.tensor([0.2, 0.9, 0.2]), torch.tensor([1.0, 0.2, 0.2])
CELL = 64  # pixels per sample: an 8x8 digit drawn at 8x
# The font drawn at 3x (9x15 pixels): TensorBoard shows the grid at its own size, where 3x5 is unreadable.
FONT_SCALE = 3


def caption(text: str, color: torch.Tensor, width: int) -> torch.Tensor:
    """An RGB strip ``width`` pixels wide with ``text`` drawn in the 3x5 font at FONT_SCALE."""
    columns = width // FONT_SCALE
    strip = torch.zeros(3, 7, columns)
    for i, char in enumerate(text[: (columns - 1) // 4]):
        glyph = torch.tensor([int(b) for b in GLYPHS[char]], dtype=torch.float32).view(5, 3)
        strip[:, 1:6, 1 + 4 * i:4 + 4 * i] = glyph * color.view(3, 1, 1)
    strip = strip.repeat_interleave(FONT_SCALE, dim=1).repeat_interleave(FONT_SCALE, dim=2)
    return F.pad(strip, (0, width - strip.shape[2]))


def prediction_grid(images: torch.Tensor, labels: torch.Tensor, predictions: torch.Tensor, columns: int = 4) -> torch.Tensor:
    """Sample inputs captioned 'pred/true', green when right and red when wrong, as one CHW image."""
    cells = []
    for image, label, prediction in zip(images[:16].float().cpu(), labels[:16], predictions[:16]):
        gray = F.interpolate(image.mean(0)[None, None], size=(CELL, CELL), mode="nearest")[0]
        gray = (gray - gray.min()) / (gray.max() - gray.min()).clamp_min(1e-8)
        color = RIGHT if int(prediction) == int(label) else WRONG
        cells.append(torch.cat([gray.expand(3, -1, -1), caption(f"{int(prediction)}/{int(label)}", color, CELL)], dim=1))
    while len(cells) % columns and len(cells) > columns:
        cells.append(torch.zeros_like(cells[0]))
    rows = [torch.cat([F.pad(c, (1, 1, 1, 1)) for c in cells[i:i + columns]], dim=2) for i in range(0, len(cells), columns)]
    return torch.cat(rows, dim=1)


# TensorBoard lists tag groups (the text before the first "/") alphabetically and opens on the
# first: the curves to look at first share the group "overview", which sorts before every other
# group written here (predictions, test, train, troubleshoot, weights). Within it, cards sort by
# tag too: train and val loss first, side by side, then the objective's val metrics and lr, then
# memory and throughput. Other tags keep the metric's name.
TAGS = {"train/loss": "overview/loss/train", "val/loss": "overview/loss/val",
        "lr": "overview/optimizer/lr", "memory/peak_mb": "overview/system/memory_peak_mb",
        "train/samples_per_second": "overview/system/samples_per_second", "epoch": "train/epoch"}


def tag(metric: str) -> str:
    """A metric's TensorBoard tag: each val metric of the objective (val/acc, val/rmse, ...) in the overview."""
    if metric in TAGS:
        return TAGS[metric]
    return f"overview/metric/{metric}" if metric.startswith("val/") and metric.count("/") == 1 else metric


def overview_layout(monitor: str) -> Dict[str, Dict[str, list]]:
    """The CUSTOM SCALARS tab: train and val loss in one chart, then the monitored metric, lr,
    throughput and memory (each chart one line per run)."""
    return {"overview": {
        "loss (train, val)": ["Multiline", [f"^{tag('train/loss')}$", f"^{tag('val/loss')}$"]],
        f"{monitor} (checkpoint.monitor)": ["Multiline", [f"^{re.escape(tag(monitor))}$"]],
        "learning rate": ["Multiline", [f"^{tag('lr')}$"]],
        "throughput (samples/s)": ["Multiline", [f"^{tag('train/samples_per_second')}$"]],
        "peak memory (MB)": ["Multiline", [f"^{tag('memory/peak_mb')}$"]],
    }}


def run_name(name: str, run_dir: Path, trial: NoTrial) -> str:
    """The run's name in TensorBoard: the config's name and the run dir's (its start time), or for
    a trial of a sweep its number and swept values. It names the folder under tensorboard/ that
    holds the events (TensorBoard's run list shows the path to it) and the run's row in HPARAMS."""
    if trial.number is None:
        label = f"{name} {run_dir.name}"
    else:
        swept = (f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                 for key, value in sorted(trial.hparams().items()))
        label = " ".join([f"trial {trial.number}", *swept])
    return label.replace(os.sep, "_")[:200]  # one folder, within file systems' 255-byte names


HISTOGRAM_BINS = 30  # about as many as TensorBoard draws


def histogram(tag: str, values: torch.Tensor):
    """A TensorBoard histogram of the finite values, binned by torch where the tensor lives:
    ``SummaryWriter.add_histogram`` sorts every value in numpy (about 10 ms for a 256x256 weight,
    half a small model's epoch) into ~1500 bins, which TensorBoard redraws as about 30 anyway.
    None when no value is finite."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

    values = values.detach().flatten().float()
    stats = statistics(values)
    if not all(map(math.isfinite, stats)):  # a step skipped as non-finite leaves its gradients behind
        values = values[values.isfinite()]
        stats = statistics(values)
        if not stats:
            return None
    low, high, total, squares = stats
    # One value: a bin of width 1 around it, as numpy makes.
    first, last = (low, high) if low < high else (low - 0.5, high + 0.5)
    counts = torch.histc(values, bins=HISTOGRAM_BINS, min=first, max=last)
    # TensorBoard reads each bin's upper limit; a leading empty bin puts the lowest edge on the chart.
    histo = HistogramProto(min=low, max=high, num=values.numel(), sum=total, sum_squares=squares,
                           bucket_limit=torch.linspace(first, last, HISTOGRAM_BINS + 1).tolist(),
                           bucket=[0.0, *counts.tolist()])
    return Summary.Value(tag=tag, histo=histo)


def statistics(values: torch.Tensor) -> list:
    """Min, max, sum and sum of squares (nan or inf where a value is), in one host sync; [] when empty."""
    if not values.numel():
        return []
    return torch.stack([values.min(), values.max(), values.sum(), values.square().sum()]).tolist()


class TensorBoardLogger(Logger):
    def __init__(self, run_dir: Path, name: str, monitor: str, *, log_graph: bool, histogram_every_n_epochs: int,
                 log_images: bool):
        self.name, self.graph, self.histogram_every, self.images = name, log_graph, histogram_every_n_epochs, log_images
        self.directory = Path(run_dir) / "tensorboard" / name
        quiet_writer_thread_errors()
        self.writer = summary_writer_class()(log_dir=str(self.directory))
        self.writer.add_custom_scalars(overview_layout(monitor))

    def continue_run(self, previous_run_dir: Path, step: int) -> None:
        """One training, one TensorBoard run across resumes: this run dir's tensorboard/ becomes a link to the
        folder the training first logged in, and the writer goes on in its run from step + 1. TensorBoard
        drops what the stopped run logged after its checkpoint's step (purge_step), so curves continue
        instead of doubling back."""
        previous = (previous_run_dir / "tensorboard").resolve()  # a resumed run's own is a link already
        runs = [path for path in previous.iterdir() if path.is_dir()] if previous.is_dir() else []
        if len(runs) != 1:
            return  # it logged no TensorBoard run (logger=csv, none): this one starts its own
        own = self.directory.parent
        self.writer.close()
        if own.resolve() != previous:  # not a run continued in its own dir (a sweep's trial run again)
            shutil.rmtree(own)  # only the empty events file opened in __init__
            own.symlink_to(previous, target_is_directory=True)
        self.directory, self.name = runs[0], runs[0].name
        after_the_second_of_the_last_events_file(self.directory)
        self.writer = summary_writer_class()(log_dir=str(self.directory), purge_step=step + 1)

    @stops_on_a_full_disk
    def log_metrics(self, metrics: Scalars, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        # One event holds them all: the writer's thread wakes for each event, which costs more than the value.
        if metrics:
            values = [value for name, number in metrics.items() for value in scalar(tag(name), number).value]
            self.writer.file_writer.add_summary(Summary(value=values), step)

    @stops_on_a_full_disk
    def log_graph(self, model: nn.Module, example: torch.Tensor) -> None:
        if not self.graph:
            return
        try:
            with warnings.catch_warnings():
                # The trace's notes on Python values it freezes (an RNN's size checks): the graph is a
                # picture of the model, not a program to run, so they say nothing to the user.
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                # torch 2.14 marks the jit.trace that add_graph calls deprecated: TensorBoard's to change, not the user's.
                warnings.filterwarnings("ignore", r"`torch\.jit\.trace(_method)?` is deprecated", FutureWarning)
                self.writer.add_graph(model, example)
        except OSError:
            raise  # the disk, not the model
        except Exception as error:  # tracing fails for some user models; the run must not
            log.warning("TensorBoard could not trace the model graph (%s); skipping it.", error)

    @stops_on_a_full_disk
    def log_histograms(self, model: nn.Module, epoch: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        every = self.histogram_every
        if not every or epoch % every:
            return
        # Gradients beside their weights, in the group "weights" that sorts after "overview"; one event for all.
        # Tags by the names checkpoints hold, under trainer.compile too.
        tensors = {}
        for name, parameter in plain_named_parameters(model):
            tensors[f"weights/{name}"] = parameter
            if parameter.grad is not None:
                tensors[f"weights/{name}/grad"] = parameter.grad
        values = [histogram(tag, tensor) for tag, tensor in tensors.items()]
        self.writer.file_writer.add_summary(Summary(value=[value for value in values if value is not None]), epoch)

    @stops_on_a_full_disk
    def log_predictions(self, images, labels, predictions, epoch: int) -> None:
        if self.images:
            self.writer.add_image("predictions/pred_true", prediction_grid(images, labels, predictions), epoch)

    @stops_on_a_full_disk
    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None:
        # Only the session goes in (its hparams, its row named by the run's name), into this run's
        # own event file: SummaryWriter.add_hparams would open a sub-run and copy the metrics into
        # single-point charts. With no experiment summary either, TensorBoard builds the HPARAMS
        # table from all the runs it reads: it shows first the hparams whose values differ (a
        # sweep's swept ones), and its metrics are the last values of the curves above.
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb

        values = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
        self.writer.file_writer.add_summary(hparams_pb(values, trial_id=self.name))

    @stops_on_a_full_disk
    def close(self) -> None:
        self.writer.close()


class CSVLogger(Logger):
    """One row per (step, metric, value) in metrics.csv: easy to load with any tool."""

    def __init__(self, run_dir: Path):
        self.directory = Path(run_dir)
        self.handle = open(self.directory / "metrics.csv", "w", newline="")
        self.writer = csv.writer(self.handle)
        self.writer.writerow(["step", "metric", "value"])

    @stops_on_a_full_disk
    def log_metrics(self, metrics: Scalars, step: int) -> None:
        self.writer.writerows([step, name, value] for name, value in metrics.items())
        self.handle.flush()

    @stops_on_a_full_disk
    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None:
        self.writer.writerows(["hparams", name, value] for name, value in hparams.items())

    @stops_on_a_full_disk
    def close(self) -> None:
        self.handle.close()


class WandbLogger(Logger):
    def __init__(self, run_dir: Path, run_config: dict, *, wandb_project: str, wandb_mode: str):
        try:
            import wandb
        except ImportError:
            raise ImportError("logger=wandb needs the wandb package: pip install -e '.[wandb]'.") from None
        self.run = wandb.init(project=wandb_project, mode=str(wandb_mode), dir=str(run_dir), config=run_config)

    def log_metrics(self, metrics: Scalars, step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None:
        self.run.summary.update(dict(metrics))

    def close(self) -> None:
        self.run.finish()


def run_arguments(cfg: DictConfig, run_dir: Path, name: str) -> Dict[str, Any]:
    """What a logger may take of the run besides its option's keys (config.RUNTIME_ARGUMENTS["logger"])."""
    return {"run_dir": run_dir, "name": name, "monitor": cfg.checkpoint.monitor,
            "run_config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)}


def build_logger(cfg: DictConfig, run_dir: Path, is_main: bool, name: str) -> Logger:
    """The logger whose class ``cfg.logger._target_`` names, for the run called ``name`` (see ``run_name``)."""
    if not is_main:
        return Logger()
    takes = accepted_keys(get_object(cfg.logger._target_))
    run = {key: value for key, value in run_arguments(cfg, run_dir, name).items() if takes is None or key in takes}
    # Not recursive: run_config holds the run's _target_ nodes (model, optimizer, ...), which are to be logged, not built.
    return instantiate(cfg.logger, **run, _convert_="all", _recursive_=False)
