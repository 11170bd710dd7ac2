"""OOM recovery (real and injected), the ddp agreement, the doctor report, leak check, memory tracking."""
from __future__ import annotations

import csv
import gc
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import troubleshoot_worker
from conftest import REPO, SHRINK, read_metrics
from framework.checkpoint import load_checkpoint
from framework.logger import Logger
from framework.troubleshoot import DoesNotFitError, MemoryTracker, doctor as doctor_module, environment, memory
from framework.entry import resolved_run_config

WORKER = REPO / "tests" / "troubleshoot_worker.py"
FAST = ["trainer.max_epochs=1", "logger=csv", "trainer.log_every_n_steps=1"]


def make_bench(tmp_path: Path, *overrides: str) -> doctor_module.Bench:
    """What the doctor measures for a run of these overrides."""
    return doctor_module.bench(resolved_run_config([*SHRINK, f"paths.output_dir={tmp_path / 'outputs'}", *overrides]))


def logged(run_dir: Path, metric: str) -> list:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [float(row["value"]) for row in csv.DictReader(handle) if row["metric"] == metric]


def last_weights(run_dir: Path) -> dict:
    return load_checkpoint(run_dir / "checkpoints/last.pt")["model"]


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=atol), name


# --- injected out-of-memory ------------------------------------------------------------------

def test_injected_oom_backs_off_and_keeps_the_trajectory_of_accumulation(train):
    metrics, run_dir = train(*FAST, "troubleshoot.inject_oom_above_batch=16")
    reference, reference_dir = train(*FAST, "trainer.accumulate_grad_batches=4")
    # batch 64 -> 32 -> 16 on the first step, then the eval batch 1024 -> ... -> 16 on the first validation.
    assert metrics["troubleshoot/oom_backoffs"] == 2 and metrics["troubleshoot/micro_batch"] == 16
    assert metrics["troubleshoot/eval_backoffs"] == 6 and metrics["troubleshoot/eval_batch_size"] == 16
    assert reference["troubleshoot/oom_backoffs"] == 0 and reference["troubleshoot/micro_batch"] == 16
    assert metrics["step"] == reference["step"]  # no optimizer step lost or repeated
    assert logged(run_dir, "train/loss_running") == pytest.approx(logged(reference_dir, "train/loss_running"), abs=1e-6)
    assert metrics["val/loss"] == pytest.approx(reference["val/loss"], abs=1e-6)
    assert_same_weights(last_weights(run_dir), last_weights(reference_dir), 1e-6)
    assert logged(run_dir, "troubleshoot/micro_batch") == [32, 16]
    log_text = (run_dir / "train.log").read_text()
    assert "Out of memory at micro-batch 64" in log_text and "accumulation 2 -> 4" in log_text
    assert read_metrics(run_dir)["troubleshoot/oom_backoffs"] == 2


def test_resume_keeps_the_backed_off_micro_batch(train):
    _, first_dir = train("trainer.max_epochs=1", "logger=none", "troubleshoot.inject_oom_above_batch=16")
    assert load_checkpoint(first_dir / "checkpoints/last.pt")["micro_batch"] == 16
    resumed, _ = train("trainer.max_epochs=2", "logger=none", "troubleshoot.inject_oom_above_batch=16",
                       f"resume={first_dir / 'checkpoints/last.pt'}")
    assert resumed["troubleshoot/oom_backoffs"] == 0 and resumed["troubleshoot/micro_batch"] == 16


def test_micro_batch_one_that_does_not_fit_stops_with_advice(train):
    with pytest.raises(DoesNotFitError) as stopped:
        train("logger=none", "batch_size=4", "troubleshoot.inject_oom_above_batch=0")
    message = str(stopped.value)
    assert "even at micro-batch 1" in message and "synthetic out-of-memory" in message
    for advice in ("parameters", "activations per sample", "GPU", "mixed precision", "smaller model",
                   "model parallel", "gradient checkpointing"):
        assert advice in message, advice


