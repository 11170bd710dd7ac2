"""Where runs write (conf/paths/, conf/hydra/): one fresh dir per run, and a lock while it lives.

Four resolvers are registered with the config schemas, before Hydra composes anything:

- ``${runlab.cwd:}``: the directory the command was started in. Unlike ``${hydra:runtime.cwd}``
  it also resolves where Hydra has not set its config yet: a multirun driver resolves
  ``hydra.sweep.dir`` before any job starts.
- ``${runlab.new_dir:PATH}``: creates PATH, or ``PATH_1``, ``PATH_2``, ... if it exists, with an
  exclusive ``mkdir``, so two runs started in the same second never share a dir. It is cached
  per config, and Hydra copies that cache into every job of a sweep, so a path is created once.
- ``${runlab.study_dir:BASE,STUDY}``: a named study's sweep dir, ``BASE/STUDY``, so that the same
  command finds its study again; with no name (``study_name: null``, a new study every run) a new
  ``BASE/<date>_<time>`` as ``runlab.new_dir`` makes it.
- ``${runlab.help:}``: the text of ``run.py --help`` (framework/help.py), from conf/config.yaml's comments.

``RunLock`` marks a run dir as live: ``run.lock`` holds the pid and host, under an ``flock``
that the kernel releases when the process ends, however it ends (``kill -9`` included).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import Any, List, Optional, Set

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from framework.errors import LOG_FORMAT, ConfigError, ResourceError, RunlabError, disk_full, exit_with, out_of_space
from framework.help import text as help_text

LOCK_FILE = "run.lock"
RESOLVED_DIRS: List[Path] = []  # run dirs created in this process (runlab.new_dir, framework.run)
PARENTS_MADE: List[Path] = []  # the folders above them that did not exist before, deepest first


def create_run_dir(path: str) -> str:
    """Create ``path`` exclusively, or the first free ``path_N``; returns the one created."""
    base = Path(path)
    try:
        PARENTS_MADE.extend(parent for parent in base.parents if not parent.exists())
        base.parent.mkdir(parents=True, exist_ok=True)
        for suffix in range(1000):
            candidate = base if suffix == 0 else base.with_name(f"{base.name}_{suffix}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            if out_of_space(candidate):  # Hydra writes the run's config into it next, and would end in a traceback
                candidate.rmdir()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return str(candidate)
    except OSError as error:
        raise (ResourceError if error.errno == errno.ENOSPC else ConfigError)(unusable_dir(base, error)) from None
    raise ConfigError(f"cannot create a run dir at {base}: it and 999 suffixed variants exist.")


def new_dir(path: str) -> str:
    """The ``runlab.new_dir`` resolver: Hydra resolves it in its own set-up, where an exception
    would end in a traceback, so a failure ends the process with its one line here. Under torchrun
    every rank is a Hydra app resolving it: the ranks but 0 take a name of their own, so that rank 0
    gets the one a plain run would (the others adopt it, and remove theirs: parallel/distributed.py)."""
    rank = os.environ.get("RANK", "0") if "TORCHELASTIC_RUN_ID" in os.environ else "0"
    if rank != "0":
        path = f"{path}.rank{rank}"
    try:
        return discarded_if_refused(create_run_dir(path))
    except RunlabError as error:
        exit_with(error)


def discarded_if_refused(run_dir: str) -> str:
    """``run_dir``, just created, goes again if the run is refused before any work (discard_new_run_dirs)."""
    RESOLVED_DIRS.append(Path(run_dir))
    return run_dir


# What a run dir holds before the run does any work: Hydra's record of the config, the log, the
# lock and the logger's first (empty) events file.
SET_UP_FILES = {".hydra", "train.log", LOCK_FILE, "tensorboard"}


def discard_new_run_dirs() -> None:
    """A run refused before any work leaves nothing behind: the run dirs this process created go,
    as long as they hold only what the set-up wrote. A dir the user named (``hydra.run.dir``) stays."""
    for path in RESOLVED_DIRS:
        with contextlib.suppress(OSError):
            if all(entry.name in SET_UP_FILES for entry in path.iterdir()):
                shutil.rmtree(path)
    remove_unused_dirs()


@atexit.register
def remove_unused_dirs() -> None:
    """A config file that sets ``hydra.sweep.dir`` (the search presets) replaces the default by a
    merge, and OmegaConf resolves the replaced value while merging: that dir is created too.
    Left empty, it goes when the process ends, and so do the empty folders made above it
    (./outputs/train/multirun/ of a sweep sent elsewhere); rmdir removes nothing else."""
    for path in [*RESOLVED_DIRS, *PARENTS_MADE]:
        with contextlib.suppress(OSError):
            path.rmdir()


def study_dir(base: str, study_name: Optional[str]) -> str:
    return f"{base}/{study_name}" if study_name else new_dir(f"{base}/{datetime.now():%Y-%m-%d_%H-%M-%S}")


def unusable_dir(path: Path, error: OSError, key: str = "paths.output_dir") -> str:
    """What to do about a run dir that cannot be made; ``key``: the setting that chose it."""
    path = shown(path)
    if error.errno == errno.ENAMETOOLONG:
        return (f"the run dir {path} is too long for the file system ({error.strerror}); "
                f"choose a shorter name (or {key}).")
    if error.errno == errno.ENOSPC:
        return f"no space left on device to create the run dir {path}; free some space or choose another {key}."
    return (f"cannot create the run dir {path} ({error.strerror}); "
            f"choose a writable {key}, or fix the permissions of that folder.")


class UsableRunDir(Callback):
    """A hydra.run.dir set by hand (the default goes through runlab.new_dir, which makes it): Hydra makes it
    after this callback, and ends in its own tracebacks when it cannot, so the run ends here in one line."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        path = Path(str(config.hydra.run.dir))
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            kind = ResourceError if error.errno == errno.ENOSPC else ConfigError
            exit_with(kind(unusable_dir(path, error, key="hydra.run.dir")))


