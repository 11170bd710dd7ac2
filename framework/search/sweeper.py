"""The study loop behind ``hydra/sweeper=runlab``.

It is hydra-optuna-sweeper's loop (the same samplers, search-space syntax ``interval``/``choice``/
``range``, and settings: ``storage: null`` for an in-memory study, ``study_name: null``,
``custom_search_space``, a list of directions for several objectives, ``optimization_results.yaml``)
with what that one lacks:

- every trial is a normal run that can open the study and report each epoch, so the
  study's pruner can stop it (framework/search/trial.py);
- the study is stored (sqlite in the sweep dir by default), so re-running the same command
  continues it, without replaying it: each draw's seed is derived from its ``seed`` and the
  trials already in the study, a draw that repeats a configuration already tried is not run,
  and a trial a dead driver left running is run again, once, with its own number and parameters
  (continuing from the last.pt in its run dir, where this machine has it);
- any number of drivers can run the same command on one study (a PostgreSQL URL, for drivers on
  several machines): ``n_trials`` counts the whole study, one driver at a time picks trials under
  a lock (study.study_lock), each driver records a heartbeat for its running trials every
  ``heartbeat_s``, and a RUNNING trial whose heartbeat is older than ``grace_s`` is a dead
  driver's, taken over by a live one. Each driver ends when the whole study has, so each
  prints the same report;
- a trial that raises (a diverged or out-of-memory run included) or returns NaN is recorded as
  failed with its error, and the sweep goes on until more than ``max_failure_rate * n_trials``
  trials have failed;
- at the end a report is written to the sweep dir (framework/search/report.py).
"""
from __future__ import annotations

import functools
import logging
import math
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.config import TRIAL_VARIABLES
from framework.errors import ConfigError, SweepError
from framework.private_apis import (distribution_from_config, heartbeat_ages, job_error, parse_sweep_overrides,
                                    trial_by_number, uncached)
from framework.search.slots import BatchSlots, TrialSlots
from framework.search.study import (PURPOSE, STOPPED, Heartbeat, default_storage, failed_trials, finished_trials, misfit,
                                    purpose, rdb_storage, run_trials, running_trials, study_lock, with_lock_timeout)

log = logging.getLogger(__name__)

OOM_MARKERS = ("out of memory", "can't allocate memory")
# hydra.sweeper.direction takes the words of checkpoint.mode and early_stopping.mode (framework/config.py's
# Direction: min, max) as well as Optuna's, which the stock hydra-optuna-sweeper's configs hold. All default
# to auto, the metric's own direction from the objective, so a user sets no direction at all. They stay
# three keys because they may watch different metrics: optimized_metric can differ from checkpoint.monitor,
# or list several.
OPTUNA_DIRECTIONS = {"min": "minimize", "max": "maximize"}
DIRECTIONS = tuple(OPTUNA_DIRECTIONS.values())
# Draws in a row that repeat tried configurations before a random untried one is taken instead.
MAX_DRAWS = 30
# Runs of a trial whose driver died: the first, and one more.
MAX_RUNS = 2
# Seconds between looks at the study while only other drivers' trials run.
POLL_S = 1.0


def describe_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
    return f"out of memory: {text}" if any(m in str(error) for m in OOM_MARKERS) else text


def save_traceback(result: JobReturn) -> None:
    """The failed trial's traceback, in its run dir as error.txt (Hydra keeps only the exception)."""
    if result.hydra_cfg is None:  # the job never started (a Ray worker died)
        return
    error = job_error(result)
    path = Path(result.hydra_cfg.hydra.runtime.output_dir) / "error.txt"
    path.write_text("".join(traceback.format_exception(type(error), error, error.__traceback__)))


def configuration(params: Dict[str, Any]) -> Tuple:
    return tuple(sorted(params.items()))


# A finite space is enumerated to draw an untried configuration only up to this size.
MAX_GRID = 1_000_000


def space_grid(space: Dict[str, Any]) -> Optional[Dict[str, List[Any]]]:
    """Every value of each parameter, where every distribution is discrete and finite (choices, int
    ranges, stepped floats) and the space holds at most MAX_GRID configurations; else None."""
    from optuna.distributions import (CategoricalDistribution, DiscreteUniformDistribution, IntLogUniformDistribution,
                                      IntUniformDistribution)

    grid = {}
    for name, distribution in space.items():
        if isinstance(distribution, CategoricalDistribution):
            grid[name] = list(distribution.choices)
        elif isinstance(distribution, (IntUniformDistribution, IntLogUniformDistribution)):
            grid[name] = list(range(distribution.low, distribution.high + 1, distribution.step))
        elif isinstance(distribution, DiscreteUniformDistribution):
            count = int(round((distribution.high - distribution.low) / distribution.q)) + 1
            grid[name] = [distribution.low + i * distribution.q for i in range(count)]
        else:
            return None
    return grid if math.prod(map(len, grid.values())) <= MAX_GRID else None


