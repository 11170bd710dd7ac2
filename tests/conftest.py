"""Shared fixtures, in two layers.

- ``train`` composes the real config (conf/ plus experiments/), shrinks it and runs it in
  this process, writing to tmp_path: fast, for the arithmetic of training.
- ``user`` and ``cli`` walk the user's path: a fresh copy of the repository (what a clone
  holds, with the project's .venv), commands typed as a user types them, in a subprocess,
  outputs where a user finds them (``outputs/`` of that copy). No path is overridden.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# Tiny models gain nothing from intra-op threads, and tests that start several processes
# (DDP, sweeps) would oversubscribe the cores; set before torch is imported anywhere.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from framework.entry import compose, run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Small enough for seconds-long runs on 2 cores, still the real code paths.
SHRINK = ["trainer.max_epochs=3", "trainer.progress_bar=false", "model.width=32"]


@pytest.fixture
def train(tmp_path):
    """Train in-process with the real config: ``metrics, run_dir = train("lr=1e-2", ...)``."""
    counter = iter(range(1000))

    def _train(*overrides: str, shrink: bool = True) -> Tuple[Dict[str, float], Path]:
        run_dir = tmp_path / f"run{next(counter)}"
        base = SHRINK if shrink else []
        result = run([*base, f"paths.output_dir={tmp_path / 'outputs'}", *overrides], run_dir=str(run_dir))
        return result.metrics, result.run_dir

    return _train


# The longest files first (seconds of test time in CI): `make test` gives whole files to 2 workers in
# collection order, so a long file collected late would run alone at the end while the other worker waits.
LONGEST_FIRST = ["test_readme.py", "test_search.py", "test_benchmarks.py", "test_faults.py", "test_examples.py", "test_parallel.py",
                 "test_sweep_drivers.py", "test_fsdp.py", "test_compile.py", "test_schedule.py", "test_optuna_compat.py",
                 "test_transfer.py", "test_sweep_scheduling.py", "test_notebook.py", "test_slurm.py",
                 "test_sharded_checkpoints.py", "test_cli.py", "test_troubleshoot.py", "test_training.py"]


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the others, the order stays


# --- the user's path ---------------------------------------------------------------------------

def copy_repository(target: Path) -> Path:
    """The project as a fresh clone has it (the files git tracks, and new ones it does not
    ignore, committed to a git repository of its own), with the environment `make` installed
    linked in as its .venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source, copy = REPO / name, target / name
        if not (source.exists() or source.is_symlink()):
            continue  # deleted in the working tree, not yet in a commit
        copy.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            copy.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, copy)  # keeps mtimes, so `make` sees its install as up to date
    (target / ".venv").symlink_to(Path(sys.prefix))
    git = ["git", "-c", "user.name=runlab tests", "-c", "user.email=tests@runlab.invalid"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the copy"]):
        subprocess.run([*git, *command], cwd=target, check=True, capture_output=True)
    return target


class UserShell:
    """A terminal in a fresh copy of the repository, with .venv/bin on PATH (as after activating it)."""

    def __init__(self, repo: Path):
        self.repo = repo
        self.outputs = repo / "outputs"

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in ("HYDRA_FULL_ERROR", "PYTHONPATH")}
        env["PATH"] = f"{self.repo / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return {**env, **(extra or {})}

    def run(self, command: str, timeout: float = 240, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        """``command`` typed at the prompt; its exit code and output."""
        return subprocess.run(["bash", "-c", command], cwd=self.repo, capture_output=True, text=True, timeout=timeout,
                              env=self.env(env))

    def start(self, command: str, log: Path, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """``command`` started in the background (its own session, so its whole tree can be signalled)."""
        with open(log, "w") as console:
            return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.repo, stdout=console,
                                    stderr=subprocess.STDOUT, env=self.env(env), start_new_session=True)

    def source_changes(self) -> str:
        """What commands changed in the source tree, as `git status` shows it (outputs/ is ignored)."""
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=self.repo,
                              capture_output=True, text=True, check=True).stdout

    def runs(self, name: str = "train") -> List[Path]:
        """The run dirs of ``name``, oldest first."""
        return sorted(p for p in (self.outputs / name).glob("*") if p.is_dir() and p.name != "multirun")


@pytest.fixture(scope="session")
def fresh_copy(tmp_path_factory) -> Path:
    """One fresh copy per test process; each ``user`` gets a duplicate of it, its git repository
    included (cheaper than listing, copying and committing the project again for every test)."""
    return copy_repository(tmp_path_factory.mktemp("fresh") / "runlab")


@pytest.fixture
def user(tmp_path, fresh_copy) -> UserShell:
    return UserShell(Path(shutil.copytree(fresh_copy, tmp_path / "runlab", symlinks=True)))


@pytest.fixture
def source_tree_stays_clean(request):
    """For sweep tests: whatever the test ran, `git status` of its copy shows nothing (no generated
    experiment files, no study files outside outputs/)."""
    user = request.getfixturevalue("user") if "user" in request.fixturenames else None
    yield
    if user is not None:
        changes = user.source_changes()
        assert not changes, f"the commands changed the source tree:\n{changes}"


@pytest.fixture
def cli(user):
    """``cli(*args)`` runs ``python run.py ARGS`` in the user's copy of the repository."""

    def _cli(*args: str, timeout: float = 240, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        return user.run(shlex.join(["python", "run.py", *args]), timeout=timeout, env=env)

    return _cli


def aids_on_path(user: UserShell) -> Dict[str, str]:
    """Lets a run import the testing aids in tests/ (faulty models), as a user's own module would be."""
    return {"PYTHONPATH": str(user.repo / "tests")}


def read_metrics(run_dir: Path) -> Dict[str, float]:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def one_line_error(result: subprocess.CompletedProcess, exit_code: int = 2, label: str = "error") -> str:
    """The single `runlab: LABEL: ...` line a failed command must end with, once, without a traceback."""
    assert result.returncode == exit_code, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if f"runlab: {label}:" in line]
    assert len(lines) == 1, output[-3000:]
    assert result.stderr.rstrip().endswith(lines[0])
    return lines[0]


def composed(*overrides: str):
    return compose(list(overrides))


def write_csv_without_label(path: Path) -> Path:
    path.write_text("a,b,target\n1,2,0\n3,4,1\n")
    return path
