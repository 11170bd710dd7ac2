"""Typed schemas for every config group, which runlab's app reads by name (``schemas``).

Every group is selected the same way. An option's YAML (conf/<group>/<option>.yaml) extends its
own schema here through its defaults list (``- /DigitsData@_here_``), so only that option's keys
exist and a typo in a key, a value of the wrong type or one outside a closed set (an ``Enum``)
is refused by Hydra while composing. Each option names what builds it in ``_target_``, which
``hydra.utils.instantiate`` calls with the option's keys and, as keyword arguments, what only the
run has (``RUNTIME_ARGUMENTS``: a model's input_shape, an optimizer's params, ...); a parallel
option's ``Mode`` takes the run as arguments of its methods instead (parallel.launch). A
``_target_`` of the user's own (``model=custom``, ``data=custom``, another torch.optim class, a
loss) is checked against its signature instead of a schema. ``validate`` then rejects values
that type-check but cannot work, before any work starts.

Each default is written once: in the YAML that sets it, beside the comment that explains it;
the schema only types such a key (``MISSING``). A schema writes the defaults no YAML carries:
the keys every option of its group shares (``DataConfig``), and groups without a YAML (search).
"""
from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Set, Tuple

from omegaconf import II, MISSING, DictConfig, ListConfig, OmegaConf, ValidationError

from framework.errors import ConfigError
from framework.paths import register_resolvers

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # the config groups: one per framework module


class Choice(str, Enum):
    """A closed set of strings. OmegaConf refuses any other value while composing; a member
    compares, hashes, formats and prints as its string, so code reads it as the str it is."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def _missing_(cls, value: Any) -> Any:
        # The command line types trainer.precision=32 as an int, and OmegaConf looks ints up by value.
        return cls._value2member_map_.get(str(value)) if type(value) is int else None


def closed(name: str, *values: str) -> Any:
    """A ``Choice`` whose members are named by their values, so YAML, the command line and Hydra's
    error ('expected one of [...]') all spell them alike."""
    return Choice(name, [(value, value) for value in values], module=__name__, qualname=name)


Task = closed("Task", "train", "eval", "export", "doctor")
Split = closed("Split", "val", "test")
Loader = closed("Loader", "auto", "memory", "dataloader")
Precision = closed("Precision", "32", "bf16", "fp16")
NonFinite = closed("NonFinite", "stop", "skip")
Direction = closed("Direction", "min", "max")  # of a metric: whether lower or higher is better
MonitorMode = closed("MonitorMode", "auto", "min", "max")  # auto: the monitored metric's own direction
RegressionLoss = closed("RegressionLoss", "mse", "l1", "huber")
Backend = closed("Backend", "auto", "nccl", "gloo")
WandbMode = closed("WandbMode", "online", "offline", "disabled")


@dataclass
class Option:
    """One option of a group: ``_target_`` names what builds it, which the group's builder calls."""

    _target_: str = MISSING
    option: ClassVar[str] = ""  # how a user selects it, e.g. "data=digits"


# Every option of every group, by group and name; conf/<group>/<name>.yaml extends it.
OPTIONS: Dict[str, Dict[str, type]] = {group: {} for group in ("data", "objective", "model", "optimizer", "scheduler",
                                                                "logger", "parallel")}
# The schemas conf/ extends by name; runlab's own config source serves them (hydra_plugins/runlab_config),
# only in runlab's app: Hydra's ConfigStore is every app's, and another app must not see them.
SCHEMAS: Dict[str, Any] = {}


def schemas() -> Dict[str, Any]:
    return {"runlab_schema": RunConfig, **SCHEMAS}


def option(group: str, name: str) -> Callable[[type], type]:
    """Make the schema of ``group=name`` one conf/<group>/<name>.yaml can extend by its class name
    (``defaults: [/<ClassName>@_here_, _self_]``)."""
    def register(schema: type) -> type:
        schema.option = f"{group}={name}"
        OPTIONS[group][name] = schema
        SCHEMAS[schema.__name__] = schema
        return schema

    return register


# --- data (framework/data.py): _target_ is a factory, called with the option's own keys, that returns a data.DataBundle --

@dataclass
class DataConfig(Option):
    """The loader's keys, which every data option has (with these defaults) and its factory is not
    called with. A user's own option extends it: ``defaults: [/DataConfig@_here_, _self_]``."""

    batch_size: int = II("batch_size")  # the global batch per optimizer step
    # auto: keep a TensorDataset on the device and batch by indexing when it fits in
    # device_cache_mb (always on CPU); memory / dataloader force one path.
    loader: Loader = Loader.auto
    device_cache_mb: int = 1024
    num_workers: int = 0  # DataLoader worker processes (the dataloader path)
    pin_memory: bool = True  # on CUDA: page-locked batches, copied to the GPU asynchronously
    persistent_workers: bool = True  # keep workers between epochs (not for a dataset with set_epoch)
    prefetch_factor: int = 2  # batches each worker loads ahead
    collate: Any = None  # a _target_ node (_partial_: true for a function) that makes a batch of samples; null: torch's default
    eval_batch_size: int = 1024


# A user's option extends the loader's keys and adds its factory's own, which a dataclass node would
# refuse: it is stored untyped, and ``validate`` checks the loader's keys against DataConfig.
SCHEMAS["DataConfig"] = OmegaConf.to_container(OmegaConf.structured(DataConfig))
LOADER_KEYS = frozenset(f.name for f in fields(DataConfig)) - {"_target_"}  # the factory gets every other key of an option


