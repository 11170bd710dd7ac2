"""Image folders (data=imagefolder), trained, exported and the export's outputs mapped to labels, and plain
state dicts as finetune.from (the real torchvision and timm models: tests/test_vision.py). In-process:
tests/test_readme.py types docs/data.md's image-folder run and the README's export."""
import json
import re
import stat
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from conftest import read_metrics
from framework.checkpoint import load_checkpoint, load_model
from framework.data import load_digits_arrays
from framework.entry import run
from framework.export import load_artifact

QUIET = "logger=none trainer.progress_bar=false"
DIGIT_NAMES = {0: "zero", 1: "one", 5: "five", 6: "six", 7: "seven"}


def write_digit_pngs(root: Path, digits, per_class: int, size: int = 32, splits=("",)) -> Path:
    """The bundled 8x8 digits, upscaled to size x size RGB PNGs in root/[split/]<name>/NNN.png."""
    x, y = load_digits_arrays()
    for digit in digits:
        images = x[y == digit]
        for s, split in enumerate(splits):
            folder = root / split / DIGIT_NAMES[digit]
            folder.mkdir(parents=True)
            for i, pixels in enumerate(images[s * per_class:(s + 1) * per_class]):
                gray = Image.fromarray((pixels[0] * 255 / 16).astype(np.uint8)).resize((size, size), Image.Resampling.BILINEAR)
                gray.convert("RGB").save(folder / f"{i:03d}.png")
    return root


def test_an_image_folder_trains_and_its_export_maps_outputs_to_labels(tmp_path):
    root = write_digit_pngs(tmp_path / "images", (0, 1, 7), per_class=20, splits=("train", "val", "test"))
    transforms = ["data.transforms.resize=12", "data.transforms.crop=10", "data.transforms.mean=[0.5,0.5,0.5]",
                  "data.transforms.std=[0.5,0.5,0.5]"]
    outputs = tmp_path / "outputs"
    run_dir = run(["data=imagefolder", f"data.root={root}", *transforms, "model=cnn", "lr=3e-3", "batch_size=20",
                   "trainer.max_epochs=15", *QUIET.split(), f"paths.output_dir={outputs}"]).run_dir
    assert "60 train / 60 val samples" in (run_dir / "train.log").read_text()
    assert load_checkpoint(run_dir / "checkpoints" / "best.pt")["classes"] == ["one", "seven", "zero"]
    assert read_metrics(run_dir)["test/acc"] >= 0.8

    exported = run(["task=export", f"ckpt={outputs / 'train'}", f"paths.output_dir={outputs}"]).run_dir
    said = (exported / "train.log").read_text()
    assert re.search(r"equal the original's \(max abs diff: weights 0, program 0\)\.$", said, re.M), said
    artifact = exported / "artifact"
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in artifact.iterdir())
    labels = json.loads((artifact / "manifest.json").read_text())["labels"]
    assert labels == ["one", "seven", "zero"] == load_model(run_dir / "checkpoints" / "best.pt").classes
    # Plain torch maps the program's outputs to labels with the manifest alone (the eval transform by hand).
    sevens = [np.asarray(Image.open(f).resize((12, 12), Image.Resampling.BILINEAR).crop((1, 1, 11, 11)), np.float32)
              for f in sorted((root / "test" / "seven").iterdir())]
    x = (torch.from_numpy(np.stack(sevens) / 255).permute(0, 3, 1, 2) - 0.5) / 0.5
    predicted = [labels[i] for i in torch.export.load(artifact / "model.pt2").module()(x).argmax(1).tolist()]
    checkpoint = load_model(run_dir / "checkpoints" / "best.pt")
    assert predicted == [checkpoint.classes[i] for i in checkpoint(x).argmax(1).tolist()] and predicted.count("seven") >= 10
    assert load_artifact(artifact).classes == labels


def test_a_plain_state_dict_finetunes_with_its_head_found_and_its_layers_frozen_by_name(train, tmp_path):
    """The path of torchvision's and timm's weight files, with a model named like theirs. In-process (one
    process start fewer): tests/test_readme.py types the README's fine-tuning from a plain torchvision state dict."""
    from usermodels import TorchvisionStyleNet

    torch.manual_seed(0)
    other = TorchvisionStyleNet(num_classes=1000, input_shape=(1, 8, 8))  # an ImageNet-sized head
    torch.save(other.state_dict(), tmp_path / "backbone.pth")
    _, run_dir = train("model=custom", "model._target_=usermodels.TorchvisionStyleNet",
                       f"finetune.from={tmp_path / 'backbone.pth'}", "finetune.freeze=[layer1.*]", "data.classes=[5,6,7,8,9]",
                       "trainer.max_epochs=2", *QUIET.split(), shrink=False)
    said = (run_dir / "train.log").read_text()
    assert "Head 'fc' re-initialised: the number of classes changed" in said
    assert "matched 12 tensors; re-initialised 2 (head 2, missing 0, shape-mismatched 0); ignored 2 from the file " \
           "(fc.weight, fc.bias)" in said
    after = load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    before = other.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("layer1."))  # BatchNorm statistics too
    assert not torch.equal(before["conv1.weight"], after["conv1.weight"]) and after["fc.weight"].shape == (5, 32)
