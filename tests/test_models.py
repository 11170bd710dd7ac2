import pytest
import torch

from conftest import composed
from framework.model import CNN, MLP, ResNet, build_model, model_spec


@pytest.mark.parametrize("model_cls, kwargs", [
    (MLP, {"width": 16, "depth": 3, "dropout": 0.1, "batch_norm": True}),
    (CNN, {"channels": [8, 16], "width": 32, "dropout": 0.0, "batch_norm": False}),
    (ResNet, {"width": 8, "stages": 2, "blocks_per_stage": 2}),
])
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28)])
def test_shipped_models_map_images_to_class_logits(model_cls, kwargs, shape):
    model = model_cls(input_shape=shape, num_classes=7, **kwargs)
    assert model(torch.randn(5, *shape)).shape == (5, 7)
    assert isinstance(getattr(model, model.head_name), torch.nn.Linear)


def test_depth_and_width_are_configurable():
    small, big = (MLP((64,), 10, width=width, depth=depth, dropout=0.0, batch_norm=False) for width, depth in ((8, 1), (64, 3)))
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in big.parameters())
    assert len([m for m in big.modules() if isinstance(m, torch.nn.Linear)]) == 4


def test_too_many_pooling_blocks_are_a_clear_error():
    with pytest.raises(ValueError, match="too many"):
        CNN((1, 8, 8), 10, channels=[4, 4, 4, 4], width=8, dropout=0.0, batch_norm=False)


def test_model_spec_rebuilds_the_same_architecture():
    spec = model_spec(composed("model=cnn").model, (1, 8, 8), 10)
    assert spec["input_shape"] == [1, 8, 8] and spec["num_classes"] == 10
    assert isinstance(build_model(spec), CNN)


def test_a_users_own_module_trains_by_target(train):
    metrics, run_dir = train("model=custom", "model._target_=usermodels.TinyNet", "+model.hidden=24", "lr=1e-2",
                             "trainer.max_epochs=3", "trainer.progress_bar=false", shrink=False)
    assert metrics["val/acc"] > 0.5
    assert "usermodels.TinyNet: 1,810 trainable" in (run_dir / "train.log").read_text()
