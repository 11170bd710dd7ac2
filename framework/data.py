"""Data sources (conf/data/): scikit-learn's bundled digits, synthetic classification data,
the user's own CSV or tensor file, and folders of images; plus the batch iterators the trainer
consumes.

Each option of conf/data/ names its reader in ``_target_`` (a function of the config and the
seed that returns a ``DataBundle``), and ``build_data`` calls it: a new source is a function
here, its schema (framework/config.py) and its YAML. Every source but image folders ends,
through ``in_memory``, as in-memory tensors split train/val/test with a fixed seed. Batches
are cut by indexing those tensors directly (no per-sample ``__getitem__`` and collate) unless
the set is too large to keep on the device, in which case a ``DataLoader`` streams it. Image
folders (framework/imagefolder.py) are decoded by ``DataLoader`` workers. Every source names
its classes, so a checkpoint can report labels rather than indices.
"""
from __future__ import annotations

import csv
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from hydra.utils import get_object
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from framework.config import chosen
from framework.errors import ConfigError

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class Split:
    """Inputs and labels held in memory."""

    x: torch.Tensor
    y: torch.Tensor
    augments = False  # the same index always gives the same sample

    def __len__(self) -> int:
        return len(self.y)

    def take(self, index: torch.Tensor, epoch: int = 0) -> Batch:
        return self.x[index], self.y[index]


def first(split, n: int) -> Batch:
    """The split's first ``n`` samples (all of them when it has fewer), e.g. for a sample batch."""
    return split.take(torch.arange(min(n, len(split))))


@dataclass
class DataBundle:
    train: Split
    val: Split
    test: Split
    input_shape: Tuple[int, ...]
    classes: List[str]  # the label of each class index

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def is_image(self) -> bool:
        return len(self.input_shape) == 3

    def split(self, name: str) -> Split:
        return getattr(self, name)


# --- sources -----------------------------------------------------------------------------

def load_digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (N, 1, 8, 8) float32 pixels in 0..16 and int64 labels.

    Reads the CSV that ships inside scikit-learn instead of importing sklearn.datasets, which
    would pull in scipy and add about a second to every run's start-up.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data=digits needs scikit-learn, which is not installed; pip install scikit-learn.")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    return table[:, :-1].reshape(-1, 1, 8, 8), table[:, -1].astype(np.int64)


def make_synthetic(cfg: DictConfig, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters around random class centroids, in any input shape (vectors or images)."""
    rng = np.random.default_rng(seed)
    dim = int(np.prod(cfg.input_shape))
    centroids = rng.standard_normal((cfg.num_classes, dim)).astype(np.float32) * cfg.class_sep
    y = rng.integers(0, cfg.num_classes, cfg.num_samples)
    x = centroids[y] + cfg.noise * rng.standard_normal((cfg.num_samples, dim)).astype(np.float32)
    return x.reshape(cfg.num_samples, *cfg.input_shape), y.astype(np.int64)


def read_csv_rows(path: str) -> List[Tuple[int, List[str]]]:
    """The file's rows with the line each ends on, refusing files that are not CSV text."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.reader(handle)
            return [(reader.line_num, row) for row in reader]
    except UnicodeDecodeError as error:
        raise ConfigError(f"data.path={path!r} is not a text CSV file: byte {error.start} is not UTF-8 text.") from None
    except csv.Error as error:
        raise ConfigError(f"data.path={path!r} is not a readable CSV file ({error}).") from None


def load_csv(path: str, label_column: str) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """Feature columns of numbers and one label column; every cell checked, so no NaN is trained on."""
    rows = read_csv_rows(path)
    if not rows:
        raise ConfigError(f"data.path={path!r} is an empty CSV file.")
    (_, header), body = rows[0], rows[1:]
    if label_column not in header:
        raise ConfigError(f"data.label_column={label_column!r} is not a column of data.path={path!r}; "
                          f"its columns are: {', '.join(header)}.")
    if len(header) < 2:
        raise ConfigError(f"data.path={path!r} has only its label column {label_column!r}; it needs feature columns too.")
    label_at = header.index(label_column)
    features = np.empty((len(body), len(header) - 1), dtype=np.float32)
    for index, (line, row) in enumerate(body):
        if len(row) != len(header):
            raise ConfigError(f"data.path={path!r} is ragged: line {line} has {len(row)} values but the header has "
                              f"{len(header)} columns.")
        cells = [(name, value) for name, value in zip(header, row) if name != label_column]
        features[index] = [feature_value(path, line, name, value) for name, value in cells]
        if not row[label_at].strip():
            raise ConfigError(f"data.path={path!r} line {line}, column {label_column!r}: the label is empty; fill or "
                              "drop that row.")
    names, y = np.unique([row[label_at] for _, row in body], return_inverse=True)
    return features, y.astype(np.int64), [str(name) for name in names]


def feature_value(path: str, line: int, column: str, text: str) -> float:
    where = f"data.path={path!r} line {line}, column {column!r}"
    if not text.strip():
        raise ConfigError(f"{where} is empty; fill or drop that row (runlab does not train on missing values).")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where} holds {text!r}, which is not a number; features must be numbers.") from None
    if not np.isfinite(value):
        raise ConfigError(f"{where} holds {text!r}; fill or drop that row (runlab does not train on NaN or inf).")
    return value


