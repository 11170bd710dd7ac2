"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each group under conf/ extends its schema here (``defaults: [schema/<group>]``), so a typo
in a key or a value of the wrong type is refused by Hydra while composing, and
``validate`` rejects values that type-check but cannot work, before any work starts.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from framework.errors import ConfigError
from framework.paths import register_resolvers

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # the config groups: one per framework module


@dataclass
class TransformsConfig:
    """imagefolder: each image is resized, cropped, flipped (training only) and normalised, in that order."""

    resize: int = 0  # the shorter side in pixels, aspect kept; 0: as stored
    crop: int = 0  # a square of this side: the centre for evaluation, a random position for training; 0: none
    flip: bool = False  # training: mirror left-right with probability 1/2
    grayscale: bool = False  # one channel instead of RGB's three
    mean: List[float] = field(default_factory=list)  # per channel, on pixels scaled to 0..1; []: not normalised
    std: List[float] = field(default_factory=list)


@dataclass
class DataConfig:
    # digits: scikit-learn's bundled 8x8 digits; synthetic: generated; csv / tensors: the user's file;
    # imagefolder: the user's images in a folder per class.
    source: str = "digits"
    batch_size: int = MISSING  # the global batch per optimizer step; conf/data takes ${batch_size}
    path: str = ""  # the csv, .pt or .npz file for source=csv|tensors
    root: str = ""  # imagefolder: DIR/<class>/*.png|jpg, or DIR/train|val|test/<class>/*.png|jpg
    transforms: TransformsConfig = field(default_factory=TransformsConfig)  # imagefolder only
    label_column: str = "label"  # csv: the column holding integer class labels
    features_key: str = "x"  # .pt/.npz: the tensor of inputs
    labels_key: str = "y"  # .pt/.npz: the tensor of integer labels
    classes: List[int] = field(default_factory=list)  # keep only these labels (relabelled 0..k-1)
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    split_seed: int = 0  # fixed, so every run and every trial of a sweep sees the same split
    train_per_class: int = 0  # keep only this many training samples of each class (a small labelled budget); 0: all
    normalize: bool = True  # standardise with the training split's statistics (in-memory sources)
    # synthetic only
    num_samples: int = 4096
    input_shape: List[int] = field(default_factory=lambda: [32])
    num_classes: int = 10
    class_sep: float = 1.0
    noise: float = 1.0
    # auto: keep the whole set on the device and batch by indexing when it fits in
    # device_cache_mb (always on CPU); memory / dataloader force one path.
    loader: str = "auto"
    device_cache_mb: int = 1024
    num_workers: int = 0
    eval_batch_size: int = 1024


@dataclass
class TrainerConfig:
    max_epochs: int = 30
    max_steps: int = -1  # -1: no step limit
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step; batch_size stays the effective batch
    gradient_clip_val: float = 0.0  # 0: no clipping
    precision: str = "32"  # 32 | bf16 | fp16 (fp16 needs CUDA)
    log_every_n_steps: int = 10
    progress_bar: bool = True  # shown only when stderr is a terminal
    deterministic: bool = False
    test_after_fit: bool = True  # evaluate the best checkpoint on the test split
    on_nonfinite: str = "stop"  # a step with a non-finite loss or gradient norm: stop the run | skip the step


@dataclass
class CheckpointConfig:
    enabled: bool = True
    monitor: str = "val/acc"
    mode: str = "max"


@dataclass
class EarlyStoppingConfig:
    enabled: bool = True
    monitor: str = "val/acc"
    mode: str = "max"
    patience: int = 8
    min_delta: float = 0.0


@dataclass
class ParallelConfig:
    mode: str = "none"  # none | dp | ddp | model
    world_size: int = 1  # ddp: processes; 0: one per GPU, or 2 on CPU (torchrun's count wins)
    backend: str = "auto"  # ddp: auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    devices: List[str] = field(default_factory=list)  # dp: GPUs; model: one per stage; []: every visible GPU
    microbatches: int = 1  # model: micro-batches per batch in the pipeline
    split: List[int] = field(default_factory=list)  # model: cut points between stages; []: balance by parameters
    sync_batchnorm: bool = False  # ddp: BatchNorm statistics over all processes (CUDA only)
    timeout_s: int = 300  # ddp: a collective waiting longer than this fails instead of hanging


