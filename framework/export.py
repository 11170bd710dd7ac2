"""task=export: a checkpoint as a self-contained artifact to share, in <run dir>/artifact/.

- ``model.pt2``: the network as a ``torch.export`` program with a dynamic batch size, run
  without this project by ``torch.export.load("model.pt2").module()(x)``; a TorchScript
  ``model.ts`` (``torch.jit.load``) when torch.export cannot capture the model.
- ``weights.safetensors`` (a weights-only ``weights.pt`` without the safetensors package).
- ``model_spec.json`` (the constructor call), ``config.yaml`` (the run's resolved config) and
  ``manifest.json`` (what is where, ``labels``: the label of each output, and the verification
  result).

Every file is written 0644, readable by the group and others, like any file meant to be shared.

Both program formats are unpickled by torch when loaded, so treat them like code and load
them only from sources you trust. The weights and JSON files are plain data: ``load_artifact``
rebuilds the model from those alone and refuses anything that is not a runlab artifact.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Dict

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.checkpoint import (checkpoint_classes, checked_spec, load_checkpoint, model_from_state, read_pretrained,
                                 resolve_checkpoint_path)
from framework.config import checkpoint_config
from framework.data import build_data, collate_function, first
from framework.errors import CheckpointError, ConfigError
from framework.model import build_model
from framework.objective import objective_class, saved_objective

log = logging.getLogger(__name__)

FORMAT = "runlab-export"
VERSION = 1
SAMPLE_SIZE = 8
WEIGHT_FILES = ("weights.safetensors", "weights.pt")


def export(cfg: DictConfig, run_dir: Path) -> Dict[str, float]:
    path = resolve_checkpoint_path(cfg.ckpt)
    state = load_checkpoint(path)
    model = model_from_state(state, path).eval()
    saved = checkpoint_config(cfg, state, ("data",))
    objective = objective_class(saved_objective(saved))
    sample = objective.example_input(first(build_data(saved.data, saved.seed).val, SAMPLE_SIZE,
                                           collate_function(saved.data)))
    if not isinstance(sample, torch.Tensor):
        raise ConfigError(f"task=export traces the model on a tensor input, but this data's inputs are a "
                          f"{type(sample).__name__}; export the weights from {path} with framework.load_model instead.")
    directory = Path(run_dir) / "artifact"
    directory.mkdir(parents=True, exist_ok=True)
    # Labels name a classifier's outputs; a regression's or a language model's outputs have none.
    labels = checkpoint_classes(state) if objective.labels_outputs else []
    manifest = {"format": FORMAT, "version": VERSION, "program": write_program(model, sample, directory),
                "weights": write_weights(model, directory), "model_spec": "model_spec.json", "config": "config.yaml",
                "input_shape": list(sample.shape[1:]), "labels": labels, "source": str(path),
                "torch": torch.__version__}
    (directory / "model_spec.json").write_text(json.dumps(state["model_spec"], indent=2) + "\n")
    (directory / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(state["config"])))
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    differences = verify(directory, manifest, model, sample)
    manifest["verified_max_abs_diff"] = differences
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for written in directory.iterdir():  # safetensors, for one, creates its file 0600
        written.chmod(0o644)
    log.info("Exported %s to %s: %s. On a sample batch of %d the outputs equal the original's (max abs diff: %s).",
             path, directory, ", ".join(sorted(p.name for p in directory.iterdir())), len(sample),
             ", ".join(f"{name} {value:.3g}" for name, value in differences.items()))
    metrics = {f"export/max_abs_diff_{name}": value for name, value in differences.items()}
    (Path(run_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def write_program(model: nn.Module, sample: torch.Tensor, directory: Path) -> str:
    """The network as a program, torch.export first, TorchScript second; "" when neither captures it."""
    try:
        program = torch.export.export(model, (sample,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
        torch.export.save(program, directory / "model.pt2")
        return "model.pt2"
    except Exception as error:  # any failure to capture means: try the next format
        log.warning("torch.export cannot capture %s (%s); trying TorchScript.", type(model).__name__, error)
    try:
        torch.jit.save(torch.jit.trace(model, sample), directory / "model.ts")
        return "model.ts"
    except Exception as error:
        log.warning("TorchScript cannot capture %s either (%s); the artifact holds weights and model_spec only.",
                    type(model).__name__, error)
        return ""


def write_weights(model: nn.Module, directory: Path) -> str:
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    try:
        from safetensors.torch import save_file
    except ImportError:
        torch.save(weights, directory / "weights.pt")
        return "weights.pt"
    save_file(weights, str(directory / "weights.safetensors"), metadata={"format": FORMAT})
    return "weights.safetensors"


def load_program(path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """The saved program; torch unpickles it, so only for artifacts you trust (such as one just written)."""
    if path.suffix == ".pt2":
        return torch.export.load(path).module()
    return torch.jit.load(str(path))


def load_artifact(directory: str | Path) -> nn.Module:
    """The exported model rebuilt from model_spec.json and the weights file, in eval mode, with
    ``model.classes`` from the manifest's labels.

    Reads only data (JSON and tensors), never a program, so it is safe on untrusted files.
    """
    directory = Path(directory)
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        spec = json.loads((directory / "model_spec.json").read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{directory} is not a runlab export: manifest.json or model_spec.json is missing or unreadable.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("weights") not in WEIGHT_FILES:
        raise CheckpointError(f"{directory} is not a runlab export (its manifest.json lacks the runlab format marker).")
    model = build_model(checked_spec(spec, directory))
    try:
        model.load_state_dict(read_pretrained(directory / manifest["weights"])["model"])
    except RuntimeError as error:
        raise CheckpointError(f"{directory}: the weights do not fit model_spec.json ({str(error).splitlines()[0]}).") from None
    model.classes = manifest.get("labels", [])
    return model.eval()


@torch.inference_mode()
def verify(directory: Path, manifest: Dict, model: nn.Module, sample: torch.Tensor) -> Dict[str, float]:
    """Reload what was written and compare outputs with the original; refuse to finish on a difference."""
    expected = model(sample)
    reloaded: Dict[str, Callable] = {"weights": load_artifact(directory)}
    if manifest["program"]:
        reloaded["program"] = load_program(directory / manifest["program"])
    differences = {}
    for name, module in reloaded.items():
        outputs = module(sample)
        # A smaller batch checks that the program's batch size really is dynamic; its kernels may round
        # differently from the original's at that size (a GRU's do), so it is compared to float precision.
        smaller = torch.allclose(module(sample[:3]), model(sample[:3]), rtol=1e-5, atol=1e-6)
        if not (torch.equal(outputs, expected) and smaller):
            raise RuntimeError(f"the exported {name} gives different outputs from the checkpoint's model "
                               f"(max abs diff {(outputs - expected).abs().max().item():.3g}); the artifact in {directory} is not usable.")
        differences[name] = (outputs - expected).abs().max().item()
    return differences
