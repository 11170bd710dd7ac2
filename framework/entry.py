"""Entry points: the Hydra app (``main``) and the Python/notebook calls (``run``, ``sweep``)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Union

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from framework import config
from framework.config import CONF_DIR, metric_value, validate
from framework.errors import (LOG_FORMAT, ConfigError, Interrupted, RunLogHandler, RunlabError, error_from_exit,
                              exit_with)
from framework.paths import create_run_dir, discard_new_run_dirs, discarded_if_refused
from framework.results import RunResult, SweepResult
from framework.search.summary import record_failed_job
from framework.startup import freeze_start_up, pause_collector

log = logging.getLogger("framework")

RUN_SCRIPT = Path(__file__).resolve().parent.parent / "run.py"


def execute(cfg: DictConfig, run_dir: Path) -> Dict[str, float]:
    """Validate, then run the task; the returned metrics are also in run_dir/metrics.json."""
    from framework.tasks import TASKS

    validate(cfg)
    freeze_start_up()  # what start-up made lives as long as the process (framework/startup.py)
    return TASKS[cfg.task](cfg, run_dir)


def main(cfg: DictConfig) -> Optional[float]:
    """The Hydra task function: runs one job and returns ``optimized_metric`` for sweepers."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        metrics = execute(cfg, run_dir)
        return objective(metrics, cfg.optimized_metric) if cfg.task == "train" else None
    except RunlabError as error:
        # Ctrl-C or SIGTERM is meant for the whole multirun. Another error ends this job only: runlab's
        # sweeper records its trial as failed; Hydra's basic sweeper would end the multirun on it, so the
        # job leaves its one line for the multirun's summary instead, which ends on it (search/summary.py).
        if hydra_cfg.mode != RunMode.MULTIRUN or isinstance(error, Interrupted):
            exit_with(error)
        if str(hydra_cfg.sweeper.get("_target_", "")).endswith("RunlabSweeper"):
            raise
        log.error(error.line)
        record_failed_job(run_dir, error)
        return None


HYDRA_RAISES = "HYDRA_FULL_ERROR"


def cli(app: Callable[[], Any]) -> Any:
    """Run the Hydra app ``run.py`` defines. A command line or config file that Hydra cannot compose
    (``trainer.max_epoch=3``, ``model.width=abc``, a misspelt key in an experiment) ends in one line
    and exit 2, as every other mistake does, not in Hydra's several-line report of it.

    Hydra raises, instead of reporting, what fails under ``HYDRA_FULL_ERROR=1``: runlab sets it
    while Hydra composes, and ``HydraReportsAgain`` (the first callback) unsets it once the config
    is composed, so that errors from then on, and the processes a run starts, are as without runlab.
    A user's own ``HYDRA_FULL_ERROR=1`` is left alone, and still shows the whole traceback.

    The process's start-up runs without the cyclic garbage collector's passes (framework/startup.py):
    ``cli`` is the entry point of the process it runs in.
    """
    pause_collector()
    try:
        return with_composition_errors_in_one_line(app)
    finally:  # --help, --cfg job, a refused config: no task began
        freeze_start_up()