@dataclass
class LoggerConfig:
    name: str = "tensorboard"  # tensorboard | csv | wandb | none
    log_graph: bool = True
    histogram_every_n_epochs: int = 5  # 0: never
    log_images: bool = True
    wandb_project: str = "runlab"
    wandb_mode: str = "offline"  # offline needs no account and no network


@dataclass(init=False, repr=False, eq=False)
class FinetuneConfig:
    # `from` is a Python keyword, so it enters the schema through the class namespace, and
    # the generated __init__/__repr__/__eq__ (which would spell it out) are switched off:
    # Hydra only reads the fields and their defaults.
    __annotations__["from"] = str
    vars()["from"] = ""  # a checkpoint, a run dir (its best checkpoint) or outputs/<name> (its latest run)
    strict: bool = True  # refuse missing, unexpected or shape-mismatched weights
    head: str = ""  # the output layer to re-initialise; "": the model's head_name
    freeze: List[str] = field(default_factory=list)  # glob patterns over parameter names
    unfreeze_at_epoch: int = -1  # -1: never
    backbone_lr_factor: float = 1.0  # scales lr for the frozen parameters once they train
    pretrain: str = ""  # an experiment run first when `from` holds no checkpoint yet; its run must write there


@dataclass
class EvalConfig:
    split: str = "test"  # the split task=eval scores: test | val


@dataclass
class TroubleshootConfig:
    oom_recovery: bool = True  # on out-of-memory: halve the micro-batch (or eval batch) and retry the same step
    max_probe_batch: int = 4096  # doctor: the largest batch its fit probe tries
    profile_steps: int = 5  # doctor: steps timed for the data-bound vs compute-bound verdict
    leak_check_steps: int = 12  # doctor: identical steps whose memory the leak check follows
    memory_growth_epochs: int = 3  # warn once when peak memory rises this many epochs in a row at one batch shape
    # Testing aid: raise a synthetic out-of-memory error whenever a forward pass gets more
    # than this many samples (-1: off; 0 fails every one), on every rank or only on inject_oom_rank.
    inject_oom_above_batch: int = -1
    inject_oom_rank: int = -1  # -1: every rank


@dataclass
class PathsConfig:
    root_dir: str = "${runlab.cwd:}"
    output_dir: str = "${paths.root_dir}/outputs"


@dataclass
class SearchConfig:
    """A run's place in a sweep (conf/search/ picks the sweep; hydra/sweeper=runlab fills these in)."""

    study_name: str = ""  # set per trial by the sweeper, with storage and trial
    storage: str = ""  # the study's SQLAlchemy URL
    trial: int = -1  # the Optuna trial number; -1: not a trial
    num_threads: int = 0  # torch threads for this run (parallel trials set 1); 0: torch's default


@dataclass
class RunConfig:
    task: str = "train"
    name: str = "${task}"  # names the output folder; experiments set their own
    seed: int = 42
    lr: float = 1e-3
    batch_size: int = 64
    device: str = "auto"  # auto: cuda if available, else cpu
    optimized_metric: Any = "val/acc"  # what run.py returns to a sweeper: a metric, or a list of them (several objectives)
    resume: str = ""  # "" | auto | path to a checkpoint
    ckpt: str = ""  # the checkpoint for task=eval|export
    data: DataConfig = field(default_factory=DataConfig)
    model: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    finetune: FinetuneConfig = field(default_factory=lambda: FinetuneConfig)  # the class: it has no __init__
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    troubleshoot: TroubleshootConfig = field(default_factory=TroubleshootConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    launcher: Any = None
    experiment: Any = None


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="runlab_schema", node=RunConfig)
    register_resolvers()


register_configs()

TASKS = ("train", "eval", "export", "doctor")
SPLITS = ("val", "test")
DATA_SOURCES = ("digits", "synthetic", "csv", "tensors", "imagefolder")
LOADERS = ("auto", "memory", "dataloader")
PRECISIONS = ("32", "bf16", "fp16")
LOGGERS = ("tensorboard", "csv", "wandb", "none")
PARALLEL_MODES = ("none", "dp", "ddp", "model")
BACKENDS = ("auto", "nccl", "gloo")
MODES = ("min", "max")
NONFINITE_POLICIES = ("stop", "skip")
# Integer hyperparameters of the shipped models (framework/model.py): sizes and counts, all at least 1.
MODEL_SIZES = ("width", "depth", "channels", "stages", "blocks_per_stage")
# Metrics every training run produces; best/<m> mirrors the checkpoint monitor.
RUN_METRICS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    _require(value in allowed, f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}.")


