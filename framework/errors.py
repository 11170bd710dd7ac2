"""What can stop a run that the user can act on, and how the process ends when it does.

Every such error is a ``RunlabError``: its message is one sentence for the user, and its
class sets the exit code (the table in docs/config.md). ``exit_with`` is the one place that turns
one into the end of the process: the sentence goes to stderr once and into the run's log
file, with no traceback before it (``HYDRA_FULL_ERROR=1`` re-raises it instead).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable, List, NoReturn

log = logging.getLogger("framework")


class RunlabError(Exception):
    """A failure the user can act on; the message says what happened and what to do."""

    exit_code = 2
    label = "error"
    before_work = False  # raised before the run did any work: it leaves nothing behind

    @property
    def line(self) -> str:
        """The one line the command line prints for it (and a notebook shows)."""
        return f"runlab: {self.label}: {self}"

    @property
    def _render_traceback_(self) -> Callable[[], List[str]]:
        # IPython's hook, called where it exists: a notebook shows the one line instead of a
        # traceback through the framework. HYDRA_FULL_ERROR=1 hides it, and IPython shows its traceback.
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise AttributeError("_render_traceback_")
        return lambda: [self.line]


class ConfigError(RunlabError, ValueError):
    """A config value, input file or output location that cannot work."""

    before_work = True


class CheckpointError(RunlabError, ValueError):
    """A checkpoint that is missing, corrupt, incomplete or not runlab's."""

    before_work = True


class DivergedError(RunlabError):
    """Training produced a non-finite loss, gradient norm or validation metric."""

    exit_code = 3


class ResourceError(RunlabError):
    """The machine ran out of something the run needs: memory at micro-batch 1, or disk space."""

    exit_code = 4


FULL_DISK_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full


def disk_full(error: BaseException, directory: Path) -> bool:
    """Whether a failed write failed for want of space. torch.save reports it as a RuntimeError
    ("unexpected pos"), not ENOSPC, so the free space is read while the partial file still fills it."""
    return getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or out_of_space(directory)


def out_of_space(directory: Path) -> bool:
    try:
        return shutil.disk_usage(directory).free < FULL_DISK_BYTES
    except OSError:
        return False


class SweepError(RunlabError):
    """A sweep stopped before its end (too many failed trials, or its launcher could not start)."""

    exit_code = 5


class Interrupted(RunlabError):
    """SIGINT or SIGTERM: the run stopped where the message says, after saving what it could."""

    label = "interrupted"

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        # The shell's convention for a process ended by a signal: 128 + its number (130, 143).
        self.exit_code = 128 + signum

    def __reduce__(self):  # ddp workers send it to the launcher through a pickle
        return type(self), (self.signum, str(self))


def instantiate(config, **kwargs):
    """``hydra.utils.instantiate``; an error of runlab's that the target raised (a bad data file, say)
    comes out as itself, one line, instead of wrapped in Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(config, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, RunlabError):
            raise error.__cause__ from None
        raise


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


# Every line of the console and train.log, of a plain run, a Python or notebook run and each ddp rank (a
# worker's prefixed with its rank); conf/hydra/default.yaml reads it through the runlab.log_format resolver.
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class RunLogHandler(logging.FileHandler):
    """train.log. A line that cannot be written for want of space is dropped quietly: the run
    stops at its next checkpoint, TensorBoard or metrics.json write with one line, and a
    traceback for each dropped line ("--- Logging error ---") would bury it.

    Hydra opens it in the run dir before it writes the run's config there: on a disk already full
    (a ``hydra.run.dir`` of the user's, or a job started again in its own run dir) that write would
    end in Hydra's traceback, so the run ends here, with its one line, leaving the dir as it was."""

    def __init__(self, filename: str, *args, **kwargs):
        directory = Path(filename).parent
        if out_of_space(directory):
            from framework.paths import shown  # paths imports this module

            with contextlib.suppress(OSError):
                directory.rmdir()  # only if empty: made for this run a moment ago
            full = ResourceError(f"no space left on device to start a run in {shown(directory)}; free some space, "
                                 "then run the command again.")
            exit_with(full)
        super().__init__(filename, *args, **kwargs)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError) and disk_full(error, Path(self.baseFilename).parent):
            return
        super().handleError(record)


def log_to_files(message: str) -> None:
    """Write ``message`` to the log files only (train.log): the console gets it from ``exit_with``."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def exit_with(error: RunlabError) -> NoReturn:
    """End the process on ``error``: one line on stderr (and in train.log), its exit code, no traceback."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    log_to_files(error.line)
    print(error.line, file=sys.stderr, flush=True)
    if error.before_work:
        from framework.paths import discard_new_run_dirs

        discard_new_run_dirs()
    raise SystemExit(error.exit_code) from None


def error_from_exit(exit_code: int, line: str) -> RunlabError:
    """The error a runlab command ended on, from its exit code (negative: the signal that killed it)
    and the ``runlab: LABEL: ...`` line it printed (or what it printed last)."""
    message = line.split(": ", 2)[-1] if line.startswith("runlab: ") else line
    signum = exit_code - 128 if exit_code > 128 else -exit_code
    if signum in signal.valid_signals():
        return Interrupted(signum, message or f"the command was ended by {signal_name(signum)}.")
    kind = {2: ConfigError, 3: DivergedError, 4: ResourceError, 5: SweepError}.get(exit_code, RunlabError)
    error = kind(message)
    error.exit_code = exit_code
    return error
