"""Fine-tuning (conf/finetune/): start from a pretrained run, replace the head, freeze by name.

The trainer builds its model through a ``Finetuner``: ``model_spec`` picks the architecture,
``prepare`` loads the pretrained weights, leaves the head freshly initialised when the labels
changed and freezes parameters by name, ``param_groups`` gives the optimizer the frozen
parameters that will join later, and ``on_epoch_start`` keeps frozen BatchNorm layers in
eval mode and unfreezes on schedule. With ``finetune.from`` empty and no ``freeze`` every
step is a no-op.

``finetune.from`` is a runlab checkpoint (or run dir), or a plain state dict as torchvision and
timm save one (``torch.save(model.state_dict(), PATH)``, or safetensors). A model that declares
no ``head_name`` has its output layer found under ``fc``, ``classifier``, ``head`` or ``heads``.
When ``from`` holds no checkpoint yet and ``finetune.pretrain`` names an experiment, that
experiment runs first, as its own command would.

The architecture is the checkpoint's saved ``model_spec``; the command line overrides it
with ``model=NAME`` or ``model._target_=CLASS`` (a new architecture: weights load where
names and shapes match) or ``model.KEY=VALUE`` (that key changed on top of the checkpoint's,
when the model takes it). Model keys set by an
experiment file or the defaults do not count: they were not written for this checkpoint.
"""
from __future__ import annotations

import copy
import logging
import os
import signal
import sys
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.checkpoint import checked_spec, read_pretrained, resolve_checkpoint_path
from framework.config import TRIAL_VARIABLES, command_line_overrides
from framework.errors import CheckpointError, ConfigError, Interrupted, RunlabError
from framework.model import BATCH_NORMS, accepted_keys, model_spec

log = logging.getLogger(__name__)

# What decides what the labels mean: a head trained on other labels is not reused.
LABEL_KEYS = ("_target_", "path", "root", "classes")
# Where torchvision and timm models keep their output layer.
HEAD_MODULES = ("fc", "classifier", "head", "heads")
RUN_PY = Path(__file__).resolve().parent.parent / "run.py"


def detect_head(model: nn.Module) -> str:
    """The output layer under the first of HEAD_MODULES the model has: its last Linear or Conv2d
    (``fc``, ``classifier.6``, ``head.fc``); "" when there is none."""
    for name in HEAD_MODULES:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        layers = [sub for sub, layer in module.named_modules() if isinstance(layer, (nn.Linear, nn.Conv2d))]
        if layers:
            return f"{name}.{layers[-1]}".rstrip(".")
    return ""


def has_checkpoint(path: str) -> bool:
    try:
        resolve_checkpoint_path(path)
        return True
    except CheckpointError:
        return False


def pretrain_if_missing(cfg: DictConfig) -> None:
    """Run the experiment ``finetune.pretrain`` first when ``finetune.from`` holds no checkpoint yet,
    in its own process exactly as ``python run.py experiment=NAME`` would, writing under this
    run's paths.output_dir."""
    source, experiment = cfg.finetune["from"], cfg.finetune.pretrain
    if not (source and experiment) or has_checkpoint(source):
        return
    from framework import parallel

    processes = parallel.launched_world_size(cfg)
    if processes > 1:  # each of them would pretrain, into the same outputs
        raise ConfigError(f"finetune.from={source} holds no checkpoint yet, and finetune.pretrain={experiment} cannot "
                          f"run in each of the {processes} processes torchrun or the SLURM job started: run "
                          f"python run.py experiment={experiment} first.")
    command = [f"experiment={experiment}", *budget_overrides(cfg)]
    log.info("finetune.from=%s holds no checkpoint yet, so finetune.pretrain runs first: python run.py %s",
             source, " ".join(command))
    from framework.entry import run_command

    try:  # its epoch lines show as they come (no progress bar: its stderr is read for the one line it may end with)
        run_command([sys.executable, str(RUN_PY), *command, f"paths.output_dir={cfg.paths.output_dir}"],
                    env=pretraining_environment())
    except RunlabError as error:
        if isinstance(error, Interrupted) and error.signum in (signal.SIGINT, signal.SIGTERM):
            raise  # Ctrl-C or SIGTERM, meant for this run as much as for its pretraining
        raise ConfigError(f"finetune.pretrain={experiment} failed: {error}") from None
    if not has_checkpoint(source):
        raise ConfigError(f"finetune.pretrain={experiment} did not leave a checkpoint in finetune.from={source}; "
                          f"set finetune.from to where python run.py experiment={experiment} writes its runs.")