def _importable(key: str, target: str) -> None:
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        getattr(module, attr)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{key}={target!r} cannot be imported; give a full dotted path to a class or function.") from None


def known_metrics(cfg: DictConfig) -> tuple:
    return RUN_METRICS + (f"best/{cfg.checkpoint.monitor}",)


def validate(cfg: DictConfig) -> None:
    """Reject values that type-check but cannot work, naming the key, the value and what is allowed."""
    _one_of("task", cfg.task, TASKS)
    _require(math.isfinite(cfg.lr) and cfg.lr > 0, f"lr={cfg.lr} is invalid; the learning rate must be a positive number.")
    _require(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} is invalid; it must be a positive integer.")
    _require(0 <= cfg.seed < 2**32, f"seed={cfg.seed} is invalid; it must be an integer from 0 to 2**32 - 1.")
    _validate_device(cfg.device)
    _validate_data(cfg.data)
    _validate_trainer(cfg.trainer)
    _validate_parallel(cfg.parallel)
    _validate_troubleshoot(cfg.troubleshoot)
    _one_of("logger.name", cfg.logger.name, LOGGERS)
    for group in ("checkpoint", "early_stopping"):
        _one_of(f"{group}.mode", cfg[group].mode, MODES)
        _one_of(f"{group}.monitor", cfg[group].monitor, RUN_METRICS)
    _require(cfg.early_stopping.patience >= 1, f"early_stopping.patience={cfg.early_stopping.patience} is invalid; it must be at least 1.")
    _require(math.isfinite(cfg.early_stopping.min_delta) and cfg.early_stopping.min_delta >= 0,
             f"early_stopping.min_delta={cfg.early_stopping.min_delta} is invalid; it must be a finite number, 0 or more.")
    _validate_objectives(cfg.optimized_metric, known_metrics(cfg))
    for group in ("model", "optimizer"):
        _require(isinstance(cfg[group], DictConfig) and "_target_" in cfg[group], f"{group} has no _target_; pick one with {group}=NAME.")
        _importable(f"{group}._target_", cfg[group]._target_)
    _validate_model(cfg.model)
    if cfg.scheduler is not None:
        _one_of("scheduler.interval", cfg.scheduler.interval, ("epoch", "step"))
        _importable("scheduler.build._target_", cfg.scheduler.build._target_)
    _validate_search(cfg.search)
    _require(cfg.resume in ("", "auto") or Path(cfg.resume).is_file(), f"resume={cfg.resume!r} is neither 'auto' nor an existing checkpoint file.")
    if cfg.task in ("eval", "export"):
        _require(bool(cfg.ckpt), f"task={cfg.task} needs ckpt=PATH, a checkpoint file or a run dir.")
        _require(Path(cfg.ckpt).exists(), f"ckpt={cfg.ckpt!r} does not exist.")
    _one_of("eval.split", cfg.eval.split, SPLITS)
    _validate_finetune(cfg.finetune)
    # DDP registers the parameters that need gradients when it wraps the model; ones unfrozen later would never sync.
    _require(not (cfg.parallel.mode == "ddp" and cfg.finetune.unfreeze_at_epoch >= 0),
             f"finetune.unfreeze_at_epoch={cfg.finetune.unfreeze_at_epoch} is not supported with parallel=ddp; "
             "keep the backbone frozen (-1) or unfreeze from the start.")


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


def _validate_objectives(objectives: Any, known: tuple) -> None:
    names = list(objectives) if isinstance(objectives, ListConfig) else [objectives]
    _require(len(names) >= 1 and len(set(names)) == len(names),
             f"optimized_metric={objectives} is invalid; give a metric, or a list of different metrics.")
    for name in names:
        _one_of("optimized_metric", name, known)


def _validate_search(search: DictConfig) -> None:
    _require(search.num_threads >= 0, f"search.num_threads={search.num_threads} is invalid; use 0 (torch's default) or a positive count.")
    _require(search.trial < 0 or bool(search.study_name and search.storage),
             f"search.trial={search.trial} needs search.study_name and search.storage; the runlab sweeper sets all three.")


