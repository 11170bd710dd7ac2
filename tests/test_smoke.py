from conftest import read_metrics


def test_default_run_trains_and_writes_its_run_dir(train):
    metrics, run_dir = train()
    assert metrics["val/acc"] > 0.5
    for name in ("train.log", "metrics.json", "checkpoints/last.pt", "checkpoints/best.pt", "tensorboard"):
        assert (run_dir / name).exists(), name
    assert read_metrics(run_dir)["val/acc"] == metrics["val/acc"]
