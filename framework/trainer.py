"""The training loop (conf/trainer/).

``Trainer.fit`` reads top to bottom: epochs of optimizer steps, validation passes (at each epoch's
end, and every ``trainer.val_every_n_steps`` steps), then the components (scheduler, early stopping,
checkpointer, logger, the sweep's pruner) each decide what to do with the validation's metrics.
Everything device- or process-specific goes through ``Environment``.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from framework.checkpoint import (Checkpointer, EarlyStopping, TRAINING_STATE, atomic_write, rng_state,
                                  set_rng_state)
from framework import batch as batches
from framework.config import monitor_mode
from framework.data import DataBundle, build_data, collate_function, eval_batches, first, length, train_batches
from framework.errors import Interrupted, signal_name
from framework.finetune import Finetuner
from framework.logger import build_logger, run_name
from framework.model import build_model, count_parameters
from framework.nonfinite import NonFiniteGuard
from framework.objective import Objective, build_objective
from framework.optimizer import build_optimizer, configured_groups, keep_configured, restart_lr
from framework.parallel import Environment, unwrap
from framework.paths import shown
from framework.progress import ProgressBar
from framework.resume import changed_settings, check_same_model, checkpoint_to_resume
from framework.scheduler import build_scheduler, same_schedule
from framework.search.trial import sweep_trial
from framework.signals import StopRequest
from framework.step import TrainStep
from framework.troubleshoot import MemoryTracker

log = logging.getLogger(__name__)


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    if not minutes:
        return f"{seconds:.1f} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {rest} s"


def seed_everything(seed: int, deterministic: bool) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


@dataclass
class Setup:
    """What a run trains, built the same way for training and for the doctor."""

    data: DataBundle
    objective: Objective
    finetuner: Finetuner
    spec: Dict[str, Any]  # the model's constructor call
    model: torch.nn.Module  # wrapped for the parallel mode
    optimizer: torch.optim.Optimizer


def build_setup(cfg: DictConfig, env: Environment) -> Setup:
    seed_everything(cfg.seed, cfg.trainer.deterministic)
    data = build_data(cfg.data, cfg.seed)
    objective = build_objective(cfg.objective, data.output_size).to(env.output_device)
    finetuner = Finetuner(cfg)
    spec = finetuner.model_spec(cfg.model, data.input_shape, data.output_size)
    model = env.wrap(objective.wrap(finetuner.prepare(build_model(spec))))
    optimizer = build_optimizer(cfg.optimizer, model, finetuner.param_groups())
    return Setup(data, objective, finetuner, spec, model, optimizer)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: Path, env: Environment, stop: Optional[StopRequest] = None):
        self.cfg, self.run_dir, self.env = cfg, Path(run_dir), env
        self.stop = stop or StopRequest()
        setup = build_setup(cfg, env)
        self.data, self.finetuner, self.spec, self.optimizer = setup.data, setup.finetuner, setup.spec, setup.optimizer
        self.objective = setup.objective
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer)
        self.train_batches = train_batches(self.data, cfg.data, env.device, cfg.seed, env.rank, env.world_size)
        self.val_batches = eval_batches(self.data.val, cfg.data, env.device, env.rank, env.world_size)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.monitor,
                                         monitor_mode(cfg, "checkpoint"), cfg.checkpoint.enabled, env.is_main,
                                         every_n_steps=cfg.checkpoint.every_n_steps,
                                         every_minutes=cfg.checkpoint.every_minutes, keep_last=cfg.checkpoint.keep_last,
                                         collective_state=env.collective_state, write_shards=env.shard_writer())
        self.early_stopping = EarlyStopping(**{**cfg.early_stopping, "mode": monitor_mode(cfg, "early_stopping")})
        self.nonfinite = NonFiniteGuard(cfg.trainer.on_nonfinite, str(cfg.trainer.precision), self.finite_state_kept)
        self.trial = sweep_trial(cfg, self.run_dir, env.is_main)
        self.logger = build_logger(cfg, self.run_dir, env.is_main, run_name(cfg.name, self.run_dir, self.trial))
        self.train_step = TrainStep.of(cfg, env, setup, self.nonfinite, self.logger)
        self.memory = MemoryTracker(env.device, cfg.troubleshoot.memory_growth_epochs)
        self.epoch, self.step, self.batch_in_epoch = 0, 0, 0
        self.validations = 0  # those on the schedule: what early stopping's patience and the pruner count
        self.validated_at = -1  # the step of the last validation
        self.metrics: Dict[str, float] = {}  # the last validation's
        self.stop_reason = ""
        self.results_of_complete_run: Optional[Path] = None  # resume= named a run with nothing left to train
        self.resume()

    # --- set-up helpers ----------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self.train_step.model  # the step's: under ddp it wraps the model anew after an out-of-memory step

    def resume(self) -> None:
        """Continue the run ``resume`` names (framework/resume.py): its state, this config's settings."""
        source = checkpoint_to_resume(self.cfg, self.run_dir)
        if source is None:
            return
        state = self.env.read_checkpoint(source, TRAINING_STATE, self.model, self.optimizer)
        check_same_model(state["model_spec"], self.spec, source)
        changes = changed_settings(state["config"], self.cfg)
        groups = configured_groups(self.optimizer)
        self.load_state(state)
        # The checkpoint restored its optimizer hyperparameters and schedule; this config's apply instead.
        # A new lr, budget (T_max) or schedule continues on the schedule this config builds.
        if keep_configured(self.optimizer, groups) or not same_schedule(state["config"], self.cfg):
            restart_lr(self.optimizer, groups)
            self.scheduler = build_scheduler(self.cfg.scheduler, self.optimizer)
            self.scheduler.fast_forward(self.epoch, self.step)
        complete = self.complete_because()
        if complete:
            self.stop_reason = f"the run in {shown(source.parent.parent)} is complete ({complete}); nothing left to train"
            if (source.parent.parent / "metrics.json").is_file():
                self.results_of_complete_run = source.parent.parent / "metrics.json"
                return  # fit() says so in one line; this run dir gets nothing
        self.checkpointer.adopt_best(source.with_name("best.pt"))
        self.logger.continue_run(source.parent.parent, self.step)
        log.info("Resumed from %s at %s.", shown(source), self.here)
        if changes:
            log.info("Resumed with this command line's settings: %s.", "; ".join(changes))

    def complete_because(self) -> str:
        """Why a restored run has nothing left to train, or ""."""
        if self.epoch >= self.cfg.trainer.max_epochs:
            return f"it reached trainer.max_epochs={self.cfg.trainer.max_epochs}"
        if self.step >= self.max_steps:
            return f"it reached trainer.max_steps={self.cfg.trainer.max_steps}"
        if self.early_stopping.exhausted():
            return f"early stopping ended it: {self.early_stopping.tracker.monitor} did not improve for " \
                   f"{self.early_stopping.patience} {self.validation_unit}"
        return ""

    @property
    def validation_unit(self) -> str:
        return "validations" if self.cfg.trainer.val_every_n_steps else "epochs"

    @functools.cached_property  # the loop asks every step, and reading the config costs more than the answer
    def max_steps(self) -> int:
        steps_per_epoch = len(self.train_batches)
        by_epochs = self.cfg.trainer.max_epochs * steps_per_epoch
        return by_epochs if self.cfg.trainer.max_steps == -1 else min(by_epochs, self.cfg.trainer.max_steps)

    # --- state -------------------------------------------------------------------------

    def state(self) -> Dict[str, Any]:
        return {
            "model": self.env.model_state(self.model),
            "model_spec": self.spec,
            "optimizer": self.env.optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            **self.train_step.state_dict(),  # scaler, micro_batch, eval_batch_size
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            "validations": self.validations,
            "checkpointer": self.checkpointer.state_dict(),
            "early_stopping": self.early_stopping.state_dict(),
            "metrics": self.metrics,
            "rng": rng_state(),
            "config": self.resolved_config,
            "classes": self.data.classes,
        }

    @functools.cached_property
    def resolved_config(self) -> Dict[str, Any]:
        """The config as plain data, as every checkpoint holds it: converted once, since it does not
        change during a run (converting takes a few ms, a sizeable part of a small model's epoch)."""
        return OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)

    def load_state(self, state: Dict[str, Any]) -> None:
        """Restore exactly what ``state()`` saved."""
        self.env.load_model_state(self.model, state["model"])
        self.env.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.train_step.load_state_dict(state)
        self.epoch, self.step, self.batch_in_epoch = state["epoch"], state["step"], state["batch_in_epoch"]
        self.validations = state.get("validations", self.epoch)  # a checkpoint of a runlab that validated per epoch
        self.checkpointer.load_state_dict(state["checkpointer"])
        self.early_stopping.load_state_dict(state["early_stopping"])
        self.metrics = dict(state.get("metrics", {}))
        set_rng_state(state["rng"])

    # --- the loop ----------------------------------------------------------------------

    def fit(self) -> Dict[str, float]:
        if self.results_of_complete_run is not None:
            log.info("%s%s; its results are in %s.", self.stop_reason[0].upper(), self.stop_reason[1:],
                     shown(self.results_of_complete_run))
            return json.loads(self.results_of_complete_run.read_text())
        trainable, frozen = count_parameters(self.model)
        train, val = (length(split) for split in (self.data.train, self.data.val))
        log.info("Model %s: %s trainable, %s frozen parameters; %s train / %s val samples.", self.spec["_target_"],
                 f"{trainable:,}", f"{frozen:,}", f"{train:,}", f"{val:,}" if val >= 0 else "an unknown number of")
        progress = ProgressBar(self.max_steps, self.cfg.trainer.progress_bar and self.env.is_main, initial=self.step)
        started, steps_at_start = time.perf_counter(), self.step
        try:
            # A signal now only asks the loop to stop; it stops after the step it is in (interrupt()).
            with self.stop.deferred():
                while self.epoch < self.cfg.trainer.max_epochs and not self.stop_reason:
                    self.end_epoch(self.train_epoch(progress), progress)
            progress.close(finished=True)
        finally:
            progress.close()
        train_seconds = time.perf_counter() - started
        return self.finish(train_seconds, self.step - steps_at_start)

    def train_epoch(self, progress: ProgressBar) -> float:
        """One pass over the training batches; returns the mean training loss."""
        self.model.train()
        self.finetuner.on_epoch_start(self.epoch)
        # A run resumed mid-epoch starts at the batch after the last it trained on, without loading those before.
        self.train_batches.set_epoch(self.epoch, start=self.batch_in_epoch)
        # Losses are summed as a detached tensor: no graph is kept alive across steps and
        # the host syncs only when a value is logged, not on every step.
        loss_sum = torch.zeros((), device=self.env.output_device)
        steps, window_start, window_time = 0, 0, time.perf_counter()
        log_every, val_every = self.cfg.trainer.log_every_n_steps, self.cfg.trainer.val_every_n_steps
        for index, batch in enumerate(self.train_batches, start=self.batch_in_epoch):  # on the device already
            loss = self.train_step(batch, self.step, self.position(self.step + 1))
            self.scheduler.after_step()
            if loss is not None:  # None: a non-finite step skipped (trainer.on_nonfinite=skip)
                loss_sum, steps = loss_sum + loss, steps + 1
            self.step, self.batch_in_epoch = self.step + 1, index + 1
            progress.advance()
            at_log_step = self.step % log_every == 0
            if at_log_step:
                window_time = self.log_train_window(loss_sum, steps, window_start, window_time, progress)
                window_start = steps
            # Under ddp the ranks agree at logging steps, where they all ask; one process stops at once.
            if self.env.agree_to_stop(self.stop.requested, all_ranks_ask=at_log_step):
                self.interrupt()
            if self.step >= self.max_steps:
                if self.epoch + 1 < self.cfg.trainer.max_epochs or self.batch_in_epoch < len(self.train_batches):
                    self.stop_reason = f"reached trainer.max_steps={self.max_steps}"
                break
            # The epoch's last batch is validated by end_epoch; a validation writes last.pt anyway.
            if val_every and self.step % val_every == 0 and self.batch_in_epoch < len(self.train_batches):
                self.validate_mid_epoch(self.env.all_reduce_mean(loss_sum).item() / max(steps, 1), progress)
                if self.stop_reason:  # early stopping or the pruner
                    break
            else:
                self.checkpointer.on_step(self.state, self.step)
        if self.env.agree_to_stop(self.stop.requested, all_ranks_ask=True):
            self.interrupt()
        return self.env.all_reduce_mean(loss_sum).item() / max(steps, 1)

    @property
    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def position(self, step: int) -> str:
        """Where a step of the epoch in progress is, as every message numbers it: epochs from 1."""
        return f"step {step} (epoch {self.epoch + 1})"

    @property
    def here(self) -> str:
        """Where the run is between steps, numbered as position() numbers them: a point mid-epoch is in
        the epoch in progress, one at an epoch's end in the epoch just ended."""
        return f"step {self.step} (epoch {self.epoch + (self.batch_in_epoch > 0)})"

    def finite_state_kept(self) -> str:
        """Where the last finite state is, for a run that stops on a non-finite value."""
        if not self.checkpointer.last.exists():
            return "No checkpoint was written before it."
        return (f"{shown(self.checkpointer.last)} keeps the last finite state (epoch {self.epoch}); resume=auto with "
                "a lower lr continues from it.")

    def log_train_window(self, loss_sum: torch.Tensor, steps: int, window_start: int, window_time: float,
                         progress: ProgressBar) -> float:
        now = time.perf_counter()
        samples = (steps - window_start) * self.cfg.batch_size
        values = {"train/loss_running": self.env.all_reduce_mean(loss_sum).item() / max(steps, 1),
                  "train/samples_per_second": samples / (now - window_time), "lr": self.current_lr}
        self.logger.log_metrics(values, self.step)
        progress.show({"loss": values["train/loss_running"], "samples/s": values["train/samples_per_second"]})
        return now

    def interrupt(self) -> None:
        """Stop on the signal received: save this exact point to last.pt, then end the run."""
        self.checkpointer.save_last(self.state)
        self.env.barrier()  # no rank leaves before rank 0 has written: a launcher ends the others on the first exit
        where = f"{signal_name(self.stop.signum)} at {self.here}"
        if not self.checkpointer.enabled:
            raise Interrupted(self.stop.signum, f"{where}; checkpoints are off (checkpoint.enabled=false), so nothing "
                                                "was saved to resume from.")
        raise Interrupted(self.stop.signum, f"{where}; saved {shown(self.checkpointer.last)}. Continue with resume=auto.")

    def close(self) -> None:
        """Finish the checkpoint write in flight, close the logger and stop the loaders' workers; on success
        and on a crash alike."""
        try:
            self.checkpointer.wait()
        finally:
            self.logger.close()
            # Workers stop when their DataLoader is freed, and the trainer sits in reference cycles that
            # only the garbage collector frees: a notebook would wait for that, seconds per worker.
            self.train_batches = self.val_batches = None

    def end_epoch(self, train_loss: float, progress: ProgressBar) -> None:
        if self.validated_at == self.step:
            return  # a validation mid-epoch stopped the run, and it logged and saved this very point
        metrics = self.validation_metrics(train_loss)
        # A run stopped by max_steps mid-epoch keeps its place in the epoch, so a resume
        # continues with the next batch instead of replaying the epoch.
        complete = self.batch_in_epoch >= len(self.train_batches)
        if complete:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            self.scheduler.after_epoch()
            with self.env.unsharded(self.model):  # rank 0 alone logs them
                self.logger.log_histograms(unwrap(self.model), self.epoch - 1)
            self.memory.end_epoch(self.logger, self.step, self.train_step.sizes)
        # The validation a max_steps stop adds mid-epoch is not on the schedule: an uninterrupted run would
        # not make it, so early stopping and the pruner do not count it (a resume stays exact).
        self.act_on_validation(metrics, progress, scheduled=complete)

    def validate_mid_epoch(self, train_loss: float, progress: ProgressBar) -> None:
        self.act_on_validation(self.validation_metrics(train_loss), progress, scheduled=True)
        self.model.train()

    def validation_metrics(self, train_loss: float) -> Dict[str, float]:
        val = self.train_step.evaluate(self.val_batches, self.step)
        metrics = {"train/loss": train_loss, **{f"val/{name}": value for name, value in val.items()}}
        # Broken weights must not reach a checkpoint: the last finite state stays on disk.
        self.nonfinite.check_validation(metrics, self.position(self.step), self.current_lr)
        return metrics

    def act_on_validation(self, metrics: Dict[str, float], progress: ProgressBar, scheduled: bool) -> None:
        """Each component decides what a validation means to it: early stopping and the pruner count those
        on the schedule; the logs and the checkpointer take every one."""
        self.validated_at = self.step
        if scheduled:
            self.validations += 1
            if self.early_stopping.update(metrics) and not self.stop_reason:
                self.stop_reason = (f"early stopping: {self.early_stopping.tracker.monitor} did not improve "
                                    f"for {self.early_stopping.patience} {self.validation_unit}")
        metrics["epoch"] = self.epoch
        self.logger.log_metrics(metrics, self.step)
        where = f"validation {self.validations} (step {self.step})" if self.cfg.trainer.val_every_n_steps \
            else f"epoch {self.epoch}"
        pruned = self.trial.report(metrics, self.validations, where)
        if pruned and not self.stop_reason:
            self.stop_reason = pruned
        self.metrics = metrics
        self.checkpointer.maybe_save(self.state, metrics)
        progress.show({name.replace("/", "_"): value for name, value in metrics.items() if name.startswith("val/")})
        log.info("epoch %d  step %d  %s", self.epoch + (self.batch_in_epoch > 0), self.step,  # numbered as self.here
                 "  ".join(f"{name} {metrics[name]:.4f}" for name in metrics if name != "epoch"))

    def finish(self, train_seconds: float, steps_run: int) -> Dict[str, float]:
        """Test the best weights, write metrics.json and the run's hparams, and say where everything is;
        then refuse a result that is mostly skipped steps (trainer.on_nonfinite=skip)."""
        monitor = self.checkpointer.tracker.monitor
        final = {**self.metrics, "step": self.step, f"best/{monitor}": self.checkpointer.tracker.best,
                 "best_epoch": self.checkpointer.best_epoch,
                 "train_seconds": train_seconds,
                 "samples_per_second": steps_run * self.cfg.batch_size / train_seconds if train_seconds else 0.0}
        test = self.test_best()
        self.logger.log_metrics(test, self.step)
        final.update(test)
        final.update(self.train_step.summary(), **self.memory.summary(), **self.nonfinite.summary())
        self.log_sample_predictions()
        # Traced once trained: a trace runs the model, and one before or during training would
        # draw dropout's random numbers and move BatchNorm's statistics.
        example = self.objective.example_input(first(self.data.val, 2, collate_function(self.cfg.data)))
        if example is not None and self.env.traceable:
            with self.env.unsharded(self.model):  # rank 0 alone traces it
                self.logger.log_graph(unwrap(self.model), batches.to_device(example, self.env.device))
        self.logger.log_hparams(self.hparams(), {k: v for k, v in final.items() if "/" in k})
        if self.env.is_main:
            text = json.dumps(final, indent=2, allow_nan=True) + "\n"
            atomic_write(self.run_dir / "metrics.json", lambda tmp: tmp.write_text(text))
            self.log_where_things_are(final, steps_run)
        self.nonfinite.check_run(steps_run)
        return final

    def log_where_things_are(self, final: Dict[str, float], steps_run: int) -> None:
        """The run's last lines: why it stopped, how it did, what to keep in mind reading it, where it
        wrote and how to look at it."""
        monitor = self.checkpointer.tracker.monitor
        tested = (f"test/{monitor.split('/', 1)[1]}", "test/loss")
        tests = "  ".join(f"{name} {final[name]:.4f}" for name in dict.fromkeys(tested) if name in final)
        best, best_epoch = final[f"best/{monitor}"], final["best_epoch"]
        reason = self.stop_reason or f"reached trainer.max_epochs={self.cfg.trainer.max_epochs}"
        log.info("Run dir: %s", shown(self.run_dir))
        log.info("Stopped: %s, at %s, after %s of training.", reason, self.here, duration(final["train_seconds"]))
        log.info("Best %s: %s%s%s", monitor, "none" if best is None else f"{best:.4f}",
                 "" if best_epoch is None else f" (epoch {best_epoch})", f"   {tests}" if tests else "")
        caveat = self.nonfinite.caveat(steps_run)
        if caveat:
            log.warning(caveat)
        written = [shown(path) for path in (self.checkpointer.best, self.checkpointer.last) if path.exists()]
        log.info("Checkpoints: %s", ", ".join(written) if written else "none (checkpoint.enabled=false)")
        if (self.run_dir / "tensorboard").is_dir():
            log.info("TensorBoard: tensorboard --logdir %s", shown(self.run_dir / "tensorboard"))

    def test_best(self) -> Dict[str, float]:
        if not self.cfg.trainer.test_after_fit or not length(self.data.test):
            return {}
        self.checkpointer.wait()
        self.env.barrier()  # every process reads best.pt only once rank 0 has finished writing it
        if self.checkpointer.best.exists():
            # The checkpoint of the best epoch, not the last weights, is what a user would ship.
            self.env.load_model_state(self.model, self.env.read_checkpoint(self.checkpointer.best, ("model",), self.model)["model"])
        test = self.train_step.evaluate(eval_batches(self.data.test, self.cfg.data, self.env.device, self.env.rank,
                                                     self.env.world_size), self.step)
        return {f"test/{name}": value for name, value in test.items()}

    def log_sample_predictions(self) -> None:
        """A grid of val images captioned with predicted and true class: only where outputs are class scores of images."""
        if not (self.objective.labels_outputs and self.data.input_shape and len(self.data.input_shape) == 3):
            return
        with self.env.unsharded(self.model), torch.inference_mode():  # gathered first: later steps reuse its buffers
            images, labels = self.objective.inputs_and_target(first(self.data.val, 16, collate_function(self.cfg.data)))
            predictions = self.model(images.to(self.env.device)).argmax(1).cpu()
        self.logger.log_predictions(images, labels, predictions, self.epoch)

    def hparams(self) -> Dict[str, Any]:
        flat = {"lr": self.cfg.lr, "batch_size": self.cfg.batch_size, "seed": self.cfg.seed,
                "model": self.spec["_target_"].rsplit(".", 1)[-1], "optimizer": self.cfg.optimizer._target_.rsplit(".", 1)[-1]}
        for key, value in self.spec.items():
            if isinstance(value, (int, float, str, bool)) and not key.startswith("_"):
                flat[f"model.{key}"] = value
        return {**flat, **self.trial.hparams()}