@dataclass
class CustomDataConfig(DataConfig):
    """data=custom: a factory of the user's own, named on the command line with its keys
    (``data._target_=mypkg.make +data.size=10``); untyped, as DataConfig is."""


CustomDataConfig.option = "data=custom"
OPTIONS["data"]["custom"] = CustomDataConfig


@dataclass
class SplitDataConfig(DataConfig):
    """Sources runlab splits into train/val/test itself."""

    val_fraction: float = 0.15
    test_fraction: float = 0.15
    split_seed: int = 0  # fixed, so every run and every trial of a sweep sees the same split
    train_per_class: int = 0  # keep only this many training samples of each class (a small labelled budget); 0: all


@dataclass
class InMemoryDataConfig(SplitDataConfig):
    """Sources read whole into tensors."""

    classes: List[int] = field(default_factory=list)  # keep only these labels (relabelled 0..k-1)
    normalize: bool = True  # standardise with the training split's statistics


@option("data", "digits")
@dataclass
class DigitsDataConfig(InMemoryDataConfig):
    _target_: str = "framework.data.digits"


@option("data", "synthetic")
@dataclass
class SyntheticDataConfig(InMemoryDataConfig):
    _target_: str = "framework.data.synthetic"
    num_samples: int = MISSING
    input_shape: List[int] = MISSING
    num_classes: int = MISSING
    class_sep: float = MISSING
    noise: float = MISSING
    seed: int = II("seed")


@option("data", "diabetes")
@dataclass
class DiabetesDataConfig(SplitDataConfig):
    _target_: str = "framework.data.diabetes"
    normalize: bool = True  # standardise the features with the training split's statistics (targets stay as they are)


@option("data", "text")
@dataclass
class TextDataConfig(DataConfig):
    _target_: str = "framework.data.text"
    path: str = MISSING  # a UTF-8 text file; "": the Python reference manual's help topics, which Python ships
    max_chars: int = MISSING  # use the first this many characters; 0: all
    context: int = MISSING  # characters per sample
    val_fraction: float = 0.1
    test_fraction: float = 0.1


@option("data", "csv")
@dataclass
class CSVDataConfig(InMemoryDataConfig):
    _target_: str = "framework.data.csv_file"
    path: str = MISSING
    label_column: str = MISSING


@option("data", "tensors")
@dataclass
class TensorsDataConfig(InMemoryDataConfig):
    _target_: str = "framework.data.tensor_file"
    path: str = MISSING
    features_key: str = MISSING
    labels_key: str = MISSING


@dataclass
class TransformsConfig:
    """Each image is resized, cropped, flipped (training only) and normalised, in that order."""

    resize: int = MISSING
    crop: int = MISSING
    flip: bool = MISSING
    grayscale: bool = MISSING
    mean: List[float] = MISSING
    std: List[float] = MISSING


@option("data", "imagefolder")
@dataclass
class ImageFolderDataConfig(SplitDataConfig):
    _target_: str = "framework.imagefolder.build_image_folder"
    root: str = MISSING
    transforms: TransformsConfig = field(default_factory=TransformsConfig)
    seed: int = II("seed")  # of the training augmentation


# --- objective (framework/objective.py): _target_ is an objective.Objective, built with the data's output_size --

@dataclass
class ObjectiveConfig(Option):
    monitor: str = MISSING  # the metric this objective is judged by: checkpoint.monitor's default


@option("objective", "classification")
@dataclass
class ClassificationObjectiveConfig(ObjectiveConfig):
    _target_: str = "framework.objective.Classification"
    label_smoothing: float = MISSING
    top_k: int = MISSING


@option("objective", "multilabel")
@dataclass
class MultilabelObjectiveConfig(ObjectiveConfig):
    _target_: str = "framework.objective.Multilabel"
    threshold: float = MISSING


@option("objective", "regression")
@dataclass
class RegressionObjectiveConfig(ObjectiveConfig):
    _target_: str = "framework.objective.Regression"
    loss: RegressionLoss = MISSING
    huber_delta: float = MISSING


@option("objective", "supervised")
@dataclass
class SupervisedObjectiveConfig(ObjectiveConfig):
    _target_: str = "framework.objective.Supervised"
    loss: Any = MISSING  # a _target_ node: a loss module or function of (outputs, target)
    metrics: Dict[str, Any] = field(default_factory=dict)  # name: a _target_ node of a torchmetrics Metric


@option("objective", "model_loss")
@dataclass
class ModelLossObjectiveConfig(ObjectiveConfig):
    _target_: str = "framework.objective.ModelLoss"
    metrics: Dict[str, Direction] = field(default_factory=dict)  # the names the model's loss(batch) returns values of
    perplexity: bool = MISSING


# --- model (framework/model.py): _target_ is an nn.Module class or function, called with the option's
# keys and, where it takes them, the data's input_shape and num_classes ------------------------

@dataclass
class CustomModelConfig(Option):
    """model=custom: a module of the user's own (``model._target_=mypkg.MyNet +model.hidden=64``); its
    YAML is untyped, and ``validate`` checks its keys against the constructor's signature instead."""


CustomModelConfig.option = "model=custom"
OPTIONS["model"]["custom"] = CustomModelConfig