def test_recovery_off_lets_the_error_through(train):
    with pytest.raises(torch.OutOfMemoryError, match="synthetic out-of-memory"):
        train("logger=none", "troubleshoot.oom_recovery=false", "troubleshoot.inject_oom_above_batch=16")


# --- a real out-of-memory error ---------------------------------------------------------------

REAL_OOM = ["data=synthetic", "data.input_shape=[1,32,32]", "data.num_samples=6000", "model=cnn", "model.channels=[8]",
            "model.width=32", "batch_size=2048", "data.eval_batch_size=256", "trainer.max_epochs=2", "logger=csv",
            "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
            "checkpoint.enabled=false"]  # the recovery of the step is under test, not the checkpoint write
# Measured with one thread: a step at micro-batch 2048 needs ~234 MB above what set-up holds,
# 1024 ~178 MB, 512 ~122 MB. 150 MB lets 512 fit and makes 2048 and 1024 fail to allocate.
HEADROOM_MB = 150


def limited_run(tmp_path: Path, headroom_mb: int) -> tuple:
    """A run whose address space is capped, in a process of its own (the cap is process-wide)."""
    run_dir = tmp_path / "limited"
    run_dir.mkdir()
    command = [sys.executable, str(WORKER), "limited", str(headroom_mb), str(run_dir),
               *REAL_OOM, f"paths.output_dir={tmp_path / 'outputs'}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "result0.json").read_text()), run_dir, done.stderr


def unlimited_run(tmp_path: Path, *overrides: str) -> tuple:
    """The same run without a cap, in this process (one process start fewer)."""
    run_dir = tmp_path / "reference"
    run_dir.mkdir()
    troubleshoot_worker.limited_run(0, run_dir, [*REAL_OOM, f"paths.output_dir={tmp_path / 'outputs'}", *overrides])
    return json.loads((run_dir / "result0.json").read_text()), run_dir


@pytest.mark.timeout(300)
def test_real_cpu_oom_under_an_address_space_limit_recovers(tmp_path):
    limited, limited_dir, log_text = limited_run(tmp_path, HEADROOM_MB)
    assert limited["troubleshoot/oom_backoffs"] >= 1 and limited["micro_batch"] < 2048
    assert "Out of memory at micro-batch 2048" in log_text and "DefaultCPUAllocator: can't allocate memory" in log_text
    accumulate = 2048 // limited["micro_batch"]
    reference, reference_dir = unlimited_run(tmp_path, f"trainer.accumulate_grad_batches={accumulate}")
    assert reference["micro_batch"] == limited["micro_batch"] and reference["troubleshoot/oom_backoffs"] == 0
    assert limited["step"] == reference["step"] == 4
    # Equal up to rounding: oneDNN may pick another convolution algorithm with less memory to spare.
    assert logged(limited_dir, "train/loss_running") == pytest.approx(logged(reference_dir, "train/loss_running"), abs=1e-6)
    assert_same_weights(torch.load(limited_dir / "weights0.pt"), torch.load(reference_dir / "weights0.pt"), 1e-5)


# --- ddp agreement -----------------------------------------------------------------------------

def ddp_ranks(mode: str, tmp_path: Path, run_dir: Path, overrides: List[str]) -> List[dict]:
    """Train two gloo ranks with troubleshoot_worker.py MODE; each rank's result{rank}.json."""
    ranks = [subprocess.Popen([sys.executable, str(WORKER), mode, str(rank), "2", str(tmp_path / "init"), str(run_dir),
                               *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = [rank.communicate(timeout=200)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return [json.loads((run_dir / f"result{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.timeout(240)
def test_ddp_ranks_agree_on_the_backoff_when_one_rank_runs_out(tmp_path, train):
    # test_after_fit=false: the weights compared are the trained ones, not a reload of best.pt.
    # Batch norm: its buffers ride on the same all-reduce, and each micro-batch normalises alone.
    # SGD, not Adam: batch norm zeroes the gradient of the digits' constant border pixels up to
    # rounding, and Adam would scale that rounding noise (which differs with the order of sums) up to full steps.
    model = ["model.batch_norm=true", "optimizer=sgd", "lr=0.05"]
    overrides = [*SHRINK, "trainer.max_epochs=2", "logger=none", "trainer.test_after_fit=false", *model,
                 f"paths.output_dir={tmp_path / 'o'}",
                 "troubleshoot.inject_oom_above_batch=16", "troubleshoot.inject_oom_rank=1"]
    run_dir = tmp_path / "ddp"
    run_dir.mkdir()
    results = ddp_ranks("ddp", tmp_path, run_dir, overrides)
    for result in results:  # only rank 1 ran out, yet both backed off together: 32 -> 16 per rank
        assert result["micro_batch"] == 16 and result["troubleshoot/oom_backoffs"] == 1
        assert result["troubleshoot/eval_batch_size"] == 16
    rank0, rank1 = (torch.load(run_dir / f"weights{rank}.pt") for rank in range(2))
    # Parameters and running statistics alike; num_batches_tracked is an integer count that
    # also counts the forward rank 0 finished in the attempt that rank 1 ran out in.
    floating = [name for name in rank0 if rank0[name].is_floating_point()]
    assert_same_weights({n: rank0[n] for n in floating}, {n: rank1[n] for n in floating})
    assert results[0]["val/loss"] == results[1]["val/loss"]
    # The same parameters as one process with the whole batch of 64 in micro-batches of 16 (its
    # running statistics differ: it updates them per micro-batch, the ranks average theirs).
    single, single_dir = train("trainer.max_epochs=2", "trainer.accumulate_grad_batches=4", "logger=none", *model)
    assert results[0]["step"] == single["step"]
    parameters = [name for name in rank0 if not name.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert_same_weights({n: rank0[n] for n in parameters}, {n: last_weights(single_dir)[n] for n in parameters}, 1e-5)


@pytest.mark.timeout(240)
def test_default_ddp_overlaps_the_all_reduce_with_backward_and_survives_an_oom_mid_backward(tmp_path, train):
    # Three 512-wide blocks: more than DDP's first 1 MB bucket, so gradients go in several buckets.
    overrides = [*SHRINK, "model.width=512", "model.depth=3", "trainer.max_steps=4", "trainer.accumulate_grad_batches=2",
                 "logger=none", "trainer.test_after_fit=false", "optimizer=sgd", "lr=0.05",
                 f"paths.output_dir={tmp_path / 'o'}"]
    run_dir = tmp_path / "ddp"
    run_dir.mkdir()
    results = ddp_ranks("watched", tmp_path, run_dir, overrides)
    watched = [json.loads((run_dir / f"watch{rank}.json").read_text()) for rank in range(2)]
    # Rank 1 failed after sending some of the second step's buckets; both backed off 16 -> 8 and went on.
    assert watched[1]["buckets_sent_at_failure"][0] >= 1
    assert [r["micro_batch"] for r in results] == [8, 8] and [r["troubleshoot/oom_backoffs"] for r in results] == [1, 1]
    for seen in watched:
        # Accumulation runs the micro-batches before a step's last under no_sync, and only the last synchronises.
        assert re.fullmatch("(F*T)+", "".join("T" if flag else "F" for flag in seen["synchronised"]))
        # That last backward all-reduces buckets before it reaches the first layer: the all-reduce
        # overlaps backward. (DDP's first iteration after wrapping, the first step and the retried
        # one, has all gradients in one bucket; it splits them from the second iteration on.)
        assert seen["buckets_sent_at_first_layer"][-2:] == [1, 1], seen["buckets_sent_at_first_layer"]
    rank0, rank1 = (torch.load(run_dir / f"weights{rank}.pt") for rank in range(2))
    assert_same_weights(rank0, rank1)
    # The same weights as one process taking the whole batch of 64 in micro-batches of 8.
    _, single_dir = train(*overrides[len(SHRINK):], "trainer.accumulate_grad_batches=8")
    assert_same_weights(rank0, last_weights(single_dir), 1e-5)


# --- doctor ------------------------------------------------------------------------------------

SECTIONS = ("environment", "model", "step_memory", "largest_batch", "data_vs_compute", "leak_check", "static_checks")
DOCTOR = ["task=doctor", "troubleshoot.max_probe_batch=256", "troubleshoot.leak_check_steps=6",
          "troubleshoot.profile_steps=2"]


@pytest.fixture
def frozen_heap():
    """The objects earlier tests left in this process are set aside from the garbage collector (gc.freeze), so that
    the gc.collect() leak_check runs after each step walks only what the test made (in a worker that ran many files
    first, each collect took a good part of a second). The steps' own garbage and leaks are collected and measured
    as before."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_doctor_on_cpu_without_gputil_writes_every_section(train, monkeypatch, capsys, frozen_heap):
    monkeypatch.setitem(sys.modules, "GPUtil", None)  # import GPUtil now raises ImportError
    metrics, run_dir = train(*DOCTOR, "troubleshoot.inject_oom_above_batch=64")
    report = json.loads((run_dir / "doctor.json").read_text())
    assert set(SECTIONS) <= set(report)
    env = report["environment"]
    assert env["gpus"] == [] and "\n" not in env["gpu_status"] and env["gpu_status"].startswith("no GPU")
    assert env["torch"] == torch.__version__ and env["cuda_devices"] == []
    model = report["model"]
    assert model["parameters"] > 0 and model["gradient_mb"] == model["parameter_mb"]
    assert model["optimizer_state_mb"] == pytest.approx(2 * model["parameter_mb"], rel=0.01)  # AdamW: two moments
    assert model["activation_mb_per_sample"] > 0
    assert report["step_memory"]["fits"] and report["step_memory"]["peak_mb"] > 0
    assert report["step_memory"]["measured_with"].startswith("process RSS peak")
    fit = report["largest_batch"]  # the injected limit is what the doubling-then-bisection probe finds
    assert fit["largest_micro_batch"] == 64 and not fit["bounded_by_max_probe_batch"]
    assert [p["batch"] for p in fit["probes"]] == [1, 2, 4, 8, 16, 32, 64, 128, 96, 80, 72, 68, 66, 65]
    timing = report["data_vs_compute"]  # the verdict follows the two measured times
    assert timing["loader_ms_per_batch"] > 0 and timing["step_ms"] > 0
    assert timing["verdict"] == ("data-bound" if timing["loader_ms_per_batch"] > timing["step_ms"] else "compute-bound")
    assert timing["data_fraction"] == pytest.approx(
        timing["loader_ms_per_batch"] / (timing["loader_ms_per_batch"] + timing["step_ms"]), abs=2e-3)
    assert not report["leak_check"]["leak"]
    checks = {c["check"]: c["ok"] for c in report["static_checks"]}
    assert checks["evaluation runs without autograd"] and checks["the step's loss is detached"]
    assert checks["the configured micro-batch fits"]
    printed = capsys.readouterr().out
    assert "== largest batch ==" in printed and "micro-batch 64 fits" in printed


def test_doctor_advice_names_config_keys_that_exist(tmp_path):
    bench = make_bench(tmp_path, "troubleshoot.inject_oom_above_batch=40")
    batch = doctor_module.first_batch(bench)
    fit = doctor_module.largest_batch(bench, 256)
    configured, bench.step.micro_batch = bench.step.micro_batch, 32  # the doctor's steps run backed off
    checks = doctor_module.static_checks(bench, batch, fit, configured)
    checks.append(doctor_module.mixed_precision_check(bench.cfg))  # the check a CUDA run adds
    advice = {c["check"]: c["detail"] for c in checks}
    assert "or set trainer.accumulate_grad_batches=2" in advice["the configured micro-batch fits"]
    assert advice["mixed precision on CUDA"].startswith("trainer.precision=32 on CUDA")
    named = re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)=", " ".join(advice.values()))
    assert named and [key for key in named if OmegaConf.select(bench.cfg, key) is None] == []


def test_gpu_status_reads_a_mocked_gputil_table(monkeypatch):
    gputil = pytest.importorskip("GPUtil")
    fake = gputil.GPU(0, "uuid", 0.42, 8000, 3000, 5000, "driver", "NVIDIA H100", "serial", "Enabled", "Enabled", 40)
    monkeypatch.setattr(gputil, "getGPUs", lambda: [fake])
    assert environment.gpu_table() == [{"id": 0, "name": "NVIDIA H100", "load_percent": 42.0, "memory_used_mb": 3000,
                                        "memory_total_mb": 8000, "memory_percent": 37.5}]
    assert environment.gpu_status() == "GPU 0 NVIDIA H100: load 42.0%, memory 3000/8000 MB (37.5%)"
    monkeypatch.setattr(gputil, "getGPUs", lambda: (_ for _ in ()).throw(OSError("nvidia-smi failed")))
    assert environment.gpu_table() == [] and environment.gpu_status().startswith("no GPU")


def test_largest_batch_probe_restores_all_state(tmp_path):
    bench = make_bench(tmp_path, "troubleshoot.inject_oom_above_batch=40")
    before = {k: v.clone() for k, v in bench.model.state_dict().items()}
    rng = torch.get_rng_state()
    fit = doctor_module.largest_batch(bench, 256)
    assert fit["largest_micro_batch"] == 40 and fit["accumulation_needed"] == 2
    assert_same_weights(bench.model.state_dict(), before)
    assert bench.setup.optimizer.state_dict()["state"] == {} and bench.step.micro_batch == 64
    assert torch.equal(torch.get_rng_state(), rng)


# --- leak check and memory tracking -------------------------------------------------------------

def test_leak_check_flags_a_loss_summed_with_its_graph_and_passes_the_framework_step(tmp_path, frozen_heap):
    bench = make_bench(tmp_path, "model.width=256")
    batch = doctor_module.first_batch(bench)
    val_x, val_y = (tensor[:64] for tensor in bench.setup.data.val.tensors)
    running_val_loss = torch.zeros(())

    def leaky_step():
        nonlocal running_val_loss
        doctor_module.train(bench, batch)
        # The classic mistake: a metric computed without no_grad and summed as a tensor, so
        # every step's graph and the activations it saved stay alive.
        running_val_loss = running_val_loss + F.cross_entropy(bench.model(val_x), val_y)

    leaky = doctor_module.leak_check(leaky_step, bench.env.device, 6)
    assert leaky["leak"] and leaky["growth_mb"] > 0.25 and leaky["likely_causes"]
    clean = doctor_module.leak_check(lambda: doctor_module.train(bench, batch), bench.env.device, 6)
    assert not clean["leak"] and abs(clean["growth_mb"]) < 0.25


def test_memory_is_tracked_every_epoch_and_reported(train):
    metrics, run_dir = train(*FAST, "trainer.max_epochs=2")
    peaks = logged(run_dir, "memory/peak_mb")
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    assert metrics["memory/peak_mb"] == max(peaks)


def test_memory_tracker_warns_once_on_steady_growth(monkeypatch, caplog):
    values = iter([100, 102, 104, 106, 108, 110, 50, 60])
    monkeypatch.setattr(memory, "peak_mb", lambda device: next(values))
    tracker = MemoryTracker(torch.device("cpu"), growth_epochs=3)
    with caplog.at_level(logging.WARNING, logger="framework.troubleshoot.memory"):
        for _ in range(6):
            tracker.end_epoch(Logger(), 0, (64, 1024))
    warnings = [r for r in caplog.records if "Peak memory rose" in r.message]
    assert len(warnings) == 1 and "100.0, 102.0, 104.0, 106.0" in warnings[0].message
    shape_changed = MemoryTracker(torch.device("cpu"), growth_epochs=3)
    shape_changed.history = [((64, 1024), 100.0), ((64, 1024), 110.0), ((32, 1024), 120.0), ((32, 1024), 130.0)]
    assert not shape_changed.grows_steadily()  # a new micro-batch moves the peak legitimately
    assert tracker.summary() == {"memory/peak_mb": 110}