def pretraining_environment() -> Dict[str, str]:
    """This process's environment for the pretraining, a run of its own: not a rank of this run's
    torchrun group, and not this sweep trial (whose study the sweeper names in TRIAL_VARIABLES:
    the pretraining would report its validations to the trial, and could prune it)."""
    from framework.parallel.distributed import outside_any_group

    return {name: value for name, value in outside_any_group(os.environ).items() if name not in TRIAL_VARIABLES}


BUDGET_KEYS = ("max_epochs", "max_steps", "progress_bar")


def budget_overrides(cfg: DictConfig) -> List[str]:
    """The trainer budget this command line set (trainer.max_steps=1 in a smoke test): the pretraining
    it starts keeps to it too."""
    _, keys = command_line_overrides("trainer")
    return [f"trainer.{key}={cfg.trainer[key]}" for key in BUDGET_KEYS if key in keys]


def first_names(keys: List[str]) -> str:
    return f"{', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"


class Finetuner:
    def __init__(self, cfg: DictConfig):
        self.cfg, self.data_cfg = cfg.finetune, cfg.data
        self.source: Optional[Path] = None
        self.pretrained: Dict[str, Any] = {}
        if self.cfg["from"]:
            self.source = resolve_checkpoint_path(self.cfg["from"])
            self.pretrained = read_pretrained(self.source)
        self.model: Optional[nn.Module] = None
        self.frozen: Dict[str, nn.Parameter] = {}
        self.frozen_norms: List[nn.Module] = []

    # --- architecture ------------------------------------------------------------------

    def model_spec(self, model_cfg: DictConfig, input_shape: Tuple[int, ...], num_classes: int) -> Dict[str, Any]:
        saved = self.pretrained.get("model_spec")
        replaced, keys = command_line_overrides("model")
        if saved is None or replaced or "_target_" in keys:
            return model_spec(model_cfg, input_shape, num_classes)
        spec = copy.deepcopy(checked_spec(saved, self.source))
        accepted = accepted_keys(get_object(spec["_target_"]))
        keys = {k for k in keys if accepted is None or k in accepted}  # e.g. model.width for a model without one
        given = OmegaConf.to_container(model_cfg, resolve=True)
        spec.update({key: given[key] for key in keys})
        # The shapes follow this run's data: a new class count gets a new head.
        spec.update({k: v for k, v in (("input_shape", list(input_shape)), ("num_classes", num_classes)) if k in spec})
        log.info("finetune.from=%s: architecture %s from the checkpoint%s.", self.source, spec["_target_"],
                 f", with model.{{{','.join(sorted(keys))}}} from the command line" if keys else "")
        return spec

    # --- weights and freezing ----------------------------------------------------------

    def prepare(self, model: nn.Module) -> nn.Module:
        self.model = model
        if self.pretrained:
            self._load_pretrained(model)
        self._freeze(model)
        return model

    def _head_keys(self, model: nn.Module, incoming: Dict[str, Any]) -> Set[str]:
        """The head's weights, when the head must not be reused: other classes, or other labels."""
        own = model.state_dict()
        head = self.cfg.head or getattr(model, "head_name", "") or detect_head(model)
        if head:
            try:
                model.get_submodule(head)
            except AttributeError:
                raise ConfigError(f"finetune.head={head!r} is not a module of {type(model).__name__}; "
                                  f"its top-level modules are {', '.join(n for n, _ in model.named_children())}.") from None
        head_keys = {k for k in own if k.startswith(f"{head}.")} if head else set()
        shape_changed = any(k in incoming and incoming[k].shape != own[k].shape for k in head_keys)
        saved_data = self.pretrained.get("config", {}).get("data")
        labels_changed = saved_data is not None and any(
            saved_data.get(k) != OmegaConf.to_container(self.data_cfg, resolve=True).get(k) for k in LABEL_KEYS)
        if not (shape_changed or labels_changed):
            return set()
        if not head and self.cfg.strict:
            raise ConfigError(f"{type(model).__name__} declares no head_name and has no {'/'.join(HEAD_MODULES)} module, so "
                              "its output layer cannot be replaced; set finetune.head=MODULE (its output layer) or "
                              "finetune.strict=false to load only matching weights.")
        why = "the number of classes changed" if shape_changed else "the labels differ from the pretraining run"
        log.info("Head %r re-initialised: %s.", head, why)
        return head_keys

    def _load_pretrained(self, model: nn.Module) -> None:
        incoming, own = self.pretrained["model"], model.state_dict()
        head = self._head_keys(model, incoming)
        loadable = {k: v for k, v in incoming.items() if k in own and k not in head and v.shape == own[k].shape}
        mismatched = [f"{k} {tuple(v.shape)}->{tuple(own[k].shape)}" for k, v in incoming.items()
                      if k in own and k not in head and v.shape != own[k].shape]
        unexpected = [k for k in incoming if k not in own]
        missing = [k for k in own if k not in incoming and k not in head]
        ignored = [k for k in incoming if k not in loadable]
        log.info("finetune.from=%s: matched %d tensors; re-initialised %d (head %d, missing %d, shape-mismatched %d); "
                 "ignored %d from the file (%s).", self.source, len(loadable), len(own) - len(loadable), len(head),
                 len(missing), len(mismatched), len(ignored), first_names(ignored) or "none")
        problems = [f"{label}: {first_names(keys)}"
                    for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape-mismatched", mismatched)) if keys]
        if problems and self.cfg.strict:
            raise CheckpointError(f"finetune.from={self.source} does not fit this model ({'; '.join(problems)}); "
                                  "set finetune.strict=false to load only the matching weights.")
        for problem in problems:
            log.warning("finetune.strict=false, kept freshly initialised: %s", problem)
        model.load_state_dict(loadable, strict=False)

    def _freeze(self, model: nn.Module) -> None:
        names = [name for name, _ in model.named_parameters()]
        for pattern in self.cfg.freeze:
            if not any(fnmatchcase(name, pattern) for name in names):
                raise ConfigError(f"finetune.freeze pattern {pattern!r} matches no parameter of {type(model).__name__}; "
                                  f"its parameters are named like {', '.join(names[:4])}, ..., {names[-1]}.")
        self.frozen = {n: p for n, p in model.named_parameters() if self._is_frozen(n)}
        for parameter in self.frozen.values():
            parameter.requires_grad_(False)
        # A frozen BatchNorm must not update its running statistics either.
        self.frozen_norms = [m for name, m in model.named_modules() if isinstance(m, BATCH_NORMS)
                             and all(self._is_frozen(f"{name}.{n}") for n in ("weight", "bias", "running_mean"))]
        if self.frozen:
            log.info("Frozen by finetune.freeze=%s: %d tensors, %d BatchNorm layers kept in eval mode%s.",
                     list(self.cfg.freeze), len(self.frozen), len(self.frozen_norms),
                     f", until epoch {self.cfg.unfreeze_at_epoch}" if self.cfg.unfreeze_at_epoch >= 0 else "")

    def _is_frozen(self, name: str) -> bool:
        return any(fnmatchcase(name, pattern) for pattern in self.cfg.freeze)

    # --- the loop's hooks --------------------------------------------------------------

    def param_groups(self) -> Optional[List[Dict[str, Any]]]:
        """None (the optimizer takes the trainable parameters) unless frozen parameters join later.

        Then they are a second group from the start, scaled by ``backbone_lr_factor``: torch
        optimizers skip parameters without gradients, so they stay untouched while frozen,
        while the scheduler and a resumed optimizer state already know the group.
        """
        if self.cfg.unfreeze_at_epoch < 0 or not self.frozen:
            return None
        frozen = set(map(id, self.frozen.values()))
        return [{"params": [p for p in self.model.parameters() if id(p) not in frozen]},
                {"params": list(self.frozen.values()), "lr_factor": self.cfg.backbone_lr_factor}]

    def on_epoch_start(self, epoch: int) -> None:
        """Called after ``model.train()``: unfreeze when due, else keep frozen norms in eval mode."""
        if not self.frozen:
            return
        if 0 <= self.cfg.unfreeze_at_epoch <= epoch:
            if not next(iter(self.frozen.values())).requires_grad:
                for parameter in self.frozen.values():
                    parameter.requires_grad_(True)
                log.info("Epoch %d: unfroze %d tensors (finetune.freeze), learning rate x%g.",
                         epoch, len(self.frozen), self.cfg.backbone_lr_factor)
            return
        for norm in self.frozen_norms:
            norm.eval()
