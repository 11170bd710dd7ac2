"""Entry points: the Hydra app (``main``) and the Python/notebook call (``run``)."""
from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import DictConfig

from framework.config import validate
from framework.errors import Interrupted, RunlabError, exit_with
from framework.paths import create_run_dir

log = logging.getLogger("framework")

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def execute(cfg: DictConfig, run_dir: Path) -> Dict[str, float]:
    """Validate, then run the task; the returned metrics are also in run_dir/metrics.json."""
    from framework.tasks import TASKS

    validate(cfg)
    return TASKS[cfg.task](cfg, run_dir)


def main(cfg: DictConfig) -> Optional[float]:
    """The Hydra task function: runs one job and returns ``optimized_metric`` for sweepers."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from framework.trainer import metric_value

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        metrics = execute(cfg, run_dir)
        return metric_value(metrics, cfg.optimized_metric) if cfg.task == "train" else None
    except RunlabError as error:
        # In a sweep the error goes to the sweeper, which records this trial as failed and goes
        # on; but Ctrl-C or SIGTERM is meant for the whole sweep.
        if hydra_cfg.mode == RunMode.MULTIRUN and not isinstance(error, Interrupted):
            raise
        exit_with(error)


def compose(overrides: List[str]) -> DictConfig:
    """The same config ``python run.py OVERRIDES`` would build, without starting a Hydra app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)


def run(overrides: Optional[List[str]] = None, run_dir: Optional[str] = None) -> Dict[str, float]:
    """Train from Python or a notebook: ``framework.run(["lr=1e-3"])`` returns the metrics dict.

    The run writes to ``run_dir`` (default: outputs/<name>/<date>_<time>/) exactly what the
    command line would, including train.log.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    cfg = compose(list(overrides or []))
    HydraConfig.instance().set_config(cfg)  # so ${hydra:...} interpolations resolve
    if run_dir is None:  # a fresh dir, named as the command line names it
        run_dir = create_run_dir(f"{cfg.paths.output_dir}/{cfg.name}/{datetime.now():%Y-%m-%d_%H-%M-%S}")
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.resolve(cfg)
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path / "train.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    try:
        return execute(cfg, path)
    finally:
        root.removeHandler(handler)
        handler.close()
