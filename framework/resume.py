"""resume=auto|PATH: which checkpoint a run continues, and what of this command line applies.

A resumed run writes to a new run dir of its own and continues the checkpoint's run from
the exact batch it stopped at. What makes it that run stays the checkpoint's: the
architecture, the data, the batch composition and the seed. A command line that changes
one of them is refused, naming the key. Everything else applies, and the keys that differ
from the checkpoint's config are logged: optimizer hyperparameters (lr, weight_decay, ...)
are set on the restored optimizer, and a new budget or schedule rebuilds the lr schedule
for it (``Trainer.load_state``).

``resume=auto`` takes the most recently written ``last.pt`` among this ``name``'s runs, or, for
a job started again in its own run dir (a requeued SLURM job, a sweep trial run again after its
sweep was interrupted), that dir's; a job of a sweep never takes another job's. A run
whose lock is held by a live process is refused; a run with nothing left to train (its
budget reached, or stopped early) is reported complete and trains nothing more.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from framework.checkpoint import find_latest_checkpoint, written_checkpoint
from framework.errors import ConfigError
from framework.paths import live_run, shown

log = logging.getLogger(__name__)

# The keys that define which run this is; a change would make a different run, not a resumed one.
KEPT = ("model", "data", "batch_size", "seed", "optimizer._target_", "finetune", "checkpoint.monitor",
        "checkpoint.mode", "early_stopping.monitor", "early_stopping.mode")
# Keys of the data group that change how batches are read, not which.
READING = ("data.loader", "data.device_cache_mb", "data.num_workers", "data.eval_batch_size")
# Where and how this process runs, which a resumed run is free to change without comment.
UNCOMPARED = ("resume", "ckpt", "paths", "search", "name", "task", "launcher", "experiment")


def checkpoint_to_resume(cfg: DictConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint ``resume`` names; None when there is nothing to resume."""
    if cfg.resume != "auto":
        return Path(cfg.resume) if cfg.resume else None
    own = written_checkpoint(run_dir, "last")
    if own:  # this job, started again in its own run dir: a requeued SLURM job, a re-run trial
        return own
    if multirun_job():
        log.info("resume=auto: this job of a sweep has no checkpoint in its own run dir; starting fresh.")
        return None
    found = find_latest_checkpoint(Path(cfg.paths.output_dir) / cfg.name, exclude=run_dir)
    if found is None:
        log.info("resume=auto: no earlier checkpoint of %r found; starting fresh.", cfg.name)
        return None
    owner = live_run(found.parent.parent)
    if owner:
        raise ConfigError(f"resume=auto: the latest run of {cfg.name!r}, {shown(found.parent.parent)}, is still running "
                          f"({owner}); let it finish or stop it, then resume.")
    return found


def multirun_job() -> bool:
    """A job of a sweep continues only its own run dir, never another job's (the latest of its name)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return flat


def within(key: str, groups: tuple) -> bool:
    return any(key == group or key.startswith(f"{group}.") for group in groups)


def changed_settings(saved_config: Dict[str, Any], cfg: DictConfig) -> List[str]:
    """This command line's settings that differ from the checkpoint's, as "key: old -> new";
    refuses a change to what defines the run."""
    saved, current = flatten(saved_config), flatten(OmegaConf.to_container(cfg, resolve=True))
    changes = []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key), current.get(key)
        if old == new or within(key, UNCOMPARED):
            continue
        if within(key, KEPT) and not within(key, READING):
            raise ConfigError(f"resume: {key}={new!r} differs from the checkpoint's {old!r}; a resumed run keeps the "
                              "checkpoint's architecture, data, batch size and seed. Drop the override, or start a new "
                              "run from these weights with finetune.from=PATH.")
        changes.append(f"{key}: {old!r} -> {new!r}")
    return changes


def check_same_model(saved_spec: Dict[str, Any], spec: Dict[str, Any], source: Path) -> None:
    """The model this config builds must be the checkpoint's, to the shape of its input and output."""
    for key in sorted(saved_spec.keys() | spec.keys()):
        if saved_spec.get(key) != spec.get(key):
            name = key if key in ("input_shape", "num_classes") else f"model.{key}"  # the first two come from the data
            raise ConfigError(f"resume={shown(source)} holds a model with {name}={saved_spec.get(key)!r}, but this config "
                              f"builds {name}={spec.get(key)!r}; resume with the checkpoint's model and data, or "
                              "fine-tune from it with finetune.from=PATH.")