def with_composition_errors_in_one_line(app: Callable[[], Any]) -> Any:
    """``app()``, with HYDRA_FULL_ERROR set while Hydra composes: see ``cli``."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    users = os.environ.get(HYDRA_RAISES)
    if users == "1":
        return app()
    os.environ[HYDRA_RAISES] = "1"
    HydraReportsAgain.raising_for_cli = True
    try:
        return app()
    except (HydraException, OmegaConfBaseException) as error:
        if os.environ.pop(HYDRA_RAISES, None) is None:  # raised after composing: Hydra's own report
            raise
        exit_with(ConfigError(composition_error(error)))
    finally:  # where no callback ran (--cfg job, --help), or the user's own value (0)
        HydraReportsAgain.raising_for_cli = False
        os.environ.pop(HYDRA_RAISES, None)
        if users is not None:
            os.environ[HYDRA_RAISES] = users


class HydraReportsAgain(Callback):
    """Called first once Hydra composed runlab's config: see ``cli``. A user's own HYDRA_FULL_ERROR=1
    (``raising_for_cli`` false) stays set."""

    raising_for_cli: ClassVar[bool] = False

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if HydraReportsAgain.raising_for_cli:
            os.environ.pop(HYDRA_RAISES, None)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        freeze_start_up()  # the driver may run no trial itself (Ray, SLURM), and may run for days
        if not HydraReportsAgain.raising_for_cli:
            return
        try:
            compose_each_swept_value(config)
        except (HydraException, OmegaConfBaseException) as error:  # raised, Hydra would only warn of it
            os.environ.pop(HYDRA_RAISES, None)
            exit_with(ConfigError(composition_error(error)))
        os.environ.pop(HYDRA_RAISES, None)


def compose_each_swept_value(config: DictConfig) -> None:
    """Compose each value of each swept key on the command line once, before the sweep makes its dir:
    Hydra composes a job's config only when the job starts, so a key or value it cannot compose
    (``-m trainer.max_epoch=1,2``, ``-m model.width=64,abc``) would end the sweep in Hydra's report,
    leaving an empty sweep dir, instead of ``cli``'s one line. Intervals (a sampler's) and globs
    (group options) are left to the sweep."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    fixed = [override.input_line for override in overrides if not override.is_sweep_override()]
    loader = GlobalHydra.instance().config_loader()
    for swept in overrides:
        if swept.is_discrete_sweep() and swept.value_type != ValueType.GLOB_CHOICE_SWEEP:
            for value in swept.sweep_string_iterator():
                loader.load_sweep_config(config, [*fixed, f"{swept.get_key_element()}={value}"])


def objective(metrics: Dict[str, float], optimized_metric: Any) -> Union[float, List[float]]:
    """The value a sweeper optimizes: the metric optimized_metric names, or one per metric it lists."""
    if isinstance(optimized_metric, str):
        return metric_value(metrics, optimized_metric)
    return [metric_value(metrics, name) for name in optimized_metric]


def compose(overrides: List[str]) -> DictConfig:
    """The same config ``python run.py OVERRIDES`` would build, without starting a Hydra app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except RunlabError:
        raise
    except HydraException as error:
        raise ConfigError(composition_error(error)) from error


def composition_error(error: Exception) -> str:
    """Hydra's message for a config it could not compose (what the command line prints), on one line;
    a value outside a closed set, or a key the selected option does not have, in runlab's words."""
    cause = error.__cause__
    # A mistake in a config file (an experiment YAML) reaches here as Hydra's text alone, without its cause.
    text = str(cause or error)
    key = getattr(cause, "full_key", None) or _named(r"full_key: (\S+)", text)
    closed = re.search(r"Invalid value '(.*)', expected one of \[(.*)\]", text)
    if key and closed:
        return f"{key}={closed[1]!r} is not allowed; choose one of {closed[2]}."
    schema = getattr(cause, "object_type", None) or getattr(config, _named(r"object_type=(\w+)", text) or "", None)
    unknown = isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or re.search(r"Key '.*' not in '", text)
    if key and unknown and dataclasses.is_dataclass(schema):
        keys = field_names(schema)
        # an option's (model=cnn), a block's (trainer), or the top level's
        where = getattr(schema, "option", "") or key.rpartition(".")[0] or "the config"
        return f"{key} is not a key of {where}; " + (f"its keys are: {', '.join(keys)}." if keys else "it has none to set.")
    text = str(error).split("Config search path:")[0]  # where Hydra looked: the same for every run
    if cause:
        text += f" ({str(cause).splitlines()[0]})"
    return " ".join(text.split())


def _named(pattern: str, text: str) -> Optional[str]:
    found = re.search(pattern, text)
    return found[1] if found else None


def field_names(schema: type) -> List[str]:
    return [field.name for field in dataclasses.fields(schema) if field.name != "_target_"]