def load_tensor_file(path: str, features_key: str, labels_key: str) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as arrays:
            contents = {k: arrays[k] for k in arrays.files}
    else:
        try:
            contents = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ConfigError(f"data.path={path!r} is not a readable tensor file ({type(error).__name__}).") from None
    if not isinstance(contents, dict):
        raise ConfigError(f"data.path={path!r} must hold a dict of tensors with keys {features_key!r} and {labels_key!r}.")
    for key in (features_key, labels_key):
        if key not in contents:
            raise ConfigError(f"data.path={path!r} has no tensor {key!r}; it holds {', '.join(map(str, contents))}.")
    x, y = (np.asarray(contents[k]) for k in (features_key, labels_key))
    names, y = np.unique(y, return_inverse=True)
    return x.astype(np.float32), y.astype(np.int64), [str(name) for name in names.tolist()]


# Each option of conf/data/ names one of these in ``_target_``: (cfg, seed) -> DataBundle.

def digits(cfg: DictConfig, seed: int) -> DataBundle:
    x, y = load_digits_arrays()
    return in_memory(cfg, x, y, numbered(y))


def synthetic(cfg: DictConfig, seed: int) -> DataBundle:
    x, y = make_synthetic(cfg, seed)
    return in_memory(cfg, x, y, numbered(y))


def csv_file(cfg: DictConfig, seed: int) -> DataBundle:
    return in_memory(cfg, *load_csv(cfg.path, cfg.label_column))


def tensor_file(cfg: DictConfig, seed: int) -> DataBundle:
    return in_memory(cfg, *load_tensor_file(cfg.path, cfg.features_key, cfg.labels_key))


def numbered(y: np.ndarray) -> List[str]:
    """Names for labels that are their own names: 0..max."""
    return [str(label) for label in range(int(y.max()) + 1)]


# --- preparation -------------------------------------------------------------------------

