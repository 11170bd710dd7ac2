"""``python run.py task=doctor``: what this config needs, measured on this machine.

The doctor builds the same trainer a training run would (same config and overrides), then
measures instead of training: one step's peak memory, the largest batch that fits, whether
the loader or the step is the bottleneck, whether memory leaks across identical steps, and
what the framework can check by running its own loop. Every measurement restores the
trainer's state afterwards. The report is printed and written to ``doctor.json``.
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
from typing import Any, Callable, Dict, List

import torch
from omegaconf import DictConfig, open_dict

from framework import parallel
from framework.model import count_parameters
from framework.parallel import unwrap
from framework.trainer import Trainer
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


def doctor(cfg: DictConfig, run_dir: Path) -> Dict[str, float]:
    trainer = Trainer(doctor_config(cfg), run_dir, parallel.setup(cfg))
    x, y = first_batch(trainer)
    report: Dict[str, Any] = {"environment": describe_environment()}
    report["step_memory"] = step_memory(trainer, x, y)
    report["largest_batch"] = fit = largest_batch(trainer, cfg.troubleshoot.max_probe_batch)
    configured = trainer.micro_batch
    # The measurements below need steps that run: at the micro-batch training would back off to.
    trainer.micro_batch = backed_off(configured, fit["largest_micro_batch"])
    report["model"] = model_section(trainer, x, y)
    report["data_vs_compute"] = data_vs_compute(trainer, x, y, cfg.troubleshoot.profile_steps) if fit["largest_micro_batch"] \
        else skipped("not even one sample per step fits")
    if fit["largest_micro_batch"]:
        with preserved(trainer):
            report["leak_check"] = leak_check(lambda: trainer.train_step(x, y), trainer.env.device,
                                              cfg.troubleshoot.leak_check_steps)
        report["static_checks"] = static_checks(trainer, x, y, fit, configured)
    else:
        report["leak_check"], report["static_checks"] = skipped("not even one sample per step fits"), []
    text = render(report)
    print(text)
    if trainer.env.is_main:
        (Path(run_dir) / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
        log.info("Doctor report written to %s.", Path(run_dir) / "doctor.json")
    return {}


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


def first_batch(trainer: Trainer):
    x, y = next(iter(trainer.train_batches))
    return x.to(trainer.env.device), y.to(trainer.env.output_device)


@contextlib.contextmanager
def preserved(trainer: Trainer):
    """Run measurements that train, then put every weight, optimizer state, RNG and counter back."""
    snapshot = copy.deepcopy(trainer.state())
    micro_batch = trainer.micro_batch
    try:
        yield
    finally:
        trainer.load_state(snapshot)
        trainer.micro_batch = micro_batch
        trainer.optimizer.zero_grad(set_to_none=True)
        release_memory(trainer.env.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def try_step(trainer: Trainer, x: torch.Tensor, y: torch.Tensor) -> str:
    """One training step; "" when it fit, else the out-of-memory message (other errors propagate)."""
    failure = ""
    try:
        trainer.train_step(x, y)
        synchronize(trainer.env.device)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        failure = str(error).strip().splitlines()[0][:300]
    if failure:  # outside the except block, so the error's frames and the step's tensors are gone
        trainer.optimizer.zero_grad(set_to_none=True)
        release_memory(trainer.env.device)
    return failure


# --- sections ------------------------------------------------------------------------------

def step_memory(trainer: Trainer, x: torch.Tensor, y: torch.Tensor) -> Dict[str, Any]:
    """The peak of one real step at the configured batch, over what was held before it."""
    device = trainer.env.device
    with preserved(trainer):
        release_memory(device)
        before = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else rss_mb()
        reset_peak(device)
        failure = try_step(trainer, x, y)
        peak = peak_mb(device)
    section = {"batch_per_process": len(y), "micro_batch": trainer.micro_batch, "fits": not failure,
               "measured_with": peak_kind(device), "before_mb": round(before, 2), "peak_mb": round(peak, 2),
               "step_mb": round(peak - before, 2)}
    if failure:
        section["error"] = failure
    section["summary"] = (f"one step at batch {len(y)} (micro-batch {trainer.micro_batch}) peaks at {peak:.1f} MB, "
                          f"{peak - before:.1f} MB above the {before:.1f} MB held before it ({peak_kind(device)})"
                          if not failure else f"one step at batch {len(y)} does not fit: {failure}")
    return section


def model_section(trainer: Trainer, x: torch.Tensor, y: torch.Tensor) -> Dict[str, Any]:
    model = unwrap(trainer.model)
    trainable, frozen = count_parameters(model)
    with preserved(trainer):
        try_step(trainer, x, y)  # the optimizer allocates its state on the first step
        sizes = model_memory(model, trainer.optimizer)
    activations = activation_mb_per_sample(trainer.spec, trainer.data.input_shape)
    section = {"class": trainer.spec["_target_"], "trainable_parameters": trainable, "frozen_parameters": frozen,
               **sizes, "activation_mb_per_sample": None if activations is None else round(activations, 4)}
    section["summary"] = (f"{trainer.spec['_target_']}: {sizes['parameters']:,} parameters; weights "
                          f"{sizes['parameter_mb']:.2f} MB, gradients {sizes['gradient_mb']:.2f} MB, optimizer state "
                          f"{sizes['optimizer_state_mb']:.2f} MB" +
                          (f", about {activations:.3f} MB of activations per sample" if activations is not None else ""))
    return section


def largest_batch(trainer: Trainer, max_probe_batch: int) -> Dict[str, Any]:
    """Double the batch until a step fails (or max_probe_batch), then bisect: the largest micro-batch that fits.

    Each probe is one full training step (forward, backward, optimizer) on a batch of training
    samples drawn with replacement, so it has the configured shape and dtype.
    """
    split, device = trainer.data.train, trainer.env.device
    probes: List[Dict[str, Any]] = []

    def fits(n: int) -> bool:
        index = torch.randint(len(split), (n,))
        trainer.micro_batch = n
        x, y = split.take(index)
        failure = try_step(trainer, x.to(device), y.to(trainer.env.output_device))
        probes.append({"batch": n, "fits": not failure})
        return not failure

    with preserved(trainer):
        good, bad, n = 0, None, 1
        while bad is None and good < max_probe_batch:
            if fits(n):
                good, n = n, min(2 * n, max_probe_batch)
            else:
                bad = n
        while bad is not None and bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if fits(middle) else (good, middle)
    per_process = trainer.cfg.batch_size // trainer.env.world_size
    section = {"largest_micro_batch": good, "max_probe_batch": max_probe_batch,
               "bounded_by_max_probe_batch": bad is None, "probes": probes,
               "accumulation_needed": math.ceil(per_process / good) if good else None}
    if not good:
        section["summary"] = "not even one sample per step fits: see the suggestions in the static checks"
    else:
        bound = f" (the probe stops at troubleshoot.max_probe_batch={max_probe_batch})" if bad is None else ""
        section["summary"] = (f"micro-batch {good} fits{bound}; batch_size={trainer.cfg.batch_size} needs "
                              f"{section['accumulation_needed']} micro-batch(es) per step per process")
    return section


def data_vs_compute(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, steps: int) -> Dict[str, Any]:
    """Time the loader (fetch and move a batch) against a training step on one batch."""
    device, batches = trainer.env.device, trainer.train_batches
    started = time.perf_counter()
    fetched = 0
    for bx, by in itertools.islice(batches, steps):
        if not batches.on_device:
            bx, by = bx.to(device), by.to(trainer.env.output_device)
        fetched += 1
    synchronize(device)
    load_s = (time.perf_counter() - started) / max(fetched, 1)
    with preserved(trainer):
        trainer.train_step(x, y)  # warm-up: the first step allocates optimizer state
        synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(x, y)
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


def static_checks(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, fit: Dict[str, Any],
                  configured_micro_batch: int) -> List[Dict[str, Any]]:
    """What the framework can verify by running its own loop once, with hooks watching the model."""
    seen: Dict[str, List[tuple]] = {"train": [], "eval": []}
    phase = "train"

    def watch(module, inputs, output):
        seen[phase].append((torch.is_grad_enabled(), module.training))

    handle = unwrap(trainer.model).register_forward_hook(watch)
    try:
        with preserved(trainer):
            trainer.model.train()
            loss = trainer.train_step(x, y)
            phase = "eval"
            # An eval batch no larger than the training batch that fits: the doctor itself must not run out.
            trainer.val_batches.plan.batch_size = min(trainer.eval_batch_size, fit["largest_micro_batch"])
            trainer.evaluate(trainer.val_batches)
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
    largest, per_process = fit["largest_micro_batch"], trainer.cfg.batch_size // trainer.env.world_size
    fits = largest >= configured_micro_batch or fit["bounded_by_max_probe_batch"]
    checks.append(check("the configured micro-batch fits", fits,
                        f"micro-batch {configured_micro_batch} is within the {largest} that fit",
                        f"micro-batch {configured_micro_batch} is above the {largest} that fit: training will halve it to "
                        f"{backed_off(configured_micro_batch, largest)}, or set trainer.accumulate_grad_batches={math.ceil(per_process / max(largest, 1))}; "
                        "mixed precision (trainer.precision=bf16) or a smaller model also lower memory"))
    if trainer.env.device.type == "cuda":
        checks.append(check("mixed precision on CUDA", str(trainer.cfg.trainer.precision) != "32",
                            f"trainer.precision={trainer.cfg.trainer.precision}",
                            "trainer.precision=32 on CUDA: bf16 or fp16 roughly halves activation memory and speeds up"))
    return checks


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
