"""task=eval (conf/eval/): score a checkpoint on its test split (``eval.split=val``: its val split).

Everything comes from the checkpoint: the model (its saved constructor call and weights) and
the resolved config of its run, so the data split, normalisation, eval batch size and
precision are the run's own and scoring ``last.pt`` reproduces its final val metrics exactly.
The command line may override the data (``data=NAME``, ``data.KEY=VALUE``), ``device`` and
``trainer.*`` (e.g. ``trainer.precision``). It reports the objective's metrics (the run's own
``objective``), and for classification also the accuracy of each class under its label
(``test/acc/<label>``), from the label names the checkpoint keeps.
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
from framework.data import build_data, eval_batches, length
from framework.objective import Objective, build_objective, saved_objective
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
    outputs = state["model_spec"].get("num_classes", data.output_size)
    if outputs != data.output_size:
        raise ConfigError(f"the data needs {data.output_size} outputs per sample but the checkpoint's model makes {outputs}; "
                          "leave data.* as the checkpoint's run had it, or pick data with as many classes.")
    split = cfg.eval.split
    if not length(data.split(split)):
        raise ConfigError(f"eval.split={split} is empty for this data (data.{split}_fraction={saved.data.get(f'{split}_fraction')}).")
    objective = build_objective(saved_objective(saved), data.output_size).to(env.output_device)
    model = env.wrap(objective.wrap(model_from_state(state, path)))
    split_batches = eval_batches(data.split(split), saved.data, env.device)
    precision = Precision(str(saved.trainer.precision), env.device)
    scores = evaluate(model, objective, split_batches, env, precision)
    metrics = {f"{split}/{name}": value for name, value in scores.items()}
    log.info("%s at epoch %d, step %d, on %d %s samples: %s", path, state["epoch"], state["step"], length(data.split(split)),
             split, "  ".join(f"{name} {value:.6f}" for name, value in metrics.items()))
    if objective.labels_outputs:
        by_class = class_accuracy(model, objective, split_batches, env, precision, state.get("classes") or data.classes)
        metrics.update({f"{split}/acc/{label}": acc for label, acc in by_class.items()})
        log.info("%s/acc by label: %s", split, "  ".join(f"{label} {acc:.4f}" for label, acc in by_class.items()))
    metrics.update(epoch=state["epoch"], step=state["step"])
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("Metrics written to %s.", run_dir / "metrics.json")
    return metrics


@torch.inference_mode()
def class_accuracy(model: torch.nn.Module, objective: Objective, split_batches, env: Environment, precision: Precision,
                   labels: List[str]) -> Dict[str, float]:
    """The accuracy on each class's samples, by label (a class without samples is left out)."""
    correct, total = torch.zeros(len(labels)), torch.zeros(len(labels))
    for batch in split_batches:
        x, y = objective.inputs_and_target(batch)
        with precision.autocast():
            predicted = model(x).argmax(1).cpu()
        y = y.cpu()
        total += torch.bincount(y, minlength=len(labels))
        correct += torch.bincount(y[predicted == y], minlength=len(labels))
    return {label: (correct[i] / total[i]).item() for i, label in enumerate(labels) if total[i]}