def keep_classes(x: np.ndarray, y: np.ndarray, classes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Keep only the listed labels and renumber them 0..k-1 in the listed order."""
    mask = np.isin(y, classes)
    relabel = {c: i for i, c in enumerate(classes)}
    return x[mask], np.array([relabel[c] for c in y[mask]], dtype=np.int64)


def split_indices(n: int, val_fraction: float, test_fraction: float, seed: int) -> Tuple[np.ndarray, ...]:
    order = np.random.default_rng(seed).permutation(n)
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    return order[n_val + n_test:], order[:n_val], order[n_val:n_val + n_test]


def per_class(indices: np.ndarray, y: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` of ``indices`` of each class, in their (seeded) order: a small labelled budget.
    ``n`` = 0 keeps them all."""
    if not n:
        return indices
    labels = y[indices]
    rank = np.zeros(len(indices), dtype=np.int64)
    for label in np.unique(labels):
        rank[labels == label] = np.arange(np.count_nonzero(labels == label))
    return indices[rank < n]


def standardize(train: np.ndarray, *others: np.ndarray) -> List[np.ndarray]:
    """Zero mean, unit variance from the train split alone: one scalar for images, per feature otherwise."""
    axis = None if train.ndim == 4 else 0
    mean, std = train.mean(axis=axis), train.std(axis=axis)
    std = np.where(std < 1e-8, 1.0, std).astype(np.float32)
    return [((a - mean) / std).astype(np.float32) for a in (train, *others)]


def build_data(cfg: DictConfig, seed: int) -> DataBundle:
    """The data the option ``cfg`` (conf/data/) is, built by what its ``_target_`` names."""
    if "_target_" not in cfg:  # a checkpoint's config from before data options named their reader
        cfg = earlier_data_config(cfg)
    return get_object(cfg._target_)(cfg, seed)


def earlier_data_config(cfg: DictConfig) -> DictConfig:
    """A data config as runlab wrote it before each option named its reader (``data.source=NAME``),
    with the reader of that option, so checkpoints of that time still evaluate, export and fine-tune."""
    from framework.config import OPTIONS

    schema = OPTIONS["data"].get(cfg.get("source"))
    if schema is None:
        raise ConfigError(f"this data config names no reader (data._target_) and no known data.source "
                          f"({cfg.get('source')!r}); choose the data on the command line (data=NAME).")
    cfg = cfg.copy()
    cfg._target_ = schema._target_
    return cfg


def in_memory(cfg: DictConfig, x: np.ndarray, y: np.ndarray, names: List[str]) -> DataBundle:
    """A source read whole (inputs, integer labels, each label's name), checked, filtered by
    ``data.classes``, split train/val/test and standardised."""
    if not np.isfinite(x).all():  # a file of tensors (CSV cells are checked as they are read)
        sample, *position = np.argwhere(~np.isfinite(x))[0]
        source = f"data.path={cfg.path!r}" if "path" in cfg else chosen("data", cfg)
        raise ConfigError(f"{source} sample {sample}, feature {tuple(position)} is {x[(sample, *position)]}; "
                          "clean the data first (runlab does not train on NaN or inf).")
    if cfg.classes:
        unknown = [c for c in cfg.classes if not 0 <= c < len(names)]
        if unknown:
            raise ConfigError(f"data.classes={list(cfg.classes)} lists {unknown[0]}, which is not a label of this data; "
                              f"its labels are 0..{len(names) - 1}.")
        x, y = keep_classes(x, y, list(cfg.classes))
        names = [names[c] for c in cfg.classes]
    if len(y) < 3:
        raise ConfigError(f"{chosen('data', cfg)} yielded {len(y)} samples; at least 3 are needed to split train/val/test.")
    train_i, val_i, test_i = split_indices(len(y), cfg.val_fraction, cfg.test_fraction, cfg.split_seed)
    train_i = per_class(train_i, y, cfg.train_per_class)
    parts = [x[train_i], x[val_i], x[test_i]]
    if cfg.normalize:
        parts = standardize(*parts)
    splits = [Split(torch.from_numpy(np.ascontiguousarray(p)), torch.from_numpy(y[i])) for p, i in zip(parts, (train_i, val_i, test_i))]
    return DataBundle(*splits, input_shape=tuple(x.shape[1:]), classes=names)


# --- batching ----------------------------------------------------------------------------

class BatchPlan:
    """Which sample indices make up each batch, for one rank, in one epoch.

    Training batches hold ``batch_size`` samples globally (the last incomplete one is
    dropped, so every optimizer step sees the same number of samples); each of
    ``world_size`` ranks takes its contiguous slice of every global batch. The order is a
    permutation seeded by ``seed + epoch``, so it does not depend on any RNG state and a
    resumed run replays exactly the batches an uninterrupted one would.
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1):
        if shuffle and batch_size > n:
            raise ConfigError(f"batch_size={batch_size} is larger than the {n} training samples; lower it.")
        if batch_size % world_size:
            raise ConfigError(f"batch_size={batch_size} does not divide among {world_size} processes; "
                              f"use a multiple of {world_size}.")
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.rank, self.world_size, self.epoch = rank, world_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.batch_size if self.shuffle else math.ceil(self.n / self.batch_size)

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=generator)

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = self.order()
        if not self.shuffle:  # evaluation: each rank takes a strided shard of the whole set
            yield from order[self.rank::self.world_size].split(self.batch_size)
            return
        per_rank = self.batch_size // self.world_size
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            offset = start + self.rank * per_rank
            yield order[offset:offset + per_rank]


class InMemoryBatches:
    """The fast path: the split lives on the device and a batch is one index operation.

    The labels live on ``target_device``: where the model's outputs come out, which under
    model parallelism is the last stage's device rather than the input's.
    """

    on_device = True

    def __init__(self, split: Split, plan: BatchPlan, device: torch.device, target_device: Optional[torch.device] = None):
        self.x, self.y, self.plan = split.x.to(device), split.y.to(target_device or device), plan

    def set_epoch(self, epoch: int) -> None:
        self.plan.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[Batch]:
        for index in self.plan:
            yield self.x[index.to(self.x.device)], self.y[index.to(self.y.device)]


class _BatchedSplit(Dataset):
    """Hands a DataLoader whole batches (``Split.take``), so no per-sample collate runs."""

    def __init__(self, split: Split):
        self.split, self.epoch = split, 0

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, indices: List[int]) -> Batch:
        return self.split.take(torch.as_tensor(indices), self.epoch)


def _already_batched(batch: Batch) -> Batch:
    return batch


class StreamedBatches:
    """The DataLoader path for sets too large to keep on the device; same batches, same order."""

    on_device = False

    def __init__(self, split: Split, plan: BatchPlan, device: torch.device, num_workers: int):
        self.plan, self.dataset = plan, _BatchedSplit(split)
        # Workers keep the copy of the dataset they started with: augmenting ones restart every
        # epoch, so each sample's random transform follows the epoch (and resumes exactly).
        self.loader = DataLoader(self.dataset, batch_sampler=plan, collate_fn=_already_batched,
                                 num_workers=num_workers, pin_memory=device.type == "cuda",
                                 persistent_workers=num_workers > 0 and not split.augments)

    def set_epoch(self, epoch: int) -> None:
        self.plan.set_epoch(epoch)
        self.dataset.epoch = epoch

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)


def fits_on_device(split: Split, device: torch.device, budget_mb: int) -> bool:
    size_mb = (split.x.numel() * split.x.element_size() + split.y.numel() * 8) / 2**20
    return device.type == "cpu" or size_mb <= budget_mb


def make_batches(split: Split, cfg: DictConfig, plan: BatchPlan, device: torch.device,
                 target_device: Optional[torch.device] = None):
    in_memory = isinstance(split, Split)  # image folders are decoded as they are read
    use_memory = in_memory and (cfg.loader == "memory" or (cfg.loader == "auto" and fits_on_device(split, device, cfg.device_cache_mb)))
    if use_memory:
        return InMemoryBatches(split, plan, device, target_device)
    return StreamedBatches(split, plan, device, cfg.num_workers)


def train_batches(bundle: DataBundle, cfg: DictConfig, device: torch.device, seed: int, rank: int = 0, world_size: int = 1,
                  target_device: Optional[torch.device] = None):
    plan = BatchPlan(len(bundle.train), cfg.batch_size, shuffle=True, seed=seed, rank=rank, world_size=world_size)
    return make_batches(bundle.train, cfg, plan, device, target_device)


def eval_batches(split: Split, cfg: DictConfig, device: torch.device, rank: int = 0, world_size: int = 1,
                 batch_size: Optional[int] = None, target_device: Optional[torch.device] = None):
    plan = BatchPlan(len(split), batch_size or cfg.eval_batch_size, shuffle=False, rank=rank, world_size=world_size)
    return make_batches(split, cfg, plan, device, target_device)