@option("model", "mlp")
@dataclass
class MLPModelConfig(Option):
    _target_: str = "framework.model.MLP"
    width: int = MISSING
    depth: int = MISSING
    dropout: float = MISSING
    batch_norm: bool = MISSING


@option("model", "cnn")
@dataclass
class CNNModelConfig(Option):
    _target_: str = "framework.model.CNN"
    channels: List[int] = MISSING
    width: int = MISSING
    dropout: float = MISSING
    batch_norm: bool = MISSING


@option("model", "resnet")
@dataclass
class ResNetModelConfig(Option):
    _target_: str = "framework.model.ResNet"
    width: int = MISSING
    stages: int = MISSING
    blocks_per_stage: int = MISSING


@option("model", "char_lm")
@dataclass
class CharLMModelConfig(Option):
    _target_: str = "framework.model.CharLM"
    width: int = MISSING
    depth: int = MISSING
    dropout: float = MISSING


@option("model", "torchvision")
@dataclass
class TorchvisionModelConfig(Option):
    _target_: str = "framework.model.torchvision_model"
    name: str = MISSING


@option("model", "timm")
@dataclass
class TimmModelConfig(Option):
    _target_: str = "framework.model.timm_model"
    name: str = MISSING


# --- optimizer (framework/optimizer.py): _target_ is a torch.optim class, built with params= ----

@dataclass
class OptimizerConfig(Option):
    lr: float = II("lr")  # one learning rate, the top-level lr: what the run records and a sweep changes
    weight_decay: float = MISSING
    fused: bool = MISSING  # runlab's: passed only to a class that takes it (optimizer.build_optimizer)


@option("optimizer", "adamw")
@dataclass
class AdamWOptimizerConfig(OptimizerConfig):
    _target_: str = "torch.optim.AdamW"


@option("optimizer", "adam")
@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    _target_: str = "torch.optim.Adam"


@option("optimizer", "sgd")
@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    momentum: float = MISSING
    nesterov: bool = MISSING


# --- scheduler (framework/scheduler.py): _target_ is a torch LR scheduler, built with optimizer=
# and stepped every ``interval``, runlab's own key -------------------------------------------

Interval = closed("Interval", "epoch", "step")


@option("scheduler", "none")
@dataclass
class NoneSchedulerConfig(Option):
    _target_: str = "framework.scheduler.constant"


@dataclass
class SchedulerConfig(Option):
    interval: Interval = MISSING  # step after every epoch, or after every optimizer step


@option("scheduler", "cosine")
@dataclass
class CosineSchedulerConfig(SchedulerConfig):
    _target_: str = "torch.optim.lr_scheduler.CosineAnnealingLR"
    T_max: int = MISSING


@option("scheduler", "step")
@dataclass
class StepSchedulerConfig(SchedulerConfig):
    _target_: str = "torch.optim.lr_scheduler.StepLR"
    step_size: int = MISSING
    gamma: float = MISSING


# --- logger (framework/logger.py): _target_ is a logger.Logger, built with run_dir= and what else of the run it takes --

@option("logger", "none")
@dataclass
class NoneLoggerConfig(Option):
    _target_: str = "framework.logger.Logger"


@option("logger", "tensorboard")
@dataclass
class TensorBoardLoggerConfig(Option):
    _target_: str = "framework.logger.TensorBoardLogger"
    log_graph: bool = MISSING
    histogram_every_n_epochs: int = MISSING
    log_images: bool = MISSING


@option("logger", "csv")
@dataclass
class CSVLoggerConfig(Option):
    _target_: str = "framework.logger.CSVLogger"


@option("logger", "wandb")
@dataclass
class WandbLoggerConfig(Option):
    _target_: str = "framework.logger.WandbLogger"
    wandb_project: str = MISSING
    wandb_mode: WandbMode = MISSING


# --- parallel (framework/parallel/): _target_ is a parallel.Mode, built with the option's keys; it starts the processes --

@dataclass
class ParallelConfig(Option):
    # Whether the mode fixes which parameters train when it wraps the model (DDP registers them
    # then, so parameters unfrozen later would never synchronise).
    fixes_trainable_parameters: ClassVar[bool] = False


@option("parallel", "none")
@dataclass
class NoneParallelConfig(ParallelConfig):
    _target_: str = "framework.parallel.Mode"


@option("parallel", "dp")
@dataclass
class DPParallelConfig(ParallelConfig):
    _target_: str = "framework.parallel.DataParallel"
    devices: List[str] = MISSING


@option("parallel", "ddp")
@dataclass
class DDPParallelConfig(ParallelConfig):
    _target_: str = "framework.parallel.distributed.DDP"
    fixes_trainable_parameters: ClassVar[bool] = True
    world_size: int = MISSING
    backend: Backend = MISSING
    sync_batchnorm: bool = MISSING
    timeout_s: int = MISSING


@option("parallel", "fsdp")
@dataclass
class FSDPParallelConfig(DDPParallelConfig):
    _target_: str = "framework.parallel.fsdp.FSDP"
    shard_modules: List[str] = MISSING
    reshard_after_forward: bool = MISSING


@option("parallel", "model")
@dataclass
class ModelParallelConfig(ParallelConfig):
    _target_: str = "framework.parallel.pipeline.ModelParallel"
    devices: List[str] = MISSING
    microbatches: int = MISSING
    split: List[int] = MISSING


