"""Every multirun ends with a table of its jobs and its best job (framework/search/summary.py), whatever
its sweeper: a grid from the command line (docs/search.md's, as typed) included."""
import csv

import yaml

from conftest import read_metrics

QUICK = ["trainer.max_epochs=2", "trainer.progress_bar=false", "logger=csv", "model.width=32"]


def jobs_table(sweep_dir):
    with open(sweep_dir / "jobs.csv", newline="") as handle:
        return list(csv.DictReader(handle))


# docs/search.md's grid from the command line, which tests/test_readme.py leaves to the test below.
DOCS_GRID = "python run.py -m lr=1e-3,1e-4 model.width=64,128 trainer.max_epochs=2"


def test_the_docs_grid_ends_with_its_jobs_and_the_best_one(user, monkeypatch, capsys):
    result = user.run(DOCS_GRID)
    assert result.returncode == 0, result.stderr[-2000:]
    (sweep_dir,) = (user.outputs / "train" / "multirun").iterdir()
    jobs = [str(job) for job in range(4)]
    grid = [(1e-3, 64), (1e-3, 128), (1e-4, 64), (1e-4, 128)]
    for job, (lr, width) in zip(jobs, grid):  # one complete run per combination
        config = yaml.safe_load((sweep_dir / job / ".hydra" / "config.yaml").read_text())
        assert (config["lr"], config["model"]["width"]) == (lr, width)
        assert all((sweep_dir / job / name).is_file() for name in ("metrics.json", "train.log", "checkpoints/last.pt"))
    rows = jobs_table(sweep_dir)
    assert [(row["job"], row["overrides"], row["status"]) for row in rows] == [
        (job, f"lr={lr} model.width={width}", "COMPLETE") for job, (lr, width) in zip(jobs, grid)]
    scores = [float(row["val/acc"]) for row in rows]
    assert scores == [read_metrics(sweep_dir / job)["val/acc"] for job in jobs]
    assert [int(row["best epoch"]) for row in rows] == [read_metrics(sweep_dir / job)["best_epoch"] for job in jobs]
    best = max(range(4), key=scores.__getitem__)
    lines = result.stdout.splitlines()
    assert lines[-1] == (f"Best job #{best}: val/acc {scores[best]:.4g} with {rows[best]['overrides']}; its run dir: "
                         f"{(sweep_dir / str(best)).relative_to(user.repo)}")
    assert lines[-6].split() == ["job", "overrides", "val/acc", "best", "epoch", "status"]
    # The report reads any multirun dir, not only a study's (in-process: test_search.py types
    # python -m framework.search.report on a study's dir).
    from framework.search.report import main as report

    monkeypatch.chdir(user.repo)
    report([str(sweep_dir.relative_to(user.repo))])
    assert capsys.readouterr().out.splitlines()[-1] == lines[-1]


def test_a_failed_job_does_not_end_the_grid_and_the_grid_ends_on_it_in_one_line(cli, user):
    result = cli("-m", "lr=1e6,1e-3", *QUICK, "trainer.max_epochs=1")
    assert result.returncode == 5, result.stderr[-2000:]
    (sweep_dir,) = (user.outputs / "train" / "multirun").iterdir()
    assert read_metrics(sweep_dir / "1")["epoch"] == 1  # the grid went on past the failed job
    rows = jobs_table(sweep_dir)
    assert [row["status"] for row in rows] == ["FAILED", "COMPLETE"]
    assert rows[0]["error"].startswith("training diverged at step")
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "runlab: error: 1 of 2 jobs failed; the first, #0: training diverged at step")
