"""Optimizers (conf/optimizer/): any ``torch.optim`` class named in ``_target_``, built with the
option's keys and ``params=`` the model's trainable parameters (or fine-tuning's groups).

``fused`` is runlab's key, not always the class's: where the fused update fits (``fused_update_fits``)
the class gets ``fused=True``, torch's implementation that updates all parameters in one kernel
instead of a loop of small ops per parameter: the same update up to rounding, about 3x faster for
Adam(W) on a small model on the CPU here, and over fsdp's sharded parameters 0.48 ms an AdamW step
against 0.97 with foreach and 3.1 with torch's default loop on the CPU (8 layers of 256x256, 2 gloo
processes). Elsewhere (``optimizer._target_=torch.optim.RMSprop``, SGD over fsdp's sharded parameters,
...) the optimizer is built as without it."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.config import accepted_keys
from framework.errors import instantiate


def trainable_parameters(model: nn.Module) -> Iterable[nn.Parameter]:
    # Frozen parameters stay out of the optimizer, so weight decay and momentum never move them.
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(cfg: DictConfig, model: nn.Module,
                    param_groups: Optional[List[Dict[str, Any]]] = None) -> torch.optim.Optimizer:
    """``param_groups`` (fine-tuning) may carry an ``lr_factor`` that scales the configured rate."""
    params = param_groups or trainable_parameters(model)
    option = OmegaConf.to_container(cfg, resolve=True)
    if option.pop("fused") and fused_update_fits(option, params, model):
        option["fused"] = True
    # "all": the groups reach torch as the dicts they are (OmegaConf would make each a DictConfig).
    optimizer = instantiate(option, params=params, _convert_="all")
    for group in optimizer.param_groups:
        group["lr"] *= group.get("lr_factor", 1.0)
    return optimizer


def fused_update_fits(option: Dict[str, Any], params: List[Any], model: nn.Module) -> bool:
    """Whether torch's fused update can take this optimizer: its class has one (a ``fused`` argument),
    none of the options torch refuses beside it is set, and it can update these parameters."""
    optimizer_class = get_object(option["_target_"])
    if "fused" not in (accepted_keys(optimizer_class) or ()):
        return False
    if option.get("foreach") or option.get("differentiable"):
        return False
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    # Floating-point tensors, plain or fsdp's DTensors where torch shards the class's fused update: Adam's
    # and AdamW's, not SGD's or Adagrad's. It has no sparse gradients (nn.Embedding(sparse=True)).
    sharded_fits = isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Adam)
    updatable = all(p.is_floating_point() and (type(p) is nn.Parameter or sharded_fits and is_dtensor(p)) for p in tensors)
    return updatable and not any(getattr(module, "sparse", False) is True for module in model.modules())


def is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # only for a parameter that is not plain: fsdp's

    return isinstance(tensor, DTensor)


def with_this_update(state: Dict[str, Any], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """An optimizer's saved ``state`` with each group's ``fused`` flag this optimizer's: torch moves a
    loaded step count to its parameter's device only where the loaded group says fused, so a checkpoint
    of the unfused update resumed by the fused one on a GPU would step with its counts on the CPU."""
    groups = [{**saved, **({"fused": group["fused"]} if "fused" in group else {})}
              for saved, group in zip(state["param_groups"], optimizer.param_groups)]
    # Saved groups beyond this optimizer's are kept, so that torch's own check of their number refuses them.
    return {**state, "param_groups": groups + state["param_groups"][len(groups):]}


def configured_groups(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """The hyperparameters this config gave each parameter group (a copy, without the parameters)."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def base_lr(group: Dict[str, Any]) -> float:
    return group.get("initial_lr", group["lr"])  # a scheduler keeps the rate it started from in initial_lr


def keep_configured(optimizer: torch.optim.Optimizer, configured: List[Dict[str, Any]]) -> bool:
    """After a checkpoint's optimizer state was loaded: this config's hyperparameters (weight decay,
    betas, momentum, ...) apply again. Returns whether the base learning rate differs from the
    checkpoint's, in which case the schedule must restart from the new one (``restart_lr``)."""
    lr_changed = False
    for group, wanted in zip(optimizer.param_groups, configured):
        lr_changed |= base_lr(group) != base_lr(wanted)
        group.update({key: value for key, value in wanted.items() if key not in ("lr", "initial_lr")})
    return lr_changed


def restart_lr(optimizer: torch.optim.Optimizer, configured: List[Dict[str, Any]]) -> None:
    """Every group back at this config's base rate, for a scheduler built anew on top of it."""
    for group, wanted in zip(optimizer.param_groups, configured):
        group["lr"] = base_lr(wanted)
        group.pop("initial_lr", None)