def schema_of(node: DictConfig, group: str = "") -> Optional[type]:
    """The schema of the option a group's config is (by its ``_target_``, which survives a
    checkpoint or a ddp worker's copy); None for a ``_target_`` of the user's own. ``_target_``
    still ``???`` is the group's custom option's."""
    target = MISSING if OmegaConf.is_missing(node, "_target_") else node.get("_target_")
    groups = [OPTIONS[group]] if group in OPTIONS else OPTIONS.values()
    return next((schema for options in groups for schema in options.values() if schema._target_ == target), None)


def chosen(group: str, node: DictConfig) -> str:
    """How the user selected this option, for messages: ``data=digits``."""
    schema = schema_of(node, group)
    return schema.option if schema else f"{group}._target_={node.get('_target_')}"


# --- the other groups: one schema each, its values in the group's YAML ----------------------

@dataclass
class TrainerConfig:
    max_epochs: int = MISSING
    max_steps: int = MISSING
    accumulate_grad_batches: int = MISSING
    gradient_clip_val: float = MISSING
    precision: Precision = MISSING
    log_every_n_steps: int = MISSING
    val_every_n_steps: int = MISSING
    progress_bar: bool = MISSING
    deterministic: bool = MISSING
    test_after_fit: bool = MISSING
    on_nonfinite: NonFinite = MISSING
    compile: bool = MISSING
    compile_backend: str = MISSING
    compile_mode: Optional[str] = MISSING


@dataclass
class CheckpointConfig:
    enabled: bool = MISSING
    monitor: str = MISSING
    mode: MonitorMode = MISSING
    every_n_steps: int = MISSING
    every_minutes: float = MISSING
    keep_last: int = MISSING
    sharded: bool = MISSING


@dataclass
class EarlyStoppingConfig:
    enabled: bool = MISSING
    monitor: str = MISSING
    mode: MonitorMode = MISSING
    patience: int = MISSING
    min_delta: float = MISSING


@dataclass(init=False, repr=False, eq=False)
class FinetuneConfig:
    # `from` is a Python keyword, so it enters the schema through the class namespace, and
    # the generated __init__/__repr__/__eq__ (which would spell it out) are switched off:
    # Hydra only reads the fields and their defaults.
    __annotations__["from"] = str
    vars()["from"] = MISSING
    strict: bool = MISSING
    head: str = MISSING
    freeze: List[str] = MISSING
    unfreeze_at_epoch: int = MISSING
    backbone_lr_factor: float = MISSING
    pretrain: str = MISSING


@dataclass
class EvalConfig:
    split: Split = MISSING


@dataclass
class TroubleshootConfig:
    oom_recovery: bool = MISSING
    max_probe_batch: int = MISSING
    profile_steps: int = MISSING
    leak_check_steps: int = MISSING
    memory_growth_epochs: int = MISSING
    inject_oom_above_batch: int = MISSING
    inject_oom_rank: int = MISSING


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    output_dir: str = MISSING


# A trial's study name, storage and number: set per trial by the sweeper (framework/search/sweeper.py)
# in the job's environment (hydra.job.env_set, whose keys conf/hydra/default.yaml declares), which Hydra
# leaves out of the override lines it prints: plumbing, not what the trial tries. Read as search.*.
TRIAL_VARIABLES = ("RUNLAB_STUDY_NAME", "RUNLAB_STORAGE", "RUNLAB_TRIAL")
STUDY_NAME_VARIABLE, STORAGE_VARIABLE, TRIAL_VARIABLE = TRIAL_VARIABLES


@dataclass
class SearchConfig:
    """A run's place in a sweep (conf/search/ picks the sweep; hydra/sweeper=runlab fills these in)."""

    study_name: str = f"${{oc.env:{STUDY_NAME_VARIABLE},''}}"
    storage: str = f"${{oc.env:{STORAGE_VARIABLE},''}}"  # the study's SQLAlchemy URL
    trial: int = f"${{oc.env:{TRIAL_VARIABLE},-1}}"  # the Optuna trial number; -1: not a trial
    num_threads: int = 0  # torch threads for this run (parallel trials set 1); 0: torch's default


