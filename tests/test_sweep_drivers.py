"""Many drivers on one study: the same `python run.py search=tpe ...` started several times at once, on a
sqlite study (one machine, one of them on the Ray launcher) and on a real PostgreSQL server (as on several
machines, one of them killed with kill -9 mid-trial); and the storage created by two drivers at the same
instant."""
from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import optuna
import pytest

from conftest import REPO

pytestmark = pytest.mark.usefixtures("source_tree_stays_clean")

# Seconds-long trials; the drivers notice a dead one after 5 s without its heartbeat.
TINY = ["search=tpe", "trainer.max_epochs=1", "logger=none", "trainer.progress_bar=false", "model.width=32",
        "model.depth=1", "hydra.sweeper.heartbeat_s=1", "hydra.sweeper.grace_s=5"]
STUDY = "shared"


def postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not found:
        if os.environ.get("CI"):  # .ci/run installs it: a CI run never skips for want of it
            pytest.fail("PostgreSQL's server binaries are missing under /usr/lib/postgresql; apt-get install postgresql")
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql)")
    return found[-1].parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Postgres:
    """A throwaway PostgreSQL server on loopback, run by an unprivileged user (it refuses root)."""

    def __init__(self) -> None:
        self.bin, self.port = postgres_bin(), free_port()
        self.root = Path(tempfile.mkdtemp(prefix="runlab-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.as_user: List[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def command(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        self.command(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self.command(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.command(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def new_database(self, name: str) -> str:
        """The URL of a new, empty database."""
        import sqlalchemy

        engine = sqlalchemy.create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text(f'create database "{name}"'))
        engine.dispose()
        return self.url(name)

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    server = Postgres()
    try:
        server.start()
        yield server
    finally:
        server.stop()


def start_drivers(user, count: int, args: List[str], logs: Path) -> List[Tuple[subprocess.Popen, Path]]:
    """``count`` drivers typed at once, each the same command; each with its console's log."""
    logs.mkdir(exist_ok=True)
    command = shlex.join(["python", "run.py", *TINY, *args])
    return [(user.start(command, logs / f"driver{i}.log"), logs / f"driver{i}.log") for i in range(count)]


def finish(drivers: List[Tuple[subprocess.Popen, Path]], timeout: float = 300) -> List[str]:
    """Each driver's output, once every one has exited 0, with no traceback nor ANSI code."""
    deadline = time.monotonic() + timeout
    outputs = []
    for driver, log in drivers:
        driver.wait(timeout=max(1.0, deadline - time.monotonic()))
        output = log.read_text()
        assert driver.returncode == 0, output[-3000:]
        assert "Traceback" not in output and "\x1b[" not in output, output[-3000:]
        assert "database is locked" not in output and "UserWarning" not in output, output[-3000:]
        assert "taken over by another driver" not in output, output[-3000:]  # a live driver's trial, run twice
        outputs.append(output)
    return outputs


def best_line(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith("Best trial #")]
    return line


def trials_run(study) -> List:
    """The trials that ran (not the draws that repeated a tried configuration and never ran)."""
    return [t for t in study.trials if "duplicate_of" not in t.user_attrs]


def check_study(study, sweep: Path, n_trials: int) -> Dict[int, Dict]:
    """n_trials COMPLETE trials, each configuration once, each trial's run dir once; their params."""
    run = trials_run(study)
    assert [t.state.name for t in run] == ["COMPLETE"] * n_trials
    configurations = {tuple(sorted(t.params.items())) for t in run}
    assert len(configurations) == n_trials
    run_dirs = sorted(path.parent.parent for path in sweep.glob("*/.hydra/config.yaml"))
    assert run_dirs == sorted(sweep / str(t.number) for t in run)
    assert sorted(t.user_attrs["run_dir"] for t in run) == [str(path) for path in run_dirs]
    return {t.number: t.params for t in run}


def running_trial_of(driver: subprocess.Popen, sweep: Path) -> int:
    """The trial a driver runs now (its train.log is open in the driver's process), or -1."""
    for fd in Path(f"/proc/{driver.pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = Path(os.readlink(fd))
            if target.name == "train.log" and target.parent.parent == sweep:
                return int(target.parent.name)
    return -1


@pytest.mark.timeout(400)
def test_drivers_on_one_postgresql_study_share_its_n_trials_and_a_killed_drivers_trial_runs_again(user, tmp_path,
                                                                                                   postgres):
    """Four drivers started together on one URL (one start of four drivers checks both): driver 0 is killed
    with kill -9 mid-trial; exactly one of the three left runs its trial again, from its checkpoint, and the
    three share the study's n_trials, each configuration once, each reporting the whole study."""
    url = postgres.new_database("drivers")
    args = ["hydra.sweeper.n_trials=12", f"hydra.sweeper.study_name={STUDY}", f"hydra.sweeper.storage={url}",
            "trainer.max_epochs=3", "early_stopping.enabled=false"]
    drivers = start_drivers(user, 4, args, tmp_path / "logs")
    (killed, killed_log), sweep = drivers[0], user.outputs / "train" / "multirun" / STUDY
    deadline = time.monotonic() + 200
    while True:  # kill -9 driver 0 once its trial has written its first checkpoint
        trial = running_trial_of(killed, sweep)
        if trial >= 0 and (sweep / str(trial) / "checkpoints" / "last.pt").is_file():
            break
        assert killed.poll() is None and time.monotonic() < deadline, killed_log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    before = optuna.load_study(study_name=STUDY, storage=url).trials[trial]
    assert before.state.name == "RUNNING"

    outputs = finish(drivers[1:])
    study = optuna.load_study(study_name=STUDY, storage=url)
    params = check_study(study, sweep, 12)
    assert params[trial] == before.params and study.trials[trial].user_attrs["runs"] == 2
    assert sum(f"Trial {trial} did not finish (no heartbeat" in output for output in outputs) == 1
    assert "Resumed from" in (sweep / str(trial) / "train.log").read_text()  # its last.pt, in its own run dir
    assert len({best_line(output) for output in outputs}) == 1  # each driver's report reads the whole study


ONE_DRIVER_OPENS = """
import sys, time
import optuna
from framework.search.study import rdb_storage, study_lock
start, urls = float(sys.argv[1]), sys.argv[2:]
for round, url in enumerate(urls):  # the other process opens the same URL at the same instant
    time.sleep(max(0.0, start + round / 2 - time.time()))
    with study_lock(url, "race"):  # what each driver does first (StudySweeper.open_study)
        optuna.create_study(study_name="race", storage=rdb_storage(url, 1, 3), load_if_exists=True)
"""


@pytest.mark.timeout(300)
def test_two_drivers_creating_a_new_storage_at_the_same_instant_both_proceed(tmp_path, postgres):
    # 4 rounds a backend: without study_lock, every round of 10 collided (an IntegrityError or OperationalError
    # in one of the two processes), on both backends.
    urls = [url for round in range(4) for url in (f"sqlite:///{tmp_path / f'race{round}.db'}",
                                                   postgres.new_database(f"race{round}"))]
    start = time.time() + 3  # both processes are past their imports by then
    drivers = [subprocess.Popen([sys.executable, "-c", ONE_DRIVER_OPENS, str(start), *urls], cwd=REPO,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for driver in drivers:
        assert driver.wait(timeout=120) == 0, driver.stderr.read()[-3000:]
    for url in urls:
        assert [s.study_name for s in optuna.get_all_study_summaries(url)] == ["race"]


@pytest.mark.timeout(400)
def test_drivers_started_together_on_one_sqlite_study_share_its_n_trials_one_of_them_on_ray(user, tmp_path):
    """Two plain drivers and one on the Ray launcher, started together on the sweep's own study.db, as on one
    machine (one start of drivers for both: plain drivers contending for the study, and Ray's beside them)."""
    args = ["hydra.sweeper.n_trials=12", f"hydra.sweeper.study_name={STUDY}"]
    logs = tmp_path / "logs"
    ray = shlex.join(["python", "run.py", *TINY, *args, "launcher=ray_local", "+hydra.launcher.ray.init.num_cpus=1"])
    drivers = [*start_drivers(user, 2, args, logs), (user.start(ray, logs / "ray.log"), logs / "ray.log")]
    outputs = finish(drivers)
    sweep = user.outputs / "train" / "multirun" / STUDY
    check_study(optuna.load_study(study_name=STUDY, storage=f"sqlite:///{sweep / 'study.db'}"), sweep, 12)
    assert len({best_line(output) for output in outputs}) == 1  # each driver's report reads the whole study
    assert all(" finished with " in output for output in outputs)  # each driver ran trials of the study
