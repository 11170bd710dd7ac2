"""task=eval (conf/eval/): score a checkpoint on its test split (``eval.split=val``: its val split).

Everything comes from the checkpoint: the model (its saved constructor call and weights) and
the resolved config of its run, so the data split, normalisation, eval batch size and
precision are the run's own and scoring ``last.pt`` reproduces its final val metrics exactly.
The command line may override the data (``data=NAME``, ``data.KEY=VALUE``), ``device`` and
``trainer.*`` (e.g. ``trainer.precision``). Besides the loss and accuracy, the accuracy of each
class is reported under its label (``test/acc/<label>``), from the label names the checkpoint keeps.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, List

import torch
from omegaconf import DictConfig

from framework.checkpoint import load_checkpoint, model_from_state, resolve_checkpoint_path
from framework.config import checkpoint_config
from framework.errors import ConfigError
from framework.data import build_data, eval_batches
from framework.parallel import Environment, resolve_device
from framework.step import Precision, evaluate

log = logging.getLogger(__name__)

OVERRIDABLE = ("data", "device", "trainer")


def evaluate_checkpoint(cfg: DictConfig, run_dir: Path) -> Dict[str, float]:
    path = resolve_checkpoint_path(cfg.ckpt)
    state = load_checkpoint(path, require=("model", "model_spec", "config", "epoch", "step"))
    saved = checkpoint_config(cfg, state, OVERRIDABLE)
    # One process, whatever the training run used: scoring needs no gradients to share.
    env = Environment(device=resolve_device(saved.device))
    data = build_data(saved.data, saved.seed)
    classes = state["model_spec"].get("num_classes", data.num_classes)
    if classes != data.num_classes:
        raise ConfigError(f"the data has {data.num_classes} classes but the checkpoint's model predicts {classes}; "
                          "leave data.* as the checkpoint's run had it, or pick data with as many classes.")
    split = cfg.eval.split
    if not len(data.split(split)):
        raise ConfigError(f"eval.split={split} is empty for this data (data.{split}_fraction={saved.data[f'{split}_fraction']}).")
    model = env.wrap(model_from_state(state, path))
    batches = eval_batches(data.split(split), saved.data, env.device)
    precision = Precision(str(saved.trainer.precision), env.device)
    scores = evaluate(model, batches, env, precision)
    by_class = class_accuracy(model, batches, env, precision, state.get("classes") or data.classes)
    metrics = {f"{split}/loss": scores["loss"], f"{split}/acc": scores["acc"],
               **{f"{split}/acc/{label}": acc for label, acc in by_class.items()}, "epoch": state["epoch"], "step": state["step"]}
    log.info("%s at epoch %d, step %d, on %d %s samples: %s/loss %.6f  %s/acc %.6f", path, state["epoch"], state["step"],
             len(data.split(split)), split, split, scores["loss"], split, scores["acc"])
    log.info("%s/acc by label: %s", split, "  ".join(f"{label} {acc:.4f}" for label, acc in by_class.items()))
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("Metrics written to %s.", run_dir / "metrics.json")
    return metrics


@torch.inference_mode()
def class_accuracy(model: torch.nn.Module, batches, env: Environment, precision: Precision,
                   labels: List[str]) -> Dict[str, float]:
    """The accuracy on each class's samples, by label (a class without samples is left out)."""
    correct, total = torch.zeros(len(labels)), torch.zeros(len(labels))
    for x, y in batches:
        with precision.autocast():
            predicted = model(x.to(env.device)).argmax(1).cpu()
        y = y.cpu()
        total += torch.bincount(y, minlength=len(labels))
        correct += torch.bincount(y[predicted == y], minlength=len(labels))
    return {label: (correct[i] / total[i]).item() for i, label in enumerate(labels) if total[i]}