def resolved_run_config(overrides: List[str]) -> DictConfig:
    """The config ``run(overrides)`` trains with: composed, then resolved without the hydra node."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    cfg = compose(overrides)
    HydraConfig.instance().set_config(cfg)  # so ${hydra:...} interpolations resolve
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.resolve(cfg)
    return cfg


def run(overrides: Optional[List[str]] = None, run_dir: Optional[str] = None) -> RunResult:
    """Train from Python or a notebook: ``framework.run(["lr=1e-3"])`` trains with the config
    ``python run.py lr=1e-3`` would build and returns a ``RunResult`` (metrics, run dir, checkpoints).

    The run writes to ``run_dir`` (default: outputs/<name>/<date>_<time>/) exactly what the command
    line would, including train.log, and prints the same per-epoch lines; a notebook also shows a
    progress bar. A mistake raises the ``RunlabError`` whose ``line`` the command line prints.
    """
    cfg = resolved_run_config(list(overrides or []))
    if run_dir is None:  # a fresh dir, named as the command line names it
        run_dir = discarded_if_refused(create_run_dir(f"{cfg.paths.output_dir}/{cfg.name}/{datetime.now():%Y-%m-%d_%H-%M-%S}"))
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    try:
        with run_logging(path / "train.log"):
            return RunResult.of(execute(cfg, path), path)
    except RunlabError as error:
        if error.before_work:  # as on the command line, a refusal before any work leaves nothing behind
            discard_new_run_dirs()
        raise


@contextlib.contextmanager
def run_logging(log_file: Path) -> Iterator[None]:
    """The run's train.log, and on the console the lines the command line prints there, unless
    something already prints the log (Hydra, pytest, the caller's own logging set-up)."""
    root = logging.getLogger()
    handlers: List[logging.Handler] = [RunLogHandler(log_file)]
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers):
        handlers.append(logging.StreamHandler(sys.stdout))  # a notebook shows stdout as the cell's output
    for handler in handlers:
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()


def sweep(overrides: List[str]) -> SweepResult:
    """Run a search from Python or a notebook: ``framework.sweep(["search=random", "hydra.sweeper.n_trials=3"])``
    runs ``python run.py search=random hydra.sweeper.n_trials=3`` in this directory, shows its output as
    it comes, and returns the trials table (a ``SweepResult``, also holding the best trial's run dir).
    A failed sweep raises the ``RunlabError`` whose ``line`` the command printed.
    """
    from framework.search.study import load_sweep_study

    cfg = compose(list(overrides))
    if not str(cfg.hydra.sweeper.get("_target_", "")).endswith("RunlabSweeper"):
        raise ConfigError("framework.sweep runs the Optuna searches (search=random or search=tpe, or "
                          "hydra/sweeper=runlab); run a grid with python run.py -m instead.")
    if cfg.hydra.sweeper.storage is None:
        raise ConfigError("framework.sweep reads the trials from the study's storage; drop hydra.sweeper.storage=null.")
    sweep_dir = Path(cfg.hydra.sweep.dir)
    run_command([sys.executable, str(RUN_SCRIPT), *overrides])
    return SweepResult.of(load_sweep_study(sweep_dir, cfg.hydra.sweeper.study_name or ""), sweep_dir)


def run_command(command: List[str], env: Optional[Dict[str, str]] = None) -> None:
    """Run a runlab command here (in ``env``, or this process's environment), its output shown as it
    comes; its one error line is raised, not printed."""
    with tempfile.TemporaryFile("w+") as stderr:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                              env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}) as process:
            try:
                for line in process.stdout:
                    sys.stdout.write(line)
            except BaseException:  # an interrupted notebook cell: stop the command as Ctrl-C would
                process.send_signal(signal.SIGINT)
                raise
        stderr.seek(0)
        lines = stderr.read().splitlines()
    errors = [line for line in lines if line.startswith("runlab: ")]
    sys.stderr.write("".join(f"{line}\n" for line in lines if line not in errors))
    if process.returncode:
        raise error_from_exit(process.returncode, errors[-1] if errors else "\n".join(lines[-20:]))
