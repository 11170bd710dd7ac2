"""The summary every multirun ends with, whatever its sweeper and launcher (``python run.py -m
lr=1e-3,1e-4``, ``search=grid``, ``launcher=ray_local``, ``launcher=slurm``): a table of its jobs
(what each changed, the optimized metric, the best epoch, the status), the best job and its run dir,
printed and written to the sweep dir as ``jobs.csv``. ``MultirunSummary`` is the Hydra callback
conf/hydra/default.yaml registers; ``python -m framework.search.report SWEEP_DIR`` prints it again.

The summary reads what the jobs left in their run dirs: ``.hydra/`` (their overrides and config),
``metrics.json`` (a finished run) or ``error.json`` (a job that ended on a runlab error, which a
multirun records and goes on from; see ``record_failed_job``). runlab's own Optuna sweeper reports
its study instead (framework/search/report.py), so the callback leaves its sweeps alone.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from framework.errors import RunlabError, SweepError, exit_with
from framework.paths import shown

FAILED_JOB_FILE = "error.json"
JOBS_FILE = "jobs.csv"


def record_failed_job(run_dir: Path, error: RunlabError) -> None:
    """What the summary shows for a job that ended on ``error``, in its run dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FAILED_JOB_FILE).write_text(json.dumps({"exit_code": error.exit_code, "error": str(error)}) + "\n")


def job_dirs(sweep_dir: Path) -> List[Path]:
    jobs = [path.parent.parent for path in Path(sweep_dir).glob("*/.hydra/overrides.yaml")]
    return sorted(jobs, key=lambda path: (not path.name.isdigit(), int(path.name) if path.name.isdigit() else 0, path.name))


def metric_of(job: Path) -> Any:
    """The job's optimized_metric: a name, or a list of names."""
    return OmegaConf.select(OmegaConf.load(job / ".hydra" / "config.yaml"), "optimized_metric")


def job_row(job: Path, varied: List[str], metric: str) -> Dict[str, Any]:
    overrides = [str(o) for o in OmegaConf.load(job / ".hydra" / "overrides.yaml")]
    row: Dict[str, Any] = {"job": job.name, "overrides": " ".join(o for o in overrides if o.split("=")[0] in varied)}
    metrics_file, failed_file = job / "metrics.json", job / FAILED_JOB_FILE
    if metrics_file.is_file():
        metrics = json.loads(metrics_file.read_text())
        value = metrics.get(metric)
        row.update({metric: None if value is None else float(value), "best epoch": metrics.get("best_epoch"),
                    "status": "COMPLETE", "error": ""})
    elif failed_file.is_file():
        row.update({metric: None, "best epoch": None, "status": "FAILED", "error": json.loads(failed_file.read_text())["error"]})
    else:  # killed, or still running under another launcher's control
        row.update({metric: None, "best epoch": None, "status": "UNFINISHED", "error": ""})
    row["run dir"] = shown(job)
    return row


def varied_keys(jobs: List[Path]) -> List[str]:
    """The override keys whose values differ between the jobs (all of them when there is one job)."""
    per_job = [dict(str(o).split("=", 1) for o in OmegaConf.load(job / ".hydra" / "overrides.yaml") if "=" in str(o))
               for job in jobs]
    keys = list(dict.fromkeys(key for overrides in per_job for key in overrides))
    varied = [key for key in keys if len({overrides.get(key) for overrides in per_job}) > 1]
    return varied or keys


def clipped(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def best_row(rows: List[Dict[str, Any]], metric: str, direction: Optional[str]) -> Optional[Dict[str, Any]]:
    scored = [row for row in rows if isinstance(row[metric], float) and not math.isnan(row[metric])]
    if not scored or direction is None:
        return None
    return (max if direction == "max" else min)(scored, key=lambda row: row[metric])


def direction_of(job: Path, metric: str) -> Optional[str]:
    from framework.config import known_metrics

    try:
        known = known_metrics(OmegaConf.load(job / ".hydra" / "config.yaml"))
    except Exception:  # noqa: BLE001 - not a runlab training config (another task, another app): no best
        return None
    return known.get(metric.removeprefix("best/"))


def summarize(sweep_dir: Path) -> List[Dict[str, Any]]:
    """Print the jobs' table and the best job, write jobs.csv; returns the rows."""
    from framework.search.report import format_table, write_table

    jobs = job_dirs(sweep_dir)
    if not jobs:
        print(f"\n{shown(sweep_dir)} holds no job of a multirun.", flush=True)
        return []
    metric = metric_of(jobs[0])
    metric = metric if isinstance(metric, str) else "value"
    rows = [job_row(job, varied_keys(jobs), metric) for job in jobs]
    write_table(rows, Path(sweep_dir) / JOBS_FILE)
    # On the terminal the run dir is the sweep dir's job folder, and an error its beginning (the csv has both whole).
    errors = any(row["error"] for row in rows)
    shown_rows = [{**{k: v for k, v in row.items() if k not in ("run dir", "error")},
                   **({"error": clipped(row["error"])} if errors else {})} for row in rows]
    print(f"\nJobs of {shown(sweep_dir)} (also in {JOBS_FILE}):\n{format_table(shown_rows)}", flush=True)
    best = best_row(rows, metric, direction_of(jobs[0], metric))
    if best is not None:
        print(f"Best job #{best['job']}: {metric} {best[metric]:.4g} with {best['overrides'] or 'the defaults'}; "
              f"its run dir: {best['run dir']}", flush=True)
    return rows


class MultirunSummary(Callback):
    """Ends every multirun with its summary; one with failed jobs then ends on one line, with SweepError's code."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if str(config.hydra.sweeper.get("_target_", "")).endswith("RunlabSweeper"):
            return  # its study's report has the trials' table and best trial
        rows = summarize(Path(config.hydra.sweep.dir))
        failed = [row for row in rows if row["status"] == "FAILED"]
        if failed:
            exit_with(SweepError(f"{len(failed)} of {len(rows)} jobs failed; the first, #{failed[0]['job']}: "
                                 f"{failed[0]['error']}"))
