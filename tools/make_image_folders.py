"""Two image folders for the transfer example (experiments/folder_resnet18.yaml), offline.

    python tools/make_image_folders.py [--out image_folders] [--size 32] [--finetune-labels 10]

From the 8x8 digits that scikit-learn ships, upscaled to SIZE x SIZE RGB PNGs, it writes
OUT/pretrain (the digits 0-5, plenty of labels) and OUT/finetune (6-9, FINETUNE_LABELS labelled
images per class to train on), each as train/, val/ and test/ folders of one folder per class
(zero, one, ...): the layout data=imagefolder reads. The two share no class, as ImageNet and a
user's own classes do not, so the fine-tuning run replaces the pretrained head.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
from PIL import Image

from framework.data import load_digits_arrays

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PRETRAIN_DIGITS, FINETUNE_DIGITS = range(0, 6), range(6, 10)
VAL_PER_CLASS = 30  # the rest of each class (about 150 images, fewer for pretrain) is its test split


def split_rows(train: int, held_out: Optional[int]) -> Dict[str, slice]:
    val = held_out or VAL_PER_CLASS
    return {"train": slice(0, train), "val": slice(train, train + val),
            "test": slice(train + val, train + val + held_out if held_out else None)}


def write_folder(root: Path, digits: Sequence[int], train_per_class: int, size: int, held_out: Optional[int] = None) -> int:
    """root/<split>/<name>/NNN.png for each digit; the number of images written. ``held_out``: the
    images per class in val/ and in test/ (None: 30 in val/, the rest in test/)."""
    pixels, labels = load_digits_arrays()
    written = 0
    for digit in digits:
        images = pixels[labels == digit]
        for split, rows in split_rows(train_per_class, held_out).items():
            folder = root / split / NAMES[digit]
            folder.mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(images[rows]):
                gray = Image.fromarray((image[0] * 255 / 16).astype(np.uint8))
                gray.resize((size, size), Image.Resampling.BILINEAR).convert("RGB").save(folder / f"{i:03d}.png")
                written += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("image_folders"), help="where pretrain/ and finetune/ go")
    parser.add_argument("--size", type=int, default=32, help="the images' side in pixels")
    parser.add_argument("--pretrain-labels", type=int, default=100, help="training images per class of pretrain/")
    parser.add_argument("--finetune-labels", type=int, default=10, help="training images per class of finetune/")
    args = parser.parse_args()
    if (args.out / "pretrain").exists() or (args.out / "finetune").exists():
        sys.exit(f"make_image_folders: {args.out}/pretrain or {args.out}/finetune exists already; remove it first.")
    for name, digits, train in (("pretrain", PRETRAIN_DIGITS, args.pretrain_labels),
                                ("finetune", FINETUNE_DIGITS, args.finetune_labels)):
        count = write_folder(args.out / name, digits, train, args.size)
        print(f"{args.out / name}: {count} images of {', '.join(NAMES[d] for d in digits)}, {train} per class in train/")


if __name__ == "__main__":
    main()