def register_resolvers() -> None:
    """Called with the config schemas' registration (framework/config.py), before Hydra composes."""
    if not OmegaConf.has_resolver("runlab.cwd"):
        OmegaConf.register_new_resolver("runlab.cwd", os.getcwd, use_cache=True)
        OmegaConf.register_new_resolver("runlab.new_dir", new_dir, use_cache=True)
        OmegaConf.register_new_resolver("runlab.study_dir", study_dir, use_cache=True)
        OmegaConf.register_new_resolver("runlab.help", lambda *, _root_: help_text(_root_))  # run.py --help (conf/hydra/default.yaml)
        OmegaConf.register_new_resolver("runlab.log_format", lambda: LOG_FORMAT)  # Hydra's job_logging (conf/hydra/default.yaml)


HELD_LOCKS: Set = set()  # the run.lock files this process holds open


def _let_go_in_a_forked_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file, and an flock lasts while
    # any process has it open: killed with kill -9, a run would look live until its orphaned
    # workers noticed and exited. The child closes its copy; the parent's lock is untouched.
    for handle in HELD_LOCKS:
        handle.close()
    HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_let_go_in_a_forked_child)


class RunLock:
    """Held by the process training in ``run_dir``, from set-up to the end of the run."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.handle = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            raise ConfigError(f"{self.path.parent} is in use by another live run ({lock_owner(self.path)}); "
                              "start a new run instead, it gets a dir of its own.") from None
        try:
            self.handle.seek(0)
            self.handle.truncate()
            self.handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            self.handle.flush()
        except OSError as error:
            self.path.unlink(missing_ok=True)  # an empty run.lock would say nothing to anyone
            with contextlib.suppress(OSError):
                self.handle.close()
            if not disk_full(error, self.path.parent):
                raise
            full = ResourceError(f"no space left on device to start the run in {shown(self.path.parent)}; free some "
                                 "space, then run the command again.")
            full.before_work = True
            raise full from None
        HELD_LOCKS.add(self.handle)
        return self

    def __exit__(self, *exc_info) -> None:
        self.path.unlink(missing_ok=True)
        HELD_LOCKS.discard(self.handle)
        self.handle.close()  # closing releases the flock


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it, as a user would type it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def lock_owner(path: Path) -> str:
    try:
        return path.read_text().strip() or "pid unknown"
    except OSError:
        return "pid unknown"


def live_run(run_dir: Path) -> Optional[str]:
    """Who holds ``run_dir``'s lock ("pid N on HOST"), or None when no live process does."""
    path = Path(run_dir) / LOCK_FILE
    try:
        handle = open(path)
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return lock_owner(path)
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None