@dataclass
class RunConfig:
    """The root: its own keys take their values in conf/config.yaml, each group its option's."""

    task: Task = MISSING
    name: str = MISSING
    seed: int = MISSING
    lr: float = MISSING
    batch_size: int = MISSING
    device: str = MISSING
    optimized_metric: Any = MISSING  # a metric, or a list of them (several objectives)
    resume: str = MISSING
    ckpt: str = MISSING
    data: Any = MISSING  # an option of OPTIONS["data"], as the selected YAML types it
    objective: Any = MISSING
    model: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: Any = MISSING
    logger: Any = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    finetune: FinetuneConfig = field(default_factory=lambda: FinetuneConfig)  # the class: it has no __init__
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    troubleshoot: TroubleshootConfig = field(default_factory=TroubleshootConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    launcher: Any = None
    experiment: Any = None


register_resolvers()  # runlab.* (framework/paths.py), before Hydra composes or a worker resolves a config

# Integer hyperparameters of the shipped models (framework/model.py): sizes and counts, all at least 1.
MODEL_SIZES = ("width", "depth", "channels", "stages", "blocks_per_stage")
def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    _require(value in allowed, f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}.")


def _importable(key: str, target: str) -> Any:
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{key}={target!r} cannot be imported; give a full dotted path to a class or function.") from None


def accepted_keys(target: Any) -> Optional[List[str]]:
    """The keyword arguments ``target`` takes, in its signature's order; None when it takes ``**kwargs``
    (or has no signature Python can read), so that any key may be right."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


# What runlab passes a group's _target_ itself when it builds it (model.model_spec, optimizer.build_optimizer,
# scheduler.build_scheduler), and the keys of a group's option that are runlab's rather than the target's.
RUNTIME_ARGUMENTS = {"model": ("input_shape", "num_classes"), "optimizer": ("params",), "scheduler": ("optimizer",),
                     "objective": ("output_size",), "logger": ("run_dir", "name", "monitor", "run_config")}
RUNLAB_KEYS = {"scheduler": ("interval",), "data": tuple(LOADER_KEYS), "objective": ("monitor",), "optimizer": ("fused",)}


def _validate_arguments(key: str, node: DictConfig, runtime: Sequence[str] = (), runlab_keys: Sequence[str] = ()) -> None:
    """A ``_target_`` node's keys that its target does not take, refused before it is called: Hydra would
    call it and end in a TypeError traceback, after the work done before (a user's own target, or a
    shipped one given a key with ``+``)."""
    accepted = accepted_keys(_importable(f"{key}._target_", node._target_))
    if accepted is None:
        return
    unknown = [k for k in node if not k.startswith("_") and k not in runlab_keys and k not in accepted]
    if unknown:
        raise ConfigError(_not_arguments(key, node, unknown, accepted, runtime))


def _not_arguments(key: str, node: DictConfig, unknown: List[str], accepted: List[str], runtime: Sequence[str]) -> str:
    keys = ", ".join(f"{key}.{k}" for k in unknown)
    verb = "is not an argument" if len(unknown) == 1 else "are not arguments"
    schema = OmegaConf.get_type(node)  # a shipped option's, when the user named another _target_ on top of it
    mixed = key == "model" and bool(getattr(schema, "option", "")) and schema._target_ != node._target_
    hint = " (for a module of your own, start from model=custom)" if mixed else ""
    takes = ", ".join(k for k in accepted if k not in runtime) or "none"
    passed = [k for k in runtime if k in accepted]
    passes = f" (and {', '.join(passed)}, which runlab passes)" if passed else ""
    return f"{keys} {verb} of {node._target_}{hint}; its arguments are: {takes}{passes}."


def _validate_targets(cfg: DictConfig) -> None:
    for group in ("model", "optimizer", "scheduler", "data", "objective", "logger", "parallel"):
        _validate_arguments(group, cfg[group], RUNTIME_ARGUMENTS.get(group, ()), RUNLAB_KEYS.get(group, ()))
    loss = cfg.objective.get("loss")
    if isinstance(loss, DictConfig) and "_target_" in loss:
        _validate_arguments("objective.loss", loss)


def known_metrics(cfg: DictConfig) -> Dict[str, str]:
    """Every metric a training run with this config reports at the end of an epoch or of the run, with
    its direction (min or max): train/loss, then val/ and test/ of each of the objective's metrics."""
    from framework.objective import directions

    per_split = directions(cfg.objective)
    return {"train/loss": "min", **{f"{split}/{name}": better for split in ("val", "test") for name, better in per_split.items()}}


def monitor_mode(cfg: DictConfig, group: str) -> str:
    """``checkpoint.mode`` or ``early_stopping.mode``, with auto read as the monitored metric's direction."""
    mode = str(cfg[group].mode)
    return known_metrics(cfg)[cfg[group].monitor] if mode == "auto" else mode


def _validate_monitors(cfg: DictConfig, known: Dict[str, str]) -> None:
    # test/ metrics exist only once the run is over, so no epoch can be judged by them.
    per_epoch = {name: better for name, better in known.items() if not name.startswith("test/")}
    for group in ("checkpoint", "early_stopping"):
        monitor, mode = cfg[group].monitor, str(cfg[group].mode)
        _require(monitor in per_epoch, f"{group}.monitor={monitor!r} is not a metric of every epoch of this run; "
                                       f"choose one of {', '.join(per_epoch)}.")
        _require(mode in ("auto", per_epoch[monitor]), f"{group}.mode={mode} does not fit {monitor}, which is better "
                 f"{'lower' if per_epoch[monitor] == 'min' else 'higher'}; use {group}.mode=auto (or {per_epoch[monitor]}).")


def validate(cfg: DictConfig) -> None:
    """Reject values that type-check but cannot work, naming the key, the value and what is allowed."""
    _validate_set(cfg)
    _require(math.isfinite(cfg.lr) and cfg.lr > 0, f"lr={cfg.lr} is invalid; the learning rate must be a positive number.")
    _require(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} is invalid; it must be a positive integer.")
    _require(0 <= cfg.seed < 2**32, f"seed={cfg.seed} is invalid; it must be an integer from 0 to 2**32 - 1.")
    _validate_device(cfg.device)
    _validate_data(cfg.data)
    _validate_trainer(cfg.trainer)
    _validate_checkpoint(cfg.checkpoint)
    _validate_parallel(cfg.parallel)
    _validate_troubleshoot(cfg.troubleshoot)
    for group in ("model", "optimizer", "scheduler", "data", "objective", "logger", "parallel"):
        _require(isinstance(cfg[group], DictConfig) and "_target_" in cfg[group], f"{group} has no _target_; pick one with {group}=NAME.")
        _importable(f"{group}._target_", cfg[group]._target_)
    _validate_targets(cfg)
    _validate_one_lr(cfg)
    _validate_objective(cfg.objective)
    known = known_metrics(cfg)
    _validate_monitors(cfg, known)
    _require(cfg.early_stopping.patience >= 1, f"early_stopping.patience={cfg.early_stopping.patience} is invalid; it must be at least 1.")
    _require(math.isfinite(cfg.early_stopping.min_delta) and cfg.early_stopping.min_delta >= 0,
             f"early_stopping.min_delta={cfg.early_stopping.min_delta} is invalid; it must be a finite number, 0 or more.")
    _validate_objectives(cfg.optimized_metric, [*known, f"best/{cfg.checkpoint.monitor}"])
    _validate_model(cfg.model)
    _validate_search(cfg.search)
    from framework.checkpoint import is_checkpoint  # it imports this module

    _require(cfg.resume in ("", "auto") or is_checkpoint(cfg.resume), f"resume={cfg.resume!r} is neither 'auto' nor an existing checkpoint file.")
    if cfg.task in ("eval", "export"):
        _require(bool(cfg.ckpt), f"task={cfg.task} needs ckpt=PATH, a checkpoint file or a run dir.")
        _require(Path(cfg.ckpt).exists(), f"ckpt={cfg.ckpt!r} does not exist.")
    _validate_finetune(cfg.finetune)
    parallel = schema_of(cfg.parallel)
    _require(not cfg.checkpoint.sharded or parallel is FSDPParallelConfig,
             f"checkpoint.sharded=true is only for parallel=fsdp (each process writes its shards of the model); "
             f"{chosen('parallel', cfg.parallel)} writes one checkpoint file, so leave checkpoint.sharded=false.")
    _require(not (parallel and parallel.fixes_trainable_parameters and cfg.finetune.unfreeze_at_epoch >= 0),
             f"finetune.unfreeze_at_epoch={cfg.finetune.unfreeze_at_epoch} is not supported with {chosen('parallel', cfg.parallel)}; "
             "keep the backbone frozen (-1) or unfreeze from the start.")


def _validate_one_lr(cfg: DictConfig) -> None:
    """The optimizer reads ``lr`` (``optimizer.lr: ${lr}``); one set apart would train at a rate the
    run's record, the logger's hyperparameters and a sweep over lr never see."""
    lr = cfg.optimizer.get("lr", cfg.lr)
    _require(lr == cfg.lr, f"optimizer.lr={lr} differs from lr={cfg.lr}: the run would train at {lr} and record "
             f"{cfg.lr}; set the learning rate once, with lr={lr}, and leave optimizer.lr out (it reads ${{lr}}).")


def _validate_set(cfg: DictConfig) -> None:
    """A key the selected option leaves for the user (``???`` in --cfg job), named with how to set it."""
    for key in sorted(OmegaConf.missing_keys(cfg)):
        group = key.split(".")[0]
        needs = f"{chosen(group, cfg[group])} needs it" if group in OPTIONS else "it has no value"
        raise ConfigError(f"{key} is empty; {needs}: add {key}=VALUE to the command.")


def _validate_device(device: str) -> None:
    if device in ("auto", "cpu"):
        return  # torch parses the others: it is imported only for them
    import torch

    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device={device!r} is not a device; use auto, cpu, cuda or cuda:N.") from None


def _validate_model(model: DictConfig) -> None:
    from framework.model import EXTRA_BUILDERS, import_extra

    if model._target_ in EXTRA_BUILDERS:
        import_extra(EXTRA_BUILDERS[model._target_])
    if not model._target_.startswith("framework.model."):
        return  # a user's model checks its own arguments
    for key in MODEL_SIZES:
        values = model.get(key)
        values = list(values) if isinstance(values, (list, ListConfig)) else [values]
        _require(all(value is None or value >= 1 for value in values),
                 f"model.{key}={model.get(key)} is invalid; layer sizes and counts must be at least 1.")
    dropout = model.get("dropout", 0.0)
    _require(0 <= dropout < 1, f"model.dropout={dropout} is invalid; it must be at least 0 and below 1.")


def _validate_objective(objective: DictConfig) -> None:
    from framework.objective import Objective, objective_class

    _require(isinstance(objective_class(objective), type) and issubclass(objective_class(objective), Objective),
             f"objective._target_={objective._target_!r} is not a framework.objective.Objective class.")
    if "top_k" in objective:
        _require(objective.top_k >= 1, f"objective.top_k={objective.top_k} is invalid; it must be at least 1.")
    if "label_smoothing" in objective:
        _require(0 <= objective.label_smoothing < 1,
                 f"objective.label_smoothing={objective.label_smoothing} is invalid; it must be at least 0 and below 1.")
    if "threshold" in objective:
        _require(0 < objective.threshold < 1, f"objective.threshold={objective.threshold} is invalid; it must be between 0 and 1.")
    if "huber_delta" in objective:
        _require(objective.huber_delta > 0, f"objective.huber_delta={objective.huber_delta} is invalid; it must be positive.")


def _validate_objectives(objectives: Any, known: Sequence[str]) -> None:
    names = list(objectives) if isinstance(objectives, ListConfig) else [objectives]
    _require(len(names) >= 1 and len(set(names)) == len(names),
             f"optimized_metric={objectives} is invalid; give a metric, or a list of different metrics.")
    for name in names:
        _one_of("optimized_metric", name, tuple(known))


def _validate_search(search: DictConfig) -> None:
    _require(search.num_threads >= 0, f"search.num_threads={search.num_threads} is invalid; use 0 (torch's default) or a positive count.")
    _require(search.trial < 0 or bool(search.study_name and search.storage),
             f"search.trial={search.trial} needs search.study_name and search.storage; the runlab sweeper sets all three.")


def _validate_data(data: DictConfig) -> None:
    # By the keys the option has, so a source of the user's own that has them is checked alike.
    classes = list(data.get("classes", []))
    _require(not classes or (len(classes) >= 2 and len(set(classes)) == len(classes)),
             f"data.classes={classes} is invalid; keep at least 2 distinct labels, or [] for all of them.")
    reads_pythons_text = data._target_ == TextDataConfig._target_ and not data.path  # data=text's default
    if "path" in data and not reads_pythons_text:
        _require(bool(data.path), f"data.path is empty; {chosen('data', data)} needs the path of your file.")
        _require(not Path(data.path).is_dir(), f"data.path={data.path!r} is a directory; give the path of your file.")
        _require(Path(data.path).is_file(), f"data.path={data.path!r} does not exist.")
    if "context" in data:
        _require(data.context >= 1 and data.max_chars >= 0, f"data.context={data.context} and data.max_chars={data.max_chars} "
                 "are invalid; context must be at least 1, max_chars 0 (all) or more.")
    missing = sorted(LOADER_KEYS - set(data.keys()))
    _require(not missing, f"data ({chosen('data', data)}) has no {', '.join(missing)}: a data option's YAML extends "
                          "the loader's keys with `defaults: [/DataConfig@_here_, _self_]`.")
    try:  # a user's option is untyped (see DataConfig): its loader keys are typed here
        OmegaConf.merge(OmegaConf.structured(DataConfig), {key: data[key] for key in LOADER_KEYS})
    except ValidationError as error:
        raise ConfigError(f"data.{error.full_key}={error.value!r} is invalid: {error.msg.splitlines()[0]}") from None
    _require(data.get("train_per_class", 0) >= 0, f"data.train_per_class={data.get('train_per_class')} is invalid; use "
                                                  "0 (every sample) or the number of training samples to keep per class.")
    if "root" in data:
        _validate_image_folder(data)
    if "val_fraction" in data:
        fractions = data.val_fraction + data.test_fraction
        _require(0 < data.val_fraction and 0 <= data.test_fraction and fractions < 1,
                 f"data.val_fraction={data.val_fraction} and data.test_fraction={data.test_fraction} are invalid; "
                 "val must be above 0 and both together below 1.")
    _require(data.eval_batch_size >= 1, f"data.eval_batch_size={data.eval_batch_size} is invalid; it must be a positive integer.")
    _require(data.num_workers >= 0, f"data.num_workers={data.num_workers} is invalid; use 0 (load in the main process) or more.")
    _require(data.prefetch_factor >= 1, f"data.prefetch_factor={data.prefetch_factor} is invalid; it must be at least 1.")


def _validate_image_folder(data: DictConfig) -> None:
    option = chosen("data", data)
    _require(bool(data.root), f"data.root is empty; {option} needs the folder of your images (DIR/<class>/*.png).")
    _require(Path(data.root).is_dir(), f"data.root={data.root!r} is not a folder.")
    _require(data.loader != "memory", f"data.loader=memory does not apply to {option}: images are decoded "
                                      "by DataLoader workers (data.num_workers); use auto or dataloader.")
    transforms = data.transforms
    for key in ("resize", "crop"):
        _require(transforms[key] >= 0, f"data.transforms.{key}={transforms[key]} is invalid; use 0 (off) or a size in pixels.")
    channels = 1 if transforms.grayscale else 3
    mean, std = list(transforms.mean), list(transforms.std)
    _require(len(mean) == len(std) and len(mean) in (0, channels) and all(s > 0 for s in std),
             f"data.transforms.mean={mean} and std={std} are invalid; give {channels} values each (one per channel, "
             "std above 0), or [] for no normalisation.")


def _validate_trainer(trainer: DictConfig) -> None:
    _require(trainer.max_epochs >= 1, f"trainer.max_epochs={trainer.max_epochs} is invalid; it must be at least 1.")
    _require(trainer.max_steps == -1 or trainer.max_steps >= 1,
             f"trainer.max_steps={trainer.max_steps} is invalid; use -1 (no limit) or a positive integer.")
    _require(trainer.accumulate_grad_batches >= 1,
             f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is invalid; it must be at least 1.")
    _require(trainer.gradient_clip_val >= 0, f"trainer.gradient_clip_val={trainer.gradient_clip_val} is invalid; use 0 (off) or a positive norm.")
    _require(trainer.log_every_n_steps >= 1, f"trainer.log_every_n_steps={trainer.log_every_n_steps} is invalid; it must be at least 1.")
    _require(trainer.val_every_n_steps >= 0,
             f"trainer.val_every_n_steps={trainer.val_every_n_steps} is invalid; use 0 (once per epoch) or a positive count.")
    _validate_compile(trainer)


def _validate_compile(trainer: DictConfig) -> None:
    """torch.compile's backend and mode, checked only when compile is on: the compiler takes seconds to import."""
    if not trainer.compile:
        return
    import torch

    backend, mode = trainer.compile_backend, trainer.compile_mode
    backends = torch.compiler.list_backends(exclude_tags=())
    _require(backend in backends, f"trainer.compile_backend={backend!r} is not a torch.compile backend; use inductor "
             f"(the default), aot_eager (compiles fastest, for tests) or another of {', '.join(backends)}.")
    if mode is None:
        return
    _require(backend == "inductor", f"trainer.compile_mode={mode!r} is inductor's; it does not apply to "
                                    f"compile_backend={backend}: leave compile_mode=null.")
    try:
        torch.compile(_validate_compile, mode=mode)  # torch checks the mode here; nothing is compiled until a call
    except RuntimeError as error:
        raise ConfigError(f"trainer.compile_mode={mode!r} is invalid: {error}.") from None


def _validate_checkpoint(checkpoint: DictConfig) -> None:
    for key in ("every_n_steps", "keep_last"):
        _require(checkpoint[key] >= 0, f"checkpoint.{key}={checkpoint[key]} is invalid; use 0 (off) or a positive count.")
    _require(math.isfinite(checkpoint.every_minutes) and checkpoint.every_minutes >= 0,
             f"checkpoint.every_minutes={checkpoint.every_minutes} is invalid; use 0 (off) or a positive number of minutes.")


def _validate_parallel(parallel: DictConfig) -> None:
    # By the keys the option has: each mode has only its own.
    _require(parallel.get("world_size", 0) >= 0,
             f"parallel.world_size={parallel.get('world_size')} is invalid; use 0 (one process per GPU, or 2 on CPU) or a positive count.")
    _require(parallel.get("microbatches", 1) >= 1, f"parallel.microbatches={parallel.get('microbatches')} is invalid; it must be at least 1.")
    _require(parallel.get("timeout_s", 1) >= 1, f"parallel.timeout_s={parallel.get('timeout_s')} is invalid; it must be at least 1 second.")
    cuts = list(parallel.get("split", []))
    _require(all(0 < a < b for a, b in zip(cuts, cuts[1:] + [float("inf")])),
             f"parallel.split={cuts} is invalid; give increasing positive layer indices where the stages begin.")


def _validate_troubleshoot(troubleshoot: DictConfig) -> None:
    for key in ("max_probe_batch", "profile_steps", "memory_growth_epochs"):
        _require(troubleshoot[key] >= 1, f"troubleshoot.{key}={troubleshoot[key]} is invalid; it must be at least 1.")
    _require(troubleshoot.leak_check_steps >= 4,
             f"troubleshoot.leak_check_steps={troubleshoot.leak_check_steps} is invalid; the leak check needs at least 4 steps.")
    _require(troubleshoot.inject_oom_above_batch >= -1,
             f"troubleshoot.inject_oom_above_batch={troubleshoot.inject_oom_above_batch} is invalid; use -1 (off) or a batch size.")
    _require(troubleshoot.inject_oom_rank >= -1,
             f"troubleshoot.inject_oom_rank={troubleshoot.inject_oom_rank} is invalid; use -1 (every rank) or a rank.")


def _validate_finetune(finetune: DictConfig) -> None:
    source = finetune["from"]
    _require(not source or Path(source).exists() or bool(finetune.pretrain),
             f"finetune.from={source!r} does not exist; give a checkpoint file, a run dir or outputs/<name>.")
    _require(finetune.unfreeze_at_epoch >= -1,
             f"finetune.unfreeze_at_epoch={finetune.unfreeze_at_epoch} is invalid; use -1 (never) or the epoch to unfreeze at.")
    _require(finetune.unfreeze_at_epoch == -1 or bool(finetune.freeze),
             f"finetune.unfreeze_at_epoch={finetune.unfreeze_at_epoch} has nothing to unfreeze; set finetune.freeze=[PATTERN,...] too.")
    _require(finetune.backbone_lr_factor > 0, f"finetune.backbone_lr_factor={finetune.backbone_lr_factor} is invalid; it must be positive.")
    _require(finetune.backbone_lr_factor == 1.0 or finetune.unfreeze_at_epoch >= 0,
             f"finetune.backbone_lr_factor={finetune.backbone_lr_factor} has no effect: it scales the frozen parameters' "
             "learning rate once they train, so set finetune.unfreeze_at_epoch too.")


# --- reading a run's config back ---------------------------------------------------------------

def metric_value(metrics: Dict[str, float], name: str) -> float:
    """The metric ``name`` (optimized_metric) of a finished run, NaN when the run produced none."""
    if name not in metrics:
        raise ConfigError(f"optimized_metric={name!r} was not produced by this run; it produced {', '.join(sorted(metrics))}.")
    value = metrics[name]
    return float("nan") if value is None else float(value)


def command_line_overrides(group: str) -> Tuple[bool, Set[str]]:
    """Whether this run's command line chose another option of ``group`` (``group=NAME``),
    and which of its keys it set (``group.KEY=VALUE``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return False, set()
    replaced, keys = False, set()
    for override in OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task)):
        name = override.key_or_group
        if name == group:
            replaced = True
        elif name.startswith(f"{group}."):
            keys.add(name[len(group) + 1:].split(".")[0])
    return replaced, keys


def checkpoint_config(cfg: DictConfig, state: Dict[str, Any], groups: Sequence[str]) -> DictConfig:
    """The checkpoint's resolved config, with what this command line set in ``groups`` taken from ``cfg``."""
    saved = OmegaConf.create(state["config"])
    for group in groups:
        replaced, keys = command_line_overrides(group)
        if replaced:
            saved[group] = cfg[group]
        for key in keys:
            saved[group][key] = cfg[group][key]
    return saved
