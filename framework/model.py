"""Shipped models (conf/model/) and how any model is built from config.

Models are plain ``nn.Sequential`` subclasses of named stages: they know nothing about
devices or processes (parallel.py wraps them), and a pipeline can split them by stage.
Each names its output layer in ``head_name`` so fine-tuning can replace it by name.

``model=torchvision`` and ``model=timm`` build other libraries' classification models by
name, with random weights: pretrained ones come from a local file through finetune.from, which
replaces the head and freezes by name as for runlab's own models. torchvision is a dependency,
timm an optional extra.
"""
from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.config import accepted_keys
from framework.errors import ConfigError, instantiate

# Every batch norm of torch.nn, by its public classes (tests/test_private_apis.py checks that none is missing):
# layers whose running statistics a frozen layer or a micro-batch affects.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
               nn.LazyBatchNorm3d, nn.SyncBatchNorm)


def _dense_block(width_in: int, width_out: int, dropout: float, batch_norm: bool) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Linear(width_in, width_out)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(width_out))
    layers.append(nn.ReLU())
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class MLP(nn.Sequential):
    head_name = "head"

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, width: int, depth: int, dropout: float,
                 batch_norm: bool):
        stages: "OrderedDict[str, nn.Module]" = OrderedDict(flatten=nn.Flatten())
        width_in = int(torch.tensor(input_shape).prod())
        for i in range(depth):
            stages[f"block{i}"] = _dense_block(width_in, width, dropout, batch_norm)
            width_in = width
        stages["head"] = nn.Linear(width_in, num_classes)
        super().__init__(stages)


def _conv_block(channels_in: int, channels_out: int, batch_norm: bool) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=not batch_norm)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(channels_out))
    layers += [nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers)


class CNN(nn.Sequential):
    """Conv-ReLU-pool blocks, then a dense layer: sized for 8x8 digits up to 28x28 images."""

    head_name = "head"

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, channels: Sequence[int], width: int,
                 dropout: float, batch_norm: bool):
        channels_in, height, width_px = input_shape
        stages: "OrderedDict[str, nn.Module]" = OrderedDict()
        for i, channels_out in enumerate(channels):
            stages[f"conv{i}"] = _conv_block(channels_in, channels_out, batch_norm)
            channels_in, height, width_px = channels_out, height // 2, width_px // 2
        if height < 1 or width_px < 1:
            raise ValueError(f"model.channels has {len(channels)} pooling blocks, too many for a {tuple(input_shape)} input.")
        stages["flatten"] = nn.Flatten()
        stages["dense"] = _dense_block(channels_in * height * width_px, width, dropout, batch_norm=False)
        stages["head"] = nn.Linear(width, num_classes)
        super().__init__(stages)


class ResidualBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(channels_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Sequential):
    """A small ResNet: a stem, then stages of residual blocks that halve the resolution."""

    head_name = "head"

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, width: int, stages: int, blocks_per_stage: int):
        channels_in = input_shape[0]
        layers: "OrderedDict[str, nn.Module]" = OrderedDict(
            stem=nn.Sequential(nn.Conv2d(channels_in, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()))
        channels = width
        for stage in range(stages):
            channels_out = width * 2 ** stage
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers[f"stage{stage}_block{block}"] = ResidualBlock(channels, channels_out, stride)
                channels = channels_out
        layers["pool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        layers["head"] = nn.Linear(channels, num_classes)
        super().__init__(layers)


class CharLM(nn.Module):
    """A character-level language model: embeddings, a GRU, and a linear layer to the next character's
    logits. It computes its own loss from a batch (objective=model_loss, framework/objective.py):
    the mean cross entropy, in nats, of each next character given the ones before it."""

    head_name = "head"

    def __init__(self, input_shape: Sequence[int], num_classes: int, *, width: int, depth: int, dropout: float):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, width)
        self.rnn = nn.GRU(width, width, num_layers=depth, batch_first=True, dropout=dropout if depth > 1 else 0.0)
        self.head = nn.Linear(width, num_classes)

    def forward(self, characters: torch.Tensor) -> torch.Tensor:
        """(batch, time) character ids -> (batch, time, vocabulary) logits of each next character."""
        hidden, _ = self.rnn(self.embedding(characters))
        return self.head(hidden)

    def loss(self, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        characters, following = batch
        logits = self(characters)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), following.flatten())


# How each library the builders import is installed: torchvision comes with runlab, timm is an extra.
INSTALLS = {"torchvision": "pip install -c constraints.txt -e .", "timm": "pip install -c constraints.txt -e '.[timm]'"}


def import_extra(package: str) -> Any:
    """``torchvision`` or ``timm``, or one line saying how to install it or why it does not import."""
    install = INSTALLS[package]
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"model={package} needs the {package} package, which is not installed; {install}") from None
    except Exception as error:  # e.g. a torchvision wheel built for another torch: its C++ operators do not load
        raise ConfigError(f"model={package}: {package} is installed but does not import beside torch {torch.__version__} "
                          f"({type(error).__name__}: {error}); it needs a build for this exact torch, version and CPU or "
                          "CUDA alike.") from None


def torchvision_model(name: str, num_classes: int, input_shape: Sequence[int]) -> nn.Module:
    """Any torchvision classification model by builder name (resnet18, mobilenet_v3_small, ...), weights=None."""
    models = import_extra("torchvision").models
    if name not in models.list_models(module=models):
        raise ConfigError(f"model.name={name!r} is not a torchvision classification model; choose one of "
                          f"{', '.join(models.list_models(module=models))}.")
    if input_shape[0] != 3:
        raise ConfigError(f"model=torchvision takes 3-channel images, but this data has {input_shape[0]} channel(s); "
                          "with data=imagefolder set data.transforms.grayscale=false.")
    return models.get_model(name, weights=None, num_classes=num_classes)


def timm_model(name: str, num_classes: int, input_shape: Sequence[int]) -> nn.Module:
    """Any timm model by name, with ``in_chans`` from the data; pretrained=False, so nothing is downloaded."""
    timm = import_extra("timm")
    if not timm.is_model(name):
        raise ConfigError(f"model.name={name!r} is not a timm model; timm.list_models() lists them.")
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=input_shape[0])


# Functions a model spec may name besides nn.Module classes, and the extra each needs.
EXTRA_BUILDERS = {"framework.model.torchvision_model": "torchvision", "framework.model.timm_model": "timm"}


def model_spec(model_cfg: DictConfig, input_shape: Optional[Tuple[int, ...]], num_classes: int) -> Dict[str, Any]:
    """The full constructor call as a plain dict: saved in checkpoints so a model rebuilds from them alone.

    ``input_shape`` and ``num_classes`` come from the data, unless the config sets them, where the
    constructor takes them (its other keys were checked against it before any work: ``validate``).
    """
    spec = OmegaConf.to_container(model_cfg, resolve=True)
    accepted = accepted_keys(get_object(spec["_target_"]))
    runtime = {"num_classes": num_classes}
    if input_shape is not None:  # None: the data's inputs have no one shape (the model sizes itself)
        runtime["input_shape"] = list(input_shape)
    return {**spec, **{k: v for k, v in runtime.items() if k not in spec and (accepted is None or k in accepted)}}


def build_model(spec: Dict[str, Any]) -> nn.Module:
    model = instantiate(spec, _convert_="all")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model._target_={spec['_target_']!r} built a {type(model).__name__}, not a torch.nn.Module.")
    return model


def count_parameters(model: nn.Module) -> Tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen
