"""One learning rate: the optimizer reads the top-level ``lr`` (``optimizer.lr: ${lr}``), and a config
that sets ``optimizer.lr`` to another value is refused before any work, naming both and the fix."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

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


def resolved(*overrides: str) -> dict:
    """A config as a checkpoint holds it."""
    cfg = composed(*overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def test_a_resumed_run_keeps_the_checkpoints_schedule_only_where_its_config_builds_the_same_one():
    from framework.scheduler import same_schedule

    saved = resolved("scheduler=cosine", "trainer.max_epochs=2")
    assert same_schedule(saved, composed("scheduler=cosine", "trainer.max_epochs=2", "lr=0.01", "seed=3"))
    for other in (["trainer.max_epochs=4"], ["scheduler.interval=step"], ["scheduler=step"], ["scheduler=none"]):
        assert not same_schedule(saved, composed("scheduler=cosine", "trainer.max_epochs=2", *other)), other
