"""Experiment loggers (conf/logger/): TensorBoard, CSV, Weights & Biases, or none.

The trainer calls every method unconditionally; each logger decides what to keep (for
example, histograms only every ``histogram_every_n_epochs``). Only rank 0 gets a real
logger; the other ranks get the silent base class.
"""
from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
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


# A 3x5 pixel font for the characters of "pred/true" captions: drawing them directly keeps
# matplotlib (and its ~0.7 s import) out of every run.
GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "/": "001001010100100",
}
RIGHT, WRONG = torch.tensor([0.2, 0.9, 0.2]), torch.tensor([1.0, 0.2, 0.2])


def caption(text: str, color: torch.Tensor, width: int) -> torch.Tensor:
    """An RGB strip 7 pixels high with ``text`` drawn in the 3x5 font."""
    strip = torch.zeros(3, 7, width)
    for i, char in enumerate(text[: (width - 1) // 4]):
        glyph = torch.tensor([int(b) for b in GLYPHS[char]], dtype=torch.float32).view(5, 3)
        strip[:, 1:6, 1 + 4 * i:4 + 4 * i] = glyph * color.view(3, 1, 1)
    return strip


def prediction_grid(images: torch.Tensor, labels: torch.Tensor, predictions: torch.Tensor, columns: int = 8) -> torch.Tensor:
    """Sample inputs captioned 'pred/true', green when right and red when wrong, as one CHW image."""
    cells = []
    for image, label, prediction in zip(images[:16].float().cpu(), labels[:16], predictions[:16]):
        gray = F.interpolate(image.mean(0)[None, None], size=(32, 32), mode="nearest")[0]
        gray = (gray - gray.min()) / (gray.max() - gray.min()).clamp_min(1e-8)
        color = RIGHT if int(prediction) == int(label) else WRONG
        cells.append(torch.cat([gray.expand(3, -1, -1), caption(f"{int(prediction)}/{int(label)}", color, 32)], dim=1))
    while len(cells) % columns and len(cells) > columns:
        cells.append(torch.zeros_like(cells[0]))
    rows = [torch.cat([F.pad(c, (1, 1, 1, 1)) for c in cells[i:i + columns]], dim=2) for i in range(0, len(cells), columns)]
    return torch.cat(rows, dim=1)


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
            self.writer.add_image("predictions/pred_true", prediction_grid(images, labels, predictions), epoch)

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
