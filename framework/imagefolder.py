"""Folders of images (conf/data/imagefolder.yaml): ``DIR/<class>/*.png|jpg``, one folder per class.

The splits are ``DIR/train``, ``DIR/val`` and ``DIR/test`` when ``DIR/train`` exists (each laid
out by class; ``test`` may be left out), else a seeded fraction of ``DIR/<class>``, as for the
other sources. Every file's header is read while listing, so an unreadable image, or one that
would come out in another size, fails in one line before training starts rather than in a
DataLoader worker mid-epoch. Pixels are decoded in the workers, batch by batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from framework.data import DataBundle, per_class, split_indices
from framework.errors import ConfigError

SUFFIXES = (".png", ".jpg", ".jpeg")
SPLITS = ("train", "val", "test")
Listing = Tuple[List[Path], np.ndarray]  # the files of a split and their labels


@dataclass
class ImageTransform:
    """Resize, crop, flip and normalise, as data.transforms says; random only when given a generator."""

    resize: int
    crop: int
    flip: bool
    grayscale: bool
    mean: Sequence[float]
    std: Sequence[float]

    @property
    def augments(self) -> bool:
        return self.flip or self.crop > 0

    def resized(self, width: int, height: int) -> Tuple[int, int]:
        if not self.resize:
            return width, height
        scale = self.resize / min(width, height)
        return max(1, round(width * scale)), max(1, round(height * scale))

    def output_size(self, width: int, height: int) -> Optional[Tuple[int, int]]:
        """(height, width) of what this transform makes of an image; None when it is smaller than the crop."""
        width, height = self.resized(width, height)
        if self.crop:
            return (self.crop, self.crop) if min(width, height) >= self.crop else None
        return height, width

    def __call__(self, path: Path, rng: Optional[np.random.Generator]) -> torch.Tensor:
        with Image.open(path) as stored:
            image = stored.convert("L" if self.grayscale else "RGB")
        if self.resize:
            image = image.resize(self.resized(*image.size), Image.Resampling.BILINEAR)
        if self.crop:
            width, height = image.size
            spare_x, spare_y = width - self.crop, height - self.crop
            left, top = (spare_x // 2, spare_y // 2) if rng is None else (int(rng.integers(spare_x + 1)), int(rng.integers(spare_y + 1)))
            image = image.crop((left, top, left + self.crop, top + self.crop))
        if self.flip and rng is not None and rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
        pixels = pixels[None] if pixels.ndim == 2 else pixels.permute(2, 0, 1)
        if self.mean:
            pixels = (pixels - torch.tensor(self.mean)[:, None, None]) / torch.tensor(self.std)[:, None, None]
        return pixels.contiguous()


class ImageSplit(torch.utils.data.Dataset):
    """Image files and their labels, decoded one by one (in DataLoader workers).

    A training split augments: sample i in epoch e is transformed with a generator seeded by
    (seed, e, i), so the result depends on neither the worker nor the order of loading, and a
    run resumed mid-epoch sees the same images. The loader calls ``set_epoch`` (and so starts
    its workers anew each epoch, with this epoch's copy).
    """

    def __init__(self, files: List[Path], labels: np.ndarray, transform: ImageTransform, seed: int, augments: bool):
        self.files, self.y, self.transform = files, torch.from_numpy(labels), transform
        self.seed, self.augments, self.epoch = seed, augments, 0
        if not augments:
            self.set_epoch = None  # nothing follows the epoch: the loader may keep its workers

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, i]) if self.augments else None
        return self.transform(self.files[i], rng), self.y[i]


def class_folders(directory: Path) -> Dict[str, List[Path]]:
    return {folder.name: sorted(f for f in folder.iterdir() if f.suffix.lower() in SUFFIXES)
            for folder in sorted(directory.iterdir()) if folder.is_dir()}


def labelled(folders: Dict[str, List[Path]], classes: List[str]) -> Listing:
    files = [f for name in classes for f in folders.get(name, [])]
    labels = [label for label, name in enumerate(classes) for _ in folders.get(name, [])]
    return files, np.array(labels, dtype=np.int64)


def list_splits(root: str, val_fraction: float, test_fraction: float, split_seed: int) -> Tuple[List[str], List[Listing]]:
    """The class names and the (files, labels) of train, val and test."""
    root = Path(root)
    if not (root / "train").is_dir():
        folders = class_folders(root)
        classes = [name for name, files in folders.items() if files]
        files, labels = labelled(folders, classes)
        parts = split_indices(len(files), val_fraction, test_fraction, split_seed)
        return classes, [([files[i] for i in part], labels[part]) for part in parts]
    folders = [class_folders(root / name) if (root / name).is_dir() else {} for name in SPLITS]
    classes = [name for name, files in folders[0].items() if files]
    if not any(folders[1].values()):
        raise ConfigError(f"data.root={str(root)!r} has train/ but no images in val/<class>/; add a val split "
                          "(test/ is optional).")
    for split, found in zip(SPLITS[1:], folders[1:]):
        unknown = sorted(name for name, files in found.items() if files and name not in classes)
        if unknown:
            raise ConfigError(f"data.root={str(root)!r}: {split}/{unknown[0]} is a class that train/ does not have; "
                              f"train/ has {', '.join(classes)}.")
    return classes, [labelled(found, classes) for found in folders]


def checked_shape(files: List[Path], transform: ImageTransform, root: str) -> Tuple[int, int, int]:
    """The (C, H, W) every image comes out in, read from the file headers; one line for any file that does not fit."""
    sizes: Dict[Tuple[int, int], Path] = {}
    for path in files:
        try:
            with Image.open(path) as image:
                width, height = image.size
        except (OSError, UnidentifiedImageError) as error:
            raise ConfigError(f"{path} is not a readable image ({type(error).__name__}); fix or remove it.") from None
        size = transform.output_size(width, height)
        if size is None:
            raise ConfigError(f"{path} is {width}x{height}, smaller than data.transforms.crop={transform.crop} after "
                              f"resizing; set data.transforms.resize to at least {transform.crop}.")
        sizes.setdefault(size, path)
        if len(sizes) > 1:
            (one, first), (other, second) = sizes.items()
            raise ConfigError(f"images under data.root={root!r} come out in different sizes ({first} as {one[1]}x{one[0]}, "
                              f"{second} as {other[1]}x{other[0]}); set data.transforms.crop (and resize) to one size.")
    height, width = next(iter(sizes))
    return (1 if transform.grayscale else 3), height, width


def build_image_folder(root: str, transforms: Dict, seed: int, val_fraction: float, test_fraction: float,
                       split_seed: int, train_per_class: int) -> DataBundle:
    classes, (train, val, test) = list_splits(root, val_fraction, test_fraction, split_seed)
    if len(classes) < 2:
        raise ConfigError(f"data.root={root!r} holds images of {len(classes)} class(es); it needs a folder of "
                          f"{'|'.join(SUFFIXES)} files for each of at least 2 classes.")
    keep = per_class(np.arange(len(train[0])), train[1], train_per_class)
    train = ([train[0][i] for i in keep], train[1][keep])
    transform = ImageTransform(**transforms)
    shape = checked_shape(train[0] + val[0] + test[0], transform, root)
    splits = [ImageSplit(files, labels, transform, seed, augments=transform.augments and name == "train")
              for name, (files, labels) in zip(SPLITS, (train, val, test))]
    return DataBundle(*splits, input_shape=shape, classes=classes)