def misfit_error(study_name: str, differences: List[str]) -> ConfigError:
    return ConfigError(f"the stored study {study_name!r} was made for another sweep ({'; '.join(differences)}); start a "
                       "new study with another hydra.sweeper.study_name (or study_name=null for a new one every run), "
                       "or sweep as that study was made to continue it.")


def as_list(value: Any) -> List[Any]:
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]


class StudySweeper(Sweeper):
    def __init__(self, sampler: Any, pruner: Any, direction: Any, storage: Optional[str], study_name: Optional[str],
                 n_trials: int, n_jobs: int, max_failure_rate: float, params: Optional[DictConfig],
                 custom_search_space: Optional[str], export_dir: str, search_space: Optional[DictConfig] = None,
                 heartbeat_s: int = 10, grace_s: int = 60) -> None:
        self.sampler, self.pruner = sampler, pruner
        # Stock configs may hold optuna's Direction enum; runlab's hold the strings.
        self.directions = [OPTUNA_DIRECTIONS.get(str(d), str(getattr(d, "name", d))) for d in as_list(direction)]
        self.storage, self.study_name = storage, study_name
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, max(1, n_jobs), max_failure_rate
        self.params, self.custom_search_space, self.export_dir = params, custom_search_space, export_dir
        self.deprecated_space = search_space
        self.heartbeat_s, self.grace_s = heartbeat_s, grace_s

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(config=config, hydra_context=hydra_context,
                                                                task_function=task_function)
        self.sweep_dir = Path(config.hydra.sweep.dir)

    @property
    def runlab_app(self) -> bool:
        """Whether the trials are runs of runlab's run.py (other Hydra apps can use this sweeper too)."""
        return "search" in self.config

    def sweep(self, arguments: List[str]) -> None:
        self.check()
        extend_space = self.space_extension()
        space, fixed = self.search_space(arguments)
        study = self.open_study(space)
        # runlab's launcher plugins hold their implementation (hydra_plugins/runlab_sweeper), which may hand trials back one by one.
        launcher = getattr(self.launcher, "launcher", self.launcher)
        slots = launcher if isinstance(launcher, TrialSlots) else BatchSlots(self.launcher)
        heartbeat = Heartbeat(self.rdb)
        allowed_failures = math.floor(self.max_failure_rate * self.n_trials)
        running: Dict[Any, Any] = {}  # launcher handle -> Optuna trial
        self.exhausted = False
        try:
            while True:
                with study_lock(self.storage, study.study_name):
                    for trial, rerun in self.next_trials(study, space, extend_space, self.n_jobs - len(running), heartbeat):
                        running[slots.submit(self.trial_overrides(trial, fixed, rerun), trial.number)] = trial
                if running:
                    handle, result = slots.next_finished(list(running))
                    trial = running.pop(handle)
                    heartbeat.discard(trial)
                    self.record(study, trial, result)
                elif not running_trials(study):
                    break
                else:  # only other drivers' trials run: the report waits for them (or their drivers' death)
                    time.sleep(POLL_S)
                if len(failed_trials(study)) > allowed_failures:
                    slots.cancel(list(running))
                    self.mark_stopped(list(running.values()), "the sweep stopped on too many failures")
                    self.finish(study)
                    raise SweepError(self.failure_summary(study, allowed_failures))
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM (a trial's Interrupted exits)
            # Marked dead at once: the next driver on the study need not wait grace_s to run them again.
            self.mark_stopped(list(running.values()), "its driver was interrupted")
            raise
        finally:
            heartbeat.close()
        if self.exhausted:
            log.warning("The search space has no untried configuration left (%s); the sweep ends with %d trials.",
                        self.exhaustion, len(finished_trials(study)))
        self.finish(study)

    def next_trials(self, study, space: Dict[str, Any], extend_space: Optional[Callable], slots: int,
                    heartbeat: Heartbeat) -> List[Tuple]:
        """Up to ``slots`` trials to start, each with whether it runs again: first the trials dead drivers
        left running, then new draws while the study (all drivers' trials) has fewer than n_trials.
        Each gets its first heartbeat at once, before the study lock is released."""
        started = []
        # One read of the study: a trial another driver finishes between two reads would count in neither.
        unstarted = self.n_trials - len(run_trials(study))
        for _ in range(slots):
            trial = self.take_over(study, space)
            if trial is not None:
                heartbeat.add(trial)
                started.append((trial, True))
                continue
            if unstarted <= 0 or self.exhausted:
                break
            trial = self.draw(study, space, extend_space)
            if trial is None:
                self.exhausted = True
                break
            heartbeat.add(trial)
            started.append((trial, False))
            unstarted -= 1
        return started

    def finish(self, study) -> None:
        from framework.search.report import write_report

        write_report(study, self.sweep_dir, self.export_dir, experiments=self.runlab_app)

    # --- settings and search space ---------------------------------------------------------

    def check(self) -> None:
        """Refuse settings that cannot work, in one sentence (before any trial starts)."""
        if isinstance(self.sampler, functools.partial):  # GridSampler needs the space up front
            raise ConfigError("hydra/sweeper/sampler=grid is not supported by hydra/sweeper=runlab; use search=grid "
                              "(Hydra's basic sweeper) or hydra/sweeper=optuna.")
        if not 1 <= self.heartbeat_s < self.grace_s:
            raise ConfigError(f"hydra.sweeper.heartbeat_s={self.heartbeat_s} and grace_s={self.grace_s} are invalid; "
                              "use whole seconds, heartbeat_s at least 1 and grace_s longer than it (e.g. 10 and 60).")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise ConfigError(f"hydra.sweeper.max_failure_rate={self.max_failure_rate} is invalid; use a fraction from 0 to 1.")
        if any(direction not in (*DIRECTIONS, "auto") for direction in self.directions):
            raise ConfigError(f"hydra.sweeper.direction={self.directions} is invalid; use auto, max or min (maximize "
                              "or minimize), or a list of them, one per objective.")
        objectives = as_list(self.config.get("optimized_metric")) if "optimized_metric" in self.config else None
        if objectives is not None and len(self.directions) == 1 and len(objectives) > 1 and self.directions == ["auto"]:
            self.directions = self.directions * len(objectives)
        if objectives is not None and len(objectives) != len(self.directions):
            raise ConfigError(f"optimized_metric={objectives} has {len(objectives)} metrics but hydra.sweeper.direction="
                              f"{self.directions} has {len(self.directions)} directions; give one direction per metric.")
        self.directions = self.metric_directions(objectives)
        if self.pruner is not None and (self.storage is None or len(self.directions) > 1 or not self.runlab_app):
            raise ConfigError("a pruner needs a stored study with one objective, which runlab's run.py reports to "
                              "every epoch; drop hydra/sweeper/pruner, or set hydra.sweeper.storage and one direction.")

    def metric_directions(self, objectives: Optional[List[str]]) -> List[str]:
        """hydra.sweeper.direction with auto read as each optimized metric's own direction (the objective
        says whether lower or higher is better); a direction that contradicts it is refused."""
        if not self.runlab_app:
            if "auto" in self.directions:
                raise ConfigError("hydra.sweeper.direction=auto needs runlab's run.py, whose objective knows each "
                                  "metric's direction; give minimize or maximize.")
            return self.directions
        from framework.config import known_metrics

        known = known_metrics(self.config)
        known[f"best/{self.config.checkpoint.monitor}"] = known.get(str(self.config.checkpoint.monitor))
        resolved = []
        for metric, direction in zip(objectives, self.directions):
            wanted = OPTUNA_DIRECTIONS.get(known.get(str(metric)))
            if wanted and direction not in ("auto", wanted):
                raise ConfigError(f"hydra.sweeper.direction={direction} does not fit optimized_metric={metric}, which is "
                                  f"better {'lower' if wanted == 'minimize' else 'higher'}; use auto (or {wanted}).")
            if not wanted and direction == "auto":
                raise ConfigError(f"optimized_metric={metric} is not a metric of this run; choose one of {', '.join(known)}.")
            resolved.append(wanted or direction)
        return resolved

    def space_extension(self) -> Optional[Callable[[DictConfig, Any], None]]:
        """hydra.sweeper.custom_search_space: a function(cfg, trial) that suggests more parameters."""
        if not self.custom_search_space:
            return None
        from hydra.utils import get_method

        try:
            return get_method(self.custom_search_space)
        except Exception as error:
            raise ConfigError(f"hydra.sweeper.custom_search_space={self.custom_search_space!r} cannot be imported "
                              f"({describe_error(error)}); give the dotted path of a function(cfg, trial).") from None

    def search_space(self, arguments: List[str]) -> Tuple[Dict[str, Any], List[str]]:
        """The distributions to draw from, and the overrides every trial gets as they are."""
        params = [f"{key}={value}" for key, value in (self.params or {}).items()]
        parsed = OverridesParser.create().parse_overrides(params + list(arguments))
        # A deletion (~key) is for every trial; Optuna's parser would turn it into key=null.
        deletions = [override.input_line for override in parsed if override.is_delete()]
        space, fixed = parse_sweep_overrides([o.input_line for o in parsed if not o.is_delete()])
        space = {**self.configured_space(), **space}
        for name in fixed:
            space.pop(name, None)
        return space, [*(f"{name}={value}" for name, value in fixed.items()), *deletions]

    def configured_space(self) -> Dict[str, Any]:
        """hydra.sweeper.search_space, the stock sweeper's deprecated form of params, as it treats it."""
        if self.deprecated_space is None:
            return {}
        if self.params is not None:
            warnings.warn("Both hydra.sweeper.params and hydra.sweeper.search_space are configured; "
                          "hydra.sweeper.params defines the search space.")
            return {}
        warnings.warn("hydra.sweeper.search_space is deprecated (Hydra 1.2); write the space as hydra.sweeper.params.")
        return {str(name): distribution_from_config(spec) for name, spec in self.deprecated_space.items()}

    # --- the study ---------------------------------------------------------------------

    def open_study(self, space: Dict[str, Any]):
        import optuna

        from framework.search.trial import route_optuna_logging

        route_optuna_logging()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        self.storage = default_storage(self.sweep_dir) if self.storage == "" else self.storage
        self.storage = self.storage and with_lock_timeout(self.storage)
        with study_lock(self.storage, self.study_name):
            self.rdb = self.storage and rdb_storage(self.storage, self.heartbeat_s, self.grace_s)
            try:
                study = uncached(optuna.create_study(study_name=self.study_name, storage=self.rdb, sampler=self.sampler,
                                                     pruner=self.pruner, directions=self.directions, load_if_exists=True))
            except ValueError as error:  # the stored study has other directions
                raise misfit_error(self.study_name, [f"direction {'/'.join(self.directions)} here: {error}"]) from None
            self.check_fit(study, space)
        # Trials run in their own processes and build the pruner from this attribute.
        pruner_cfg = self.config.hydra.sweeper.pruner
        study.set_user_attr("pruner", OmegaConf.to_container(pruner_cfg, resolve=True) if pruner_cfg else None)
        if self.objectives is not None:  # the report names the objectives' columns after them
            study.set_user_attr("objectives", self.objectives)
        log.info("Study %r in %s: %d of %d trials done, %d running; sampler %s, pruner %s.", study.study_name,
                 self.storage or "memory", len(finished_trials(study)), self.n_trials, len(running_trials(study)),
                 type(study.sampler).__name__, type(self.pruner).__name__ if self.pruner else "none")
        if self.storage is None:
            log.warning("hydra.sweeper.storage is null: the study lives in memory only, so this sweep cannot be "
                        "resumed and its trials cannot report to it; the report is written when it ends.")
        elif self.study_name is None:
            log.warning("hydra.sweeper.study_name is null: this run starts a new study, %r, that the next run of "
                        "the command will not continue; name the study to resume it.", study.study_name)
        return study

    @property
    def objectives(self) -> Optional[List[str]]:
        return [str(name) for name in as_list(self.config.optimized_metric)] if "optimized_metric" in self.config else None

    def check_fit(self, study, space: Dict[str, Any]) -> None:
        """A stored study continues only with the search space, directions and objectives it was made
        for (a raised n_trials just extends it); a new one stores them."""
        wanted = purpose(space, self.custom_search_space, self.objectives)
        differences = misfit(study, wanted, self.directions)
        if differences:
            raise misfit_error(study.study_name, differences)
        if PURPOSE not in study.user_attrs:
            study.set_user_attr(PURPOSE, wanted)

    def seeded_sampler(self, count: int):
        """The sampler for a draw in a study of ``count`` trials, seeded from its seed and that count: a
        resumed study continues with new draws instead of replaying the seed's sequence from its start
        (which repeats the first trials), and drivers sharing a study draw from different sequences."""
        from hydra.utils import instantiate
        import numpy as np

        sampler_cfg = self.config.hydra.sweeper.sampler
        if not count or sampler_cfg.get("seed") is None:
            return self.sampler
        return instantiate(sampler_cfg, seed=int(np.random.SeedSequence([sampler_cfg.seed, count]).generate_state(1)[0]))

    def dead_trials(self, study) -> List:
        """RUNNING trials no live driver runs: stopped by their driver, without a heartbeat (a study of an
        earlier runlab; live drivers record one as they start a trial, under the study lock), or
        with one older than grace_s (the driver was killed, or its machine died), and no live process
        in their run dir on this machine."""
        if self.rdb is None:
            return []  # in memory: only this driver
        from framework.paths import live_run

        ages = heartbeat_ages(study)
        # A run dir still locked by a live process is not dead, whatever its driver: a Ray worker (or
        # a process the dead driver forked) may train on; running it again there would be refused.
        return [t for t in running_trials(study)
                if (t.user_attrs.get(STOPPED) or ages.get(t.number, math.inf) > self.grace_s)
                and not live_run(self.sweep_dir / str(t.number))]

    def take_over(self, study, space: Dict[str, Any]) -> Optional[Any]:
        """A dead driver's trial, to run again once with its own parameters (called under the study lock,
        so that one driver takes it). One killed before its parameters were drawn never ran: it is
        recorded so, and a new draw replaces it; one whose second run died too is failed."""
        from optuna.trial import TrialState

        for frozen in self.dead_trials(study):
            trial = trial_by_number(study, frozen.number)
            runs = frozen.user_attrs.get("runs", 1)
            if not set(space) <= set(frozen.params):
                trial.set_user_attr("interrupted", "before its parameters were drawn")
                study.tell(trial, state=TrialState.FAIL)
            elif runs >= MAX_RUNS:
                self.fail(study, trial, f"its driver stopped during each of its {runs} runs")
            else:
                why = frozen.user_attrs.get(STOPPED) or f"no heartbeat from its driver for over {self.grace_s} s"
                log.warning("Trial %d did not finish (%s); it runs again with its parameters %s.",
                            frozen.number, why, frozen.params)
                trial.set_user_attr(STOPPED, None)
                trial.set_user_attr("runs", runs + 1)
                return trial
        return None

    def draw(self, study, space: Dict[str, Any], extend_space: Optional[Callable]) -> Optional[Any]:
        """A new trial whose configuration no complete, pruned or running trial has; None only when
        none is left: every configuration of a discrete, finite space tried, or, for a space that
        cannot be counted, MAX_DRAWS draws of the sampler and as many random ones all repeating.

        A sampler that keeps proposing tried points (TPE on a small discrete space does) has not used
        the space up: the trial is then a random untried configuration, and the log says so."""
        from optuna.samplers import RandomSampler
        from optuna.trial import TrialState

        tried = {configuration(t.params): t.number for t in run_trials(study) if t.state != TrialState.FAIL}
        grid = None if extend_space else space_grid(space)
        if grid is not None and len(tried) >= math.prod(map(len, grid.values())):
            self.exhaustion = f"all {len(tried)} configurations of the space were tried"
            return None
        for attempt in range(2 * MAX_DRAWS):
            if attempt < MAX_DRAWS:
                study.sampler = self.seeded_sampler(len(study.trials))
            elif grid is not None:
                return self.untried_trial(study, space, grid, tried)
            else:  # a space that cannot be counted (continuous, or extended per trial): random draws
                study.sampler = RandomSampler(seed=len(study.trials))
            trial = study.ask(space)
            if extend_space:
                extend_space(self.config, trial)
            repeated = tried.get(configuration(trial.params))
            if repeated is None:
                if attempt >= MAX_DRAWS:
                    log.info("The sampler proposed only tried configurations %d times in a row; trial %d is a random "
                             "draw instead.", MAX_DRAWS, trial.number)
                return trial
            # Told FAIL and marked, so that it counts for nothing and the report leaves it out.
            trial.set_user_attr("duplicate_of", repeated)
            study.tell(trial, state=TrialState.FAIL)
        self.exhaustion = f"{2 * MAX_DRAWS} draws in a row, half of them random, repeated tried ones"
        return None

    def untried_trial(self, study, space: Dict[str, Any], grid: Dict[str, List[Any]], tried: Dict[Tuple, int]):
        """A trial of a configuration drawn at random among the untried ones of a finite space."""
        import itertools
        import random

        from optuna.exceptions import ExperimentalWarning

        names = sorted(grid)
        untried = [point for point in itertools.product(*(grid[name] for name in names))
                   if tuple(zip(names, point)) not in tried]
        choice = dict(zip(names, random.Random(len(study.trials)).choice(untried)))
        with warnings.catch_warnings():  # "enqueue_trial is experimental" (Optuna 2), for years now
            warnings.simplefilter("ignore", category=ExperimentalWarning)
            study.enqueue_trial(choice)
        trial = study.ask(space)
        log.info("The sampler proposed only tried configurations %d times in a row; trial %d is a random untried one "
                 "instead (%d of the space's %d configurations are untried).", MAX_DRAWS, trial.number, len(untried),
                 math.prod(map(len, grid.values())))
        return trial

    @staticmethod
    def mark_stopped(trials: Sequence, why: str) -> None:
        """The cancelled trials stay RUNNING, marked for the report and as dead for any driver (this sweep
        run again, or another driver on its study), which re-runs them."""
        for trial in trials:
            trial.set_user_attr(STOPPED, why)
            log.warning("Trial %d was stopped (%s); it runs again when the sweep runs again.", trial.number, why)

    def trial_overrides(self, trial, fixed: List[str], rerun: bool) -> List[str]:
        overrides = [*(f"{name}={value}" for name, value in trial.params.items()), *fixed]
        if self.runlab_app and self.storage is not None:
            # The trial finds its study through these (search.*), to report validations and ask whether to stop.
            values = (trial.study.study_name, self.storage, trial.number)
            overrides += [f"hydra.job.env_set.{name}='{value}'" for name, value in zip(TRIAL_VARIABLES, values)]
        if rerun and self.runlab_app:
            overrides.append("resume=auto")  # its own run dir: continue from the last.pt its first run wrote
        return overrides

    # --- results -------------------------------------------------------------------------

    def record(self, study, trial, result: JobReturn) -> None:
        from optuna.trial import TrialState

        if not any(t.number == trial.number for t in running_trials(study)):
            log.warning("Trial %d was taken over by another driver, which found no heartbeat from this one for over "
                        "%d s (raise hydra.sweeper.grace_s); this run's result is dropped.", trial.number, self.grace_s)
            return
        if result.hydra_cfg is not None:  # the report reads the run's config from here
            trial.set_user_attr("run_dir", str(result.hydra_cfg.hydra.runtime.output_dir))
        if result.status == JobStatus.FAILED:
            save_traceback(result)
            return self.fail(study, trial, describe_error(job_error(result)))
        values, problem = self.objective_values(result.return_value)
        if problem:
            return self.fail(study, trial, problem)
        # Written by the trial's own process (trial.py): only an uncached trial reads it from the storage.
        if trial.user_attrs.get("pruned_at_epoch") is not None:
            study.tell(trial, state=TrialState.PRUNED)
            log.info("Trial %d pruned: %s", trial.number, trial.params)
        else:
            study.tell(trial, values)
            log.info("Trial %d finished with %s: %s", trial.number, values if len(values) > 1 else values[0], trial.params)

    def objective_values(self, returned: Any) -> Tuple[List[float], str]:
        """The run's return value as one float per direction, or why it cannot be recorded."""
        try:
            values = [float(value) for value in as_list(returned)]
        except (TypeError, ValueError):
            return [], f"the run returned {returned!r} for its optimized_metric, not a number"
        if len(values) != len(self.directions):
            return [], f"the run returned {len(values)} values for {len(self.directions)} directions"
        if not all(math.isfinite(value) for value in values):
            return [], f"the run returned {returned} for its optimized_metric"
        return values, ""

    @staticmethod
    def fail(study, trial, error: str) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("error", error)
        study.tell(trial, state=TrialState.FAIL)
        log.warning("Trial %d failed: %s", trial.number, error)

    def failure_summary(self, study, allowed: int) -> str:
        failed = failed_trials(study)
        lines = [f"#{t.number}: {t.user_attrs.get('error', '?')}" for t in failed]
        return (f"Stopped the sweep: {len(failed)} of {len(finished_trials(study))} trials failed, more than "
                f"max_failure_rate={self.max_failure_rate} of n_trials={self.n_trials} allows ({allowed}). "
                f"The report is in {self.sweep_dir}. Failures: " + "; ".join(lines))
