import csv

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2


def read_events(run_dir):
    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_holds_scalars_histograms_images_graph_and_hparams(train):
    metrics, run_dir = train("model=cnn", "model.channels=[4,8]", "logger.histogram_every_n_epochs=1", "lr=3e-3")
    events = read_events(run_dir)
    tags = events.Tags()
    assert {"train/loss", "train/loss_running", "val/loss", "val/acc", "lr", "train/samples_per_second"} <= set(tags["scalars"])
    assert [e.value for e in events.Scalars("val/acc")][-1] == pytest.approx(metrics["val/acc"])
    assert any(t.startswith("weights/") for t in tags["histograms"]) and any(t.startswith("grads/") for t in tags["histograms"])
    assert len(events.Histograms("weights/head.weight")) == 3
    assert tags["images"] == ["predictions/pred_true"]
    assert tags["graph"]
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["lr"].number_value == pytest.approx(3e-3)
    assert start.hparams["model"].string_value == "CNN"
    assert events.Scalars("hparam/val/acc")[0].value == pytest.approx(metrics["val/acc"])


def test_tabular_data_logs_no_image_grid(train):
    _, run_dir = train("data=synthetic", "data.num_samples=300")
    assert read_events(run_dir).Tags()["images"] == []


def test_csv_logger_writes_one_row_per_value(train):
    metrics, run_dir = train("logger=csv")
    with open(run_dir / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    val_acc = [float(r["value"]) for r in rows if r["metric"] == "val/acc"]
    assert len(val_acc) == 3 and val_acc[-1] == pytest.approx(metrics["val/acc"])
    assert not (run_dir / "tensorboard").exists()


def test_logger_none_writes_only_the_run_files(train):
    _, run_dir = train("logger=none")
    assert not (run_dir / "tensorboard").exists() and (run_dir / "metrics.json").is_file()


@pytest.mark.timeout(180)
def test_wandb_runs_offline_without_an_account(train, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    metrics, run_dir = train("logger=wandb", "trainer.max_epochs=1")
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
