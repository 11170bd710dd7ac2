"""``python run.py task=doctor``: what this config needs, measured on this machine.

The doctor is a task beside eval and export: it builds what a training run would train
(same config and overrides; ``trainer.build_setup``) and drives the same ``TrainStep``, then
measures instead of training: one step's peak memory, the largest batch that fits, whether
the loader or the step is the bottleneck, whether memory leaks across identical steps, and
what the framework can check by running its own step. Every measurement restores the
weights, optimizer, step sizes and RNG afterwards. The report is printed and written to
``doctor.json``.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import json
import logging
import math
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import torch
from omegaconf import DictConfig, open_dict

from framework import parallel
from framework.checkpoint import rng_state, set_rng_state
from framework import batch as batches
from framework.data import collate_function, eval_batches, length, take, train_batches
from framework.logger import Logger
from framework.model import count_parameters
from framework.nonfinite import NonFiniteGuard
from framework.parallel import unwrap
from framework.step import TrainStep
from framework.trainer import Setup, build_setup
from framework.troubleshoot.environment import describe_environment
from framework.troubleshoot.memory import (activation_mb_per_sample, allocated_mb, heap_in_use_mb, model_memory,
                                           peak_kind, peak_mb, reset_peak, rss_mb)
from framework.troubleshoot.oom import is_out_of_memory, release_memory

log = logging.getLogger(__name__)

LEAK_CAUSES = [
    "a tensor kept across steps together with its graph, e.g. `total_loss += loss` (use loss.item() or loss.detach())",
    "evaluation without torch.no_grad() / torch.inference_mode(), so every forward keeps its graph",
    "references to outputs, losses or batches held in a Python list or dict that grows every step",
]
LEAK_WARMUP_STEPS = 3  # the first steps allocate optimizer state and allocator caches; they are not a leak


@dataclass
class Bench:
    """What the doctor measures: the run's setup, its training step and its batches."""

    cfg: DictConfig
    setup: Setup
    step: TrainStep
    train_batches: Any
    val_batches: Any

    @property
    def env(self) -> parallel.Environment:
        return self.step.env

    @property
    def model(self) -> torch.nn.Module:
        return self.step.model


def bench(cfg: DictConfig) -> Bench:
    """The setup and step a training run of ``cfg`` would have, in this one process."""
    cfg = doctor_config(cfg)
    env = parallel.setup(cfg)
    setup = build_setup(cfg, env)
    nonfinite = NonFiniteGuard(cfg.trainer.on_nonfinite, str(cfg.trainer.precision), lambda: "")
    step = TrainStep.of(cfg, env, setup, nonfinite, Logger())
    return Bench(cfg, setup, step,
                 train_batches(setup.data, cfg.data, env.device, cfg.seed, env.rank, env.world_size),
                 eval_batches(setup.data.val, cfg.data, env.device, env.rank, env.world_size))