def _validate_data(data: DictConfig) -> None:
    _one_of("data.source", data.source, DATA_SOURCES)
    _one_of("data.loader", data.loader, LOADERS)
    classes = list(data.classes)
    _require(not classes or (len(classes) >= 2 and len(set(classes)) == len(classes)),
             f"data.classes={classes} is invalid; keep at least 2 distinct labels, or [] for all of them.")
    if data.source in ("csv", "tensors"):
        _require(bool(data.path), f"data.path is empty; data.source={data.source} needs the path of your file.")
        _require(Path(data.path).is_file(), f"data.path={data.path!r} does not exist.")
    _require(data.train_per_class >= 0, f"data.train_per_class={data.train_per_class} is invalid; use 0 (every sample) "
                                        "or the number of training samples to keep per class.")
    if data.source == "imagefolder":
        _validate_image_folder(data)
    else:
        _require(OmegaConf.to_container(data.transforms) == asdict(TransformsConfig()),
                 f"data.transforms apply to data.source=imagefolder only, not to data.source={data.source}.")
    fractions = data.val_fraction + data.test_fraction
    _require(0 < data.val_fraction and 0 <= data.test_fraction and fractions < 1,
             f"data.val_fraction={data.val_fraction} and data.test_fraction={data.test_fraction} are invalid; "
             "val must be above 0 and both together below 1.")
    _require(data.eval_batch_size >= 1, f"data.eval_batch_size={data.eval_batch_size} is invalid; it must be a positive integer.")


def _validate_image_folder(data: DictConfig) -> None:
    _require(bool(data.root), "data.root is empty; data.source=imagefolder needs the folder of your images (DIR/<class>/*.png).")
    _require(Path(data.root).is_dir(), f"data.root={data.root!r} is not a folder.")
    _require(data.loader != "memory", "data.loader=memory does not apply to data.source=imagefolder: images are decoded "
                                      "by DataLoader workers (data.num_workers); use auto or dataloader.")
    _require(not data.classes, f"data.classes={list(data.classes)} does not apply to data.source=imagefolder; "
                               "keep only the class folders you want under data.root.")
    _require(not data.normalize, "data.normalize=true does not apply to data.source=imagefolder; normalise with "
                                 "data.transforms.mean and data.transforms.std.")
    transforms = data.transforms
    for key in ("resize", "crop"):
        _require(transforms[key] >= 0, f"data.transforms.{key}={transforms[key]} is invalid; use 0 (off) or a size in pixels.")
    channels = 1 if transforms.grayscale else 3
    mean, std = list(transforms.mean), list(transforms.std)
    _require(len(mean) == len(std) and len(mean) in (0, channels) and all(s > 0 for s in std),
             f"data.transforms.mean={mean} and std={std} are invalid; give {channels} values each (one per channel, "
             "std above 0), or [] for no normalisation.")


def _validate_trainer(trainer: DictConfig) -> None:
    _one_of("trainer.precision", str(trainer.precision), PRECISIONS)
    _one_of("trainer.on_nonfinite", trainer.on_nonfinite, NONFINITE_POLICIES)
    _require(trainer.max_epochs >= 1, f"trainer.max_epochs={trainer.max_epochs} is invalid; it must be at least 1.")
    _require(trainer.max_steps == -1 or trainer.max_steps >= 1,
             f"trainer.max_steps={trainer.max_steps} is invalid; use -1 (no limit) or a positive integer.")
    _require(trainer.accumulate_grad_batches >= 1,
             f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is invalid; it must be at least 1.")
    _require(trainer.gradient_clip_val >= 0, f"trainer.gradient_clip_val={trainer.gradient_clip_val} is invalid; use 0 (off) or a positive norm.")
    _require(trainer.log_every_n_steps >= 1, f"trainer.log_every_n_steps={trainer.log_every_n_steps} is invalid; it must be at least 1.")


def _validate_parallel(parallel: DictConfig) -> None:
    _one_of("parallel.mode", parallel.mode, PARALLEL_MODES)
    _one_of("parallel.backend", parallel.backend, BACKENDS)
    _require(parallel.world_size >= 0,
             f"parallel.world_size={parallel.world_size} is invalid; use 0 (one process per GPU, or 2 on CPU) or a positive count.")
    _require(parallel.microbatches >= 1, f"parallel.microbatches={parallel.microbatches} is invalid; it must be at least 1.")
    _require(parallel.timeout_s >= 1, f"parallel.timeout_s={parallel.timeout_s} is invalid; it must be at least 1 second.")
    cuts = list(parallel.split)
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
