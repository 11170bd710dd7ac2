"""Experiment loggers (conf/logger/): TensorBoard, CSV, Weights & Biases, or none.

The trainer calls every method unconditionally; each logger decides what to keep (for
example, histograms only every ``histogram_every_n_epochs``). Only rank 0 gets a real
logger; the other ranks get the silent base class.
"""
from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Dict, Mapping

import torch
from omegaconf import DictConfig
from torch import nn

log = logging.getLogger(__name__)

Scalars = Mapping[str, float]


class Logger:
    """The silent logger (logger=none, and every rank but 0)."""

    def log_metrics(self, metrics: Scalars, step: int) -> None: ...

    def log_graph(self, model: nn.Module, example: torch.Tensor) -> None: ...

    def log_histograms(self, model: nn.Module, epoch: int) -> None: ...

    def log_predictions(self, images: torch.Tensor, labels: torch.Tensor, predictions: torch.Tensor, epoch: int) -> None: ...

    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None: ...

    def close(self) -> None: ...


def prediction_figure(images: torch.Tensor, labels: torch.Tensor, predictions: torch.Tensor):
    """A grid of sample inputs titled 'pred/true', red where the prediction is wrong."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = min(len(images), 16)
    columns = min(count, 8)
    rows = -(-count // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(1.2 * columns, 1.4 * rows), squeeze=False)
    for i, axis in enumerate(axes.flat):
        axis.axis("off")
        if i < count:
            axis.imshow(images[i].float().mean(0).cpu(), cmap="gray")
            right = int(predictions[i]) == int(labels[i])
            axis.set_title(f"{int(predictions[i])}/{int(labels[i])}", fontsize=8, color="black" if right else "red")
    figure.tight_layout()
    return figure


class TensorBoardLogger(Logger):
    def __init__(self, cfg: DictConfig, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.cfg = cfg
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_metrics(self, metrics: Scalars, step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_graph(self, model: nn.Module, example: torch.Tensor) -> None:
        if not self.cfg.log_graph:
            return
        try:
            self.writer.add_graph(model, example)
        except Exception as error:  # tracing fails for some user models; the run must not
            log.warning("TensorBoard could not trace the model graph (%s); skipping it.", error)

    def log_histograms(self, model: nn.Module, epoch: int) -> None:
        every = self.cfg.histogram_every_n_epochs
        if not every or epoch % every:
            return
        for name, parameter in model.named_parameters():
            self.writer.add_histogram(f"weights/{name}", parameter.detach(), epoch)
            if parameter.grad is not None:
                self.writer.add_histogram(f"grads/{name}", parameter.grad, epoch)

    def log_predictions(self, images, labels, predictions, epoch: int) -> None:
        if self.cfg.log_images:
            self.writer.add_figure("predictions", prediction_figure(images, labels, predictions), epoch)

    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None:
        # Written into this run's own event file (SummaryWriter.add_hparams would open a
        # sub-run), so each run of a sweep is one row in TensorBoard's HPARAMS tab.
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        experiment, start, end = hparams_summary(dict(hparams), {f"hparam/{k}": v for k, v in metrics.items()})
        for summary in (experiment, start, end):
            self.writer.file_writer.add_summary(summary)
        for name, value in metrics.items():
            self.writer.add_scalar(f"hparam/{name}", value)

    def close(self) -> None:
        self.writer.close()


class CSVLogger(Logger):
    """One row per (step, metric, value) in metrics.csv: easy to load with any tool."""

    def __init__(self, path: Path):
        self.handle = open(path, "w", newline="")
        self.writer = csv.writer(self.handle)
        self.writer.writerow(["step", "metric", "value"])

    def log_metrics(self, metrics: Scalars, step: int) -> None:
        self.writer.writerows([step, name, value] for name, value in metrics.items())
        self.handle.flush()

    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None:
        self.writer.writerows(["hparams", name, value] for name, value in hparams.items())

    def close(self) -> None:
        self.handle.close()


class WandbLogger(Logger):
    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise ImportError("logger=wandb needs the wandb package: pip install -e '.[wandb]'.") from None
        self.run = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(run_dir), config=config)

    def log_metrics(self, metrics: Scalars, step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_hparams(self, hparams: Scalars, metrics: Scalars) -> None:
        self.run.summary.update(dict(metrics))

    def close(self) -> None:
        self.run.finish()


def build_logger(cfg: DictConfig, run_dir: Path, is_main: bool, config: dict) -> Logger:
    if not is_main or cfg.name == "none":
        return Logger()
    if cfg.name == "tensorboard":
        return TensorBoardLogger(cfg, run_dir / "tensorboard")
    if cfg.name == "csv":
        return CSVLogger(run_dir / "metrics.csv")
    return WandbLogger(cfg, run_dir, config)
