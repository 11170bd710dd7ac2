"""model=torchvision and model=timm with the real libraries: a torchvision ResNet-18 and a timm
ConvNeXt start from a weights file the test writes (with an ImageNet-sized head of 1000 classes),
get a head for the image folder's 4 classes, keep the layers named in finetune.freeze, train a
step, resume, and go through task=eval and task=export. Nothing here may skip: torchvision is a
dependency and timm is in the dev extra."""
import importlib.util
import re
import sys

import pytest
import timm
import torch
import torchvision
from safetensors.torch import load_file

from conftest import REPO
from framework.checkpoint import load_checkpoint
from framework.errors import ConfigError
from framework.export import load_artifact
from framework.model import import_extra

QUIET = "logger=none trainer.progress_bar=false"
CLASSES = ["eight", "nine", "seven", "six"]  # image_folders/finetune's digits, as data=imagefolder orders them


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """tools/make_image_folders.py's fine-tuning folder (digits 6-9 as 32x32 RGB PNGs), 2 images per class in
    train/ (one batch of 8 is an epoch), 3 in val/ and in test/."""
    spec = importlib.util.spec_from_file_location("make_image_folders", REPO / "tools" / "make_image_folders.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    root = tmp_path_factory.mktemp("images") / "finetune"
    tool.write_folder(root, tool.FINETUNE_DIGITS, train_per_class=2, size=32, held_out=3)
    return root


def frozen_size(model: torch.nn.Module, prefixes) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith(prefixes))


def test_torchvision_resnet18_from_a_weights_file_trains_resumes_evaluates_and_exports(train, tmp_path, folder):
    """In-process: the README's example types the same from the command line (pretrain, export, fine-tune)."""
    torch.manual_seed(0)
    imagenet_shaped = torchvision.models.resnet18()
    weights = tmp_path / "resnet18.pth"
    torch.save(imagenet_shaped.state_dict(), weights)  # as torchvision's own weights files hold it
    run = ["model=torchvision", "model.name=resnet18", "data=imagefolder", f"data.root={folder}", "batch_size=8",
           f"finetune.from={weights}", "finetune.freeze=[conv1.*,bn1.*,layer1.*]", "name=tv", *QUIET.split()]

    metrics, run_dir = train(*run, "trainer.max_epochs=1", shrink=False)
    log = (run_dir / "train.log").read_text()
    assert "Head 'fc' re-initialised: the number of classes changed" in log
    assert "matched 120 tensors; re-initialised 2 (head 2, missing 0, shape-mismatched 0); ignored 2 from the file " \
           "(fc.weight, fc.bias)" in log
    assert "Frozen by finetune.freeze=['conv1.*', 'bn1.*', 'layer1.*']: 15 tensors, 5 BatchNorm layers" in log
    frozen = frozen_size(imagenet_shaped, ("conv1.", "bn1.", "layer1."))
    new_head = torchvision.models.resnet18(num_classes=4)
    assert f"{sum(p.numel() for p in new_head.parameters()) - frozen:,} trainable, {frozen:,} frozen parameters" in log
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    before = imagenet_shaped.state_dict()
    assert metrics["step"] == 1 and last["model"]["fc.weight"].shape == (4, 512)
    # Frozen: the weights and the BatchNorm statistics as the file has them.
    assert all(torch.equal(before[k], last["model"][k]) for k in before if k.startswith(("conv1.", "bn1.", "layer1.")))
    assert not torch.equal(before["layer2.0.conv1.weight"], last["model"]["layer2.0.conv1.weight"])

    resumed, resumed_dir = train(*run, "trainer.max_epochs=2", f"resume={run_dir / 'checkpoints' / 'last.pt'}", shrink=False)
    resumed_weights = load_checkpoint(resumed_dir / "checkpoints" / "last.pt")["model"]
    assert resumed["step"] == 2 and torch.equal(before["layer1.0.bn1.running_mean"], resumed_weights["layer1.0.bn1.running_mean"])
    assert not torch.equal(last["model"]["layer2.0.conv1.weight"], resumed_weights["layer2.0.conv1.weight"])

    evaluated, _ = train("task=eval", f"ckpt={resumed_dir}", shrink=False)
    assert evaluated["test/acc"] == resumed["test/acc"] and "test/acc/six" in evaluated
    _, export_dir = train("task=export", f"ckpt={resumed_dir}", shrink=False)
    artifact = export_dir / "artifact"
    new_head.load_state_dict(load_file(artifact / "weights.safetensors"))  # a plain torchvision state dict, strictly
    model = load_artifact(artifact)
    assert model.classes == CLASSES and type(model) is torchvision.models.ResNet
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model(x), new_head.eval()(x))
    assert torch.equal(model(x), torch.export.load(artifact / "model.pt2").module()(x))


