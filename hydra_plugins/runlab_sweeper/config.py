"""The plugins' config schemas, registered in Hydra's ConfigStore on discovery, as every plugin's are:
any Hydra app of the environment can select hydra/sweeper=runlab (tests/test_optuna_compat.py)."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_ray_launcher._config import RayConf
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from omegaconf import MISSING, OmegaConf

@dataclass
class PrunerConfig:
    _target_: str = "optuna.pruners.MedianPruner"

@dataclass
class MedianPrunerConfig(PrunerConfig):
    _target_: str = "optuna.pruners.MedianPruner"
    # Trials that always run to the end, to build the median from: each costs a whole trial (4 are a
    # fifth of a 20-trial sweep), and 3 are the fewest whose median one diverging trial cannot drag.
    # benchmarks/pruning.py measures what pruning saves and costs with this setting.
    n_startup_trials: int = 3
    n_warmup_steps: int = 1  # epochs a trial runs before it can be pruned
    interval_steps: int = 1

@dataclass
class SuccessiveHalvingPrunerConfig(PrunerConfig):
    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    min_resource: Any = "auto"
    reduction_factor: int = 3
    min_early_stopping_rate: int = 0

@dataclass
class HyperbandPrunerConfig(PrunerConfig):
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: int = 1
    max_resource: Any = "auto"
    reduction_factor: int = 3

@dataclass
class RunlabSweeperConf:
    """Optuna, as the stock hydra-optuna-sweeper (its configs work here), plus pruning, resume
    without replay, failure tolerance and a report."""

    _target_: str = "hydra_plugins.runlab_sweeper.sweeper.RunlabSweeper"
    defaults: List[Any] = field(default_factory=lambda: ["_self_", {"sampler": "tpe"}, {"pruner": None}])
    sampler: Any = MISSING  # hydra/sweeper/sampler=tpe|random|cmaes|nsgaii|... (hydra-optuna-sweeper's)
    pruner: Optional[PrunerConfig] = None  # hydra/sweeper/pruner=median|successive_halving|hyperband
    # Of optimized_metric: maximize or minimize (or max, min: checkpoint.mode's words), auto in runlab's run.py; a
    # list (one per metric) when optimized_metric lists several: [maximize, minimize].
    direction: Any = "maximize"
    # The study persists here; every trial opens it to report epochs. Empty: sqlite in the sweep dir;
    # null: in memory (the stock sweeper's default), so the sweep cannot be resumed or pruned.
    storage: Optional[str] = ""
    # Re-running the same command resumes the study of this name; null (the default of apps without
    # runlab's top-level name): a new study every run.
    study_name: Optional[str] = "${oc.select:name,null}"
    n_trials: int = 20  # finished trials (complete, pruned or failed) the study should reach
    n_jobs: int = 1  # trials in flight at once; > 1 only helps with a parallel launcher (Ray, SLURM)
    max_failure_rate: float = 0.25  # of n_trials; one failure more and the sweep stops
    # Many drivers on one study (the same command on several machines): each records a heartbeat for its
    # running trials every heartbeat_s; a trial without one for grace_s is a dead driver's, and a live
    # driver runs it again (once). A driver killed with kill -9 loses its trial for up to grace_s.
    heartbeat_s: int = 10
    grace_s: int = 60
    params: Optional[Dict[str, str]] = None  # the search space, in Hydra's override syntax
    # The dotted path of a function(cfg, trial) that suggests more parameters (as the stock sweeper's).
    custom_search_space: Optional[str] = None
    # Also write the best trial's experiment YAML here as <study_name>_best.yaml (e.g. experiments, so that
    # experiment=<study_name>_best runs it). Empty: only in the sweep dir, as experiment/best.yaml.
    export_dir: str = ""
    # The stock sweeper's deprecated form of params ({name: {type, low, high, ...}}); params wins over it.
    search_space: Optional[Dict[str, Any]] = None


@dataclass
class RunlabRayLauncherConf:
    """hydra-ray-launcher's local launcher, with clear errors and a safe cluster connection."""

    _target_: str = "hydra_plugins.runlab_sweeper.ray_launcher.RunlabRayLauncher"
    ray: RayConf = field(default_factory=RayConf)

@dataclass
class RunlabSlurmLauncherConf(SlurmQueueConf):
    """hydra-submitit-launcher's SLURM launcher; cluster=local runs the same jobs as local processes."""

    _target_: str = "hydra_plugins.runlab_sweeper.slurm_launcher.RunlabSlurmLauncher"
    cluster: str = "slurm"  # slurm: sbatch; local: submitit's local executor, on this machine


def register() -> None:
    store = ConfigStore.instance()
    # Stored untyped, so that ~hydra.sweeper.params can delete the space (OmegaConf refuses deletion from a
    # dataclass node); keys still cannot be misspelt (struct mode), and RunlabSweeper checks the values
    # against RunlabSweeperConf.
    store.store(group="hydra/sweeper", name="runlab", node=OmegaConf.to_container(OmegaConf.structured(RunlabSweeperConf)),
                provider="runlab")
    for name, node in (("median", MedianPrunerConfig), ("successive_halving", SuccessiveHalvingPrunerConfig),
                       ("hyperband", HyperbandPrunerConfig)):
        store.store(group="hydra/sweeper/pruner", name=name, node=node, provider="runlab")
    store.store(group="hydra/launcher", name="runlab_ray", node=RunlabRayLauncherConf, provider="runlab")
    store.store(group="hydra/launcher", name="runlab_slurm", node=RunlabSlurmLauncherConf, provider="runlab")

register()