def doctor(cfg: DictConfig, run_dir: Path) -> Dict[str, float]:
    examined = bench(cfg)
    batch = first_batch(examined)
    report: Dict[str, Any] = {"environment": describe_environment()}
    report["step_memory"] = step_memory(examined, batch)
    report["largest_batch"] = fit = largest_batch(examined, cfg.troubleshoot.max_probe_batch)
    configured = examined.step.micro_batch
    # The measurements below need steps that run: at the micro-batch training would back off to.
    examined.step.micro_batch = backed_off(configured, fit["largest_micro_batch"])
    report["model"] = model_section(examined, batch)
    report["data_vs_compute"] = data_vs_compute(examined, batch, cfg.troubleshoot.profile_steps) if fit["largest_micro_batch"] \
        else skipped("not even one sample per step fits")
    if fit["largest_micro_batch"]:
        with preserved(examined):
            report["leak_check"] = leak_check(lambda: train(examined, batch), examined.env.device,
                                              cfg.troubleshoot.leak_check_steps)
        report["static_checks"] = static_checks(examined, batch, fit, configured)
    else:
        report["leak_check"], report["static_checks"] = skipped("not even one sample per step fits"), []
    text = render(report)
    print(text)
    if examined.env.is_main:
        (Path(run_dir) / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
        log.info("Doctor report written to %s.", Path(run_dir) / "doctor.json")
    return {}


def train(examined: Bench, batch: Any) -> torch.Tensor:
    """One training step, as the training loop takes it."""
    return examined.step(batch, 0, "a doctor's step")


def backed_off(micro_batch: int, largest: int) -> int:
    """Where OOM recovery's halving lands, starting from ``micro_batch``, when ``largest`` fits."""
    while micro_batch > max(largest, 1):
        micro_batch //= 2
    return micro_batch


def skipped(reason: str) -> Dict[str, Any]:
    return {"skipped": True, "summary": f"skipped: {reason}"}


def doctor_config(cfg: DictConfig) -> DictConfig:
    """The run's config, minus what would make the doctor write or recover instead of measure."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.logger = {"_target_": "framework.logger.Logger"}
        cfg.checkpoint.enabled = False
        cfg.troubleshoot.oom_recovery = False  # the doctor wants to see an out-of-memory error, not hide it
    return cfg


def first_batch(examined: Bench):
    return next(iter(examined.train_batches))


@contextlib.contextmanager
def preserved(examined: Bench):
    """Run measurements that train, then put every weight, optimizer state, step size and RNG back."""
    model, optimizer, step = unwrap(examined.model), examined.setup.optimizer, examined.step
    snapshot = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "step": step.state_dict(), "rng": rng_state()})
    try:
        yield
    finally:
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        step.load_state_dict(snapshot["step"])
        set_rng_state(snapshot["rng"])
        optimizer.zero_grad(set_to_none=True)
        release_memory(examined.env.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def try_step(examined: Bench, batch: Any) -> str:
    """One training step; "" when it fit, else the out-of-memory message (other errors propagate)."""
    failure = ""
    try:
        train(examined, batch)
        synchronize(examined.env.device)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        failure = str(error).strip().splitlines()[0][:300]
    if failure:  # outside the except block, so the error's frames and the step's tensors are gone
        examined.setup.optimizer.zero_grad(set_to_none=True)
        release_memory(examined.env.device)
    return failure


# --- sections ------------------------------------------------------------------------------

def step_memory(examined: Bench, batch: Any) -> Dict[str, Any]:
    """The peak of one real step at the configured batch, over what was held before it."""
    device = examined.env.device
    with preserved(examined):
        release_memory(device)
        before = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else rss_mb()
        reset_peak(device)
        failure = try_step(examined, batch)
        peak = peak_mb(device)
    section = {"batch_per_process": batches.size(batch), "micro_batch": examined.step.micro_batch, "fits": not failure,
               "measured_with": peak_kind(device), "before_mb": round(before, 2), "peak_mb": round(peak, 2),
               "step_mb": round(peak - before, 2)}
    if failure:
        section["error"] = failure
    section["summary"] = (f"one step at batch {batches.size(batch)} (micro-batch {examined.step.micro_batch}) peaks at {peak:.1f} MB, "
                          f"{peak - before:.1f} MB above the {before:.1f} MB held before it ({peak_kind(device)})"
                          if not failure else f"one step at batch {batches.size(batch)} does not fit: {failure}")
    return section


def model_section(examined: Bench, batch: Any) -> Dict[str, Any]:
    model = unwrap(examined.model)
    trainable, frozen = count_parameters(model)
    with preserved(examined):
        try_step(examined, batch)  # the optimizer allocates its state on the first step
        sizes = model_memory(model, examined.setup.optimizer)
    activations = activation_mb_per_sample(examined.setup.spec, examined.setup.data.input_shape)
    section = {"class": examined.setup.spec["_target_"], "trainable_parameters": trainable, "frozen_parameters": frozen,
               **sizes, "activation_mb_per_sample": None if activations is None else round(activations, 4)}
    section["summary"] = (f"{examined.setup.spec['_target_']}: {sizes['parameters']:,} parameters; weights "
                          f"{sizes['parameter_mb']:.2f} MB, gradients {sizes['gradient_mb']:.2f} MB, optimizer state "
                          f"{sizes['optimizer_state_mb']:.2f} MB" +
                          (f", about {activations:.3f} MB of activations per sample" if activations is not None else ""))
    return section


def largest_batch(examined: Bench, max_probe_batch: int) -> Dict[str, Any]:
    """Double the batch until a step fails (or max_probe_batch), then bisect: the largest micro-batch that fits.

    Each probe is one full training step (forward, backward, optimizer) on a batch of training
    samples drawn with replacement, so it has the configured shape and dtype.
    """
    split, device = examined.setup.data.train, examined.env.device
    probes: List[Dict[str, Any]] = []

    def fits(n: int) -> bool:
        index = torch.randint(max(length(split), 1), (n,))
        examined.step.micro_batch = n
        batch = batches.to_device(take(split, index, collate_function(examined.cfg.data)), device)
        failure = try_step(examined, batch)
        probes.append({"batch": n, "fits": not failure})
        return not failure

    with preserved(examined):
        good, bad, n = 0, None, 1
        while bad is None and good < max_probe_batch:
            if fits(n):
                good, n = n, min(2 * n, max_probe_batch)
            else:
                bad = n
        while bad is not None and bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if fits(middle) else (good, middle)
    per_process = examined.cfg.batch_size // examined.env.world_size
    section = {"largest_micro_batch": good, "max_probe_batch": max_probe_batch,
               "bounded_by_max_probe_batch": bad is None, "probes": probes,
               "accumulation_needed": math.ceil(per_process / good) if good else None}
    if not good:
        section["summary"] = "not even one sample per step fits: see the suggestions in the static checks"
    else:
        bound = f" (the probe stops at troubleshoot.max_probe_batch={max_probe_batch})" if bad is None else ""
        section["summary"] = (f"micro-batch {good} fits{bound}; batch_size={examined.cfg.batch_size} needs "
                              f"{section['accumulation_needed']} micro-batch(es) per step per process")
    return section


def data_vs_compute(examined: Bench, batch: Any, steps: int) -> Dict[str, Any]:
    """Time the loader (fetch and move a batch) against a training step on one batch."""
    device = examined.env.device
    started = time.perf_counter()
    fetched = sum(1 for _ in itertools.islice(examined.train_batches, steps))  # each fetched and moved to the device
    synchronize(device)
    load_s = (time.perf_counter() - started) / max(fetched, 1)
    with preserved(examined):
        train(examined, batch)  # warm-up: the first step allocates optimizer state
        synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            train(examined, batch)
        synchronize(device)
        step_s = (time.perf_counter() - started) / steps
    verdict = "data-bound" if load_s > step_s else "compute-bound"
    summary = (f"{verdict}: loading a batch takes {1000 * load_s:.2f} ms, a training step {1000 * step_s:.2f} ms"
               + ("; more data.num_workers or data.loader=memory would help" if verdict == "data-bound" else ""))
    return {"loader_ms_per_batch": round(1000 * load_s, 3), "step_ms": round(1000 * step_s, 3),
            "data_fraction": round(load_s / (load_s + step_s), 3), "verdict": verdict, "summary": summary}


def leak_check(step: Callable[[], Any], device: torch.device, steps: int) -> Dict[str, Any]:
    """Memory after each of ``steps`` identical steps; a leak is growth on nearly every step.

    On CUDA the counter is torch.cuda.memory_allocated; on CPU it is the heap bytes in use
    (glibc mallinfo2), which falls when tensors are freed, unlike RSS.
    """
    for _ in range(LEAK_WARMUP_STEPS):
        step()
    gc.collect()
    samples = [allocated_mb(device)]
    for _ in range(steps):
        step()
        gc.collect()  # garbage awaiting collection is not a leak; what is still referenced is
        samples.append(allocated_mb(device))
    growth = samples[-1] - samples[0]
    rises = sum(later > earlier for earlier, later in zip(samples, samples[1:]))
    # Allocator noise moves a few kilobytes either way; a leak adds its tensors on (nearly) every step.
    leak = growth > 0.25 and rises >= 0.75 * steps
    measured = "torch.cuda.memory_allocated" if device.type == "cuda" else \
        ("heap in use (glibc mallinfo2)" if heap_in_use_mb() is not None else "process RSS")
    section = {"steps": steps, "measured_with": measured, "memory_mb": [round(s, 3) for s in samples],
               "growth_mb": round(growth, 3), "per_step_mb": round(growth / steps, 4), "steps_rising": rises,
               "leak": leak}
    if leak:
        section["likely_causes"] = LEAK_CAUSES
        section["summary"] = (f"LEAK: memory grew {growth:.2f} MB over {steps} identical steps "
                              f"({growth / steps:.3f} MB per step). Likely causes: " + "; ".join(LEAK_CAUSES))
    else:
        section["summary"] = f"no leak: memory changed {growth:+.2f} MB over {steps} identical steps"
    return section


def static_checks(examined: Bench, batch: Any, fit: Dict[str, Any],
                  configured_micro_batch: int) -> List[Dict[str, Any]]:
    """What the framework can verify by running its own loop once, with hooks watching the model."""
    seen: Dict[str, List[tuple]] = {"train": [], "eval": []}
    phase = "train"

    def watch(module, inputs, output):
        seen[phase].append((torch.is_grad_enabled(), module.training))

    handle = unwrap(examined.model).register_forward_hook(watch)
    try:
        with preserved(examined):
            examined.model.train()
            loss = train(examined, batch)
            phase = "eval"
            # An eval batch no larger than the training batch that fits: the doctor itself must not run out.
            examined.step.eval_batch_size = min(examined.step.eval_batch_size, fit["largest_micro_batch"])
            examined.step.evaluate(examined.val_batches)
    finally:
        handle.remove()
    checks = [
        check("evaluation runs without autograd", not any(grad for grad, _ in seen["eval"]),
              "evaluate() runs under torch.inference_mode(), so no graph is kept",
              "evaluation builds a graph: wrap it in torch.no_grad() or torch.inference_mode()"),
        check("evaluation runs in eval mode", not any(training for _, training in seen["eval"]),
              "model.eval() is set: dropout off, batch norm uses running statistics",
              "the model is in training mode during evaluation: call model.eval()"),
        check("training runs with autograd in train mode", all(grad and training for grad, training in seen["train"]),
              "the training step builds its graph in train mode", "the training step runs without grad or in eval mode"),
        check("the step's loss is detached", not loss.requires_grad,
              "train_step returns a detached loss, so summing it keeps no graph alive",
              "train_step returns a loss with its graph: accumulate loss.detach() or loss.item()"),
    ]
    largest, per_process = fit["largest_micro_batch"], examined.cfg.batch_size // examined.env.world_size
    fits = largest >= configured_micro_batch or fit["bounded_by_max_probe_batch"]
    checks.append(check("the configured micro-batch fits", fits,
                        f"micro-batch {configured_micro_batch} is within the {largest} that fit",
                        f"micro-batch {configured_micro_batch} is above the {largest} that fit: training will halve it to "
                        f"{backed_off(configured_micro_batch, largest)}, or set trainer.accumulate_grad_batches={math.ceil(per_process / max(largest, 1))}; "
                        "mixed precision (trainer.precision=bf16) or a smaller model also lower memory"))
    if examined.env.device.type == "cuda":
        checks.append(mixed_precision_check(examined.cfg))
    return checks


def mixed_precision_check(cfg: DictConfig) -> Dict[str, Any]:
    """On CUDA: whether the run uses bf16 or fp16."""
    precision = str(cfg.trainer.precision)
    return check("mixed precision on CUDA", precision != "32", f"trainer.precision={precision}",
                 "trainer.precision=32 on CUDA: bf16 or fp16 roughly halves activation memory and speeds up")


def check(name: str, ok: bool, passed: str, failed: str) -> Dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": passed if ok else failed}


def render(report: Dict[str, Any]) -> str:
    environment = report["environment"]
    devices = ", ".join(f"cuda:{d['index']} {d['name']} ({d['free_mb']:.0f}/{d['total_mb']:.0f} MB free)"
                        for d in environment["cuda_devices"]) or f"cpu ({environment['torch_threads']} threads)"
    lines = ["runlab doctor", "",
             "== environment ==",
             f"python {environment['python']}, torch {environment['torch']}, CUDA {environment['cuda'] or '-'}, "
             f"cuDNN {environment['cudnn'] or '-'}",
             f"devices: {devices}", environment["gpu_status"]]
    for name in ("model", "step_memory", "largest_batch", "data_vs_compute", "leak_check"):
        lines += ["", f"== {name.replace('_', ' ')} ==", report[name]["summary"]]
    lines += ["", "== static checks =="]
    lines += [f"[{'ok' if c['ok'] else '!!'}] {c['check']}: {c['detail']}" for c in report["static_checks"]]
    return "\n".join(lines)