def test_timm_convnext_loads_a_weights_file_as_timm_does_and_trains_only_its_new_head(train, tmp_path, folder):
    """test_convnext: timm's smallest ConvNeXt, its head at head.fc (found, not named), no BatchNorm."""
    torch.manual_seed(0)
    weights = tmp_path / "convnext.pth"
    torch.save(timm.create_model("test_convnext").state_dict(), weights)
    # timm's own way to start from a local file: what runlab loads must be the same weights.
    as_timm_loads = timm.create_model("test_convnext", pretrained=True, pretrained_cfg_overlay=dict(file=str(weights)),
                                      num_classes=4)
    run = ["model=timm", "model.name=test_convnext", "data=imagefolder", f"data.root={folder}", "batch_size=8",
           f"finetune.from={weights}", "finetune.freeze=[stem.*,stages.*]", "name=convnext", *QUIET.split()]

    metrics, run_dir = train(*run, "trainer.max_epochs=1", shrink=False)
    log = (run_dir / "train.log").read_text()
    assert "Head 'head.fc' re-initialised: the number of classes changed" in log
    frozen = frozen_size(as_timm_loads, ("stem.", "stages."))
    assert f"{sum(p.numel() for p in as_timm_loads.parameters()) - frozen:,} trainable, {frozen:,} frozen parameters" in log
    trained, loaded = load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"], as_timm_loads.state_dict()
    assert metrics["step"] == 1 and trained["head.fc.weight"].shape == (4, 64)
    assert all(torch.equal(value, trained[key]) for key, value in loaded.items() if key.startswith(("stem.", "stages.")))
    assert not torch.equal(loaded["head.norm.weight"], trained["head.norm.weight"])  # trained: not frozen

    resumed, resumed_dir = train(*run, "trainer.max_epochs=2", f"resume={run_dir / 'checkpoints' / 'last.pt'}", shrink=False)
    assert resumed["step"] == 2

    evaluated, _ = train("task=eval", f"ckpt={resumed_dir}", shrink=False)
    assert evaluated["test/acc"] == resumed["test/acc"] and "test/acc/nine" in evaluated
    _, export_dir = train("task=export", f"ckpt={resumed_dir}", shrink=False)
    model = load_artifact(export_dir / "artifact")
    x = torch.randn(2, 3, 32, 32)
    assert type(model).__name__ == "ConvNeXt" and model.classes == CLASSES
    assert torch.equal(model(x), torch.export.load(export_dir / "artifact" / "model.pt2").module()(x))


def test_a_missing_timm_is_one_line_naming_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # what import finds where the package is not installed
    with pytest.raises(ConfigError, match=re.escape("model=timm needs the timm package, which is not installed; "
                                                    "pip install -c constraints.txt -e '.[timm]'")):
        import_extra("timm")


def test_a_timm_that_does_not_import_beside_this_torch_is_one_line_saying_so(monkeypatch, tmp_path):
    broken = tmp_path / "timm"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.delitem(sys.modules, "timm")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(f"model=timm: timm is installed but does not import beside torch "
                                                    f"{torch.__version__} (RuntimeError: operator torchvision::nms")):
        import_extra("timm")
