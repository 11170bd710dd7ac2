"""One learning rate: the optimizer reads the top-level ``lr`` (``optimizer.lr: ${lr}``), and a config
that sets ``optimizer.lr`` to another value is refused before any work, naming both and the fix."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import open_dict

from conftest import composed
from framework.config import validate
from framework.errors import ConfigError

REFUSED = r"optimizer.lr=0.5 differs from lr=0.001: the run would train at 0.5 and record 0.001; " \
          r"set the learning rate once, with lr=0.5, and leave optimizer.lr out \(it reads \$\{lr\}\)."


def test_an_optimizer_lr_apart_from_lr_is_refused(train):
    with pytest.raises(ConfigError, match=REFUSED):
        train("optimizer.lr=0.5")


def test_an_experiment_that_sets_optimizer_lr_is_refused(train, tmp_path):
    """The issue's case: an experiment YAML with ``optimizer: {lr: 0.5}``, which trained at 0.5 while
    its config recorded lr 0.001."""
    (tmp_path / "extra" / "experiment").mkdir(parents=True)
    (tmp_path / "extra" / "experiment" / "fast.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: mlp\n\noptimizer:\n  lr: 0.5\n")
    with pytest.raises(ConfigError, match=REFUSED):
        train(f"hydra.searchpath=[file://{tmp_path / 'extra'}]", "experiment=fast")


@pytest.mark.parametrize("overrides, expected", [((), 1e-3), (("lr=0.5",), 0.5), (("lr=0.5", "optimizer.lr=0.5"), 0.5),
                                                 (("optimizer=sgd", "lr=0.05"), 0.05)])
def test_the_optimizer_trains_at_lr(overrides, expected):
    cfg = composed(*overrides)
    with open_dict(cfg):
        del cfg["hydra"]  # as framework.run does
    validate(cfg)
    optimizer = instantiate(cfg.optimizer, params=[torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.param_groups[0]["lr"] == expected == cfg.lr
