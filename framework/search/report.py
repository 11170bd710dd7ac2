"""The sweep report, written to the sweep dir when a sweep ends, or on demand:

    python -m framework.search.report SWEEP_DIR [--export-dir experiments]

- ``trials.csv`` and the same table on the terminal: number, state, value, seconds, params, error;
- ``optimization_history.png``, ``parallel_coordinates.png``, ``param_importances.png``;
- ``best.yaml``: the best trial as an experiment (also copied to ``--export-dir`` as
  ``<study>_best.yaml``, so ``python run.py experiment=<study>_best`` runs it again).
"""
from __future__ import annotations

import argparse
import csv
import logging
import math
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import OmegaConf

from framework.search.study import load_sweep_study

log = logging.getLogger(__name__)

# Groups that describe where and how a sweep ran, not the trial: left out of best.yaml.
NOT_EXPORTED = ("hydra", "paths", "search", "launcher", "experiment")


def trial_rows(study) -> List[Dict[str, object]]:
    names = sorted({name for trial in study.trials for name in trial.params})
    rows = []
    for trial in study.trials:
        seconds = (trial.datetime_complete - trial.datetime_start).total_seconds() if trial.datetime_complete else None
        row = {"number": trial.number, "state": trial.state.name, "value": trial.value,
               "seconds": None if seconds is None else round(seconds, 1)}
        row.update({name: trial.params.get(name) for name in names})
        row["error"] = trial.user_attrs.get("error", "")
        rows.append(row)
    return rows


def best_trial(study):
    """The best complete trial, or None when no trial completed."""
    from optuna.trial import TrialState

    if not any(t.state == TrialState.COMPLETE for t in study.trials):
        return None
    return study.best_trial


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def format_table(rows: List[Dict[str, object]]) -> str:
    if not rows:
        return "(no trials)"
    columns = list(rows[0])
    cells = [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def write_table(rows: List[Dict[str, object]], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["number"])
        writer.writeheader()
        writer.writerows(rows)


def encoded_params(trials, names: List[str]):
    """Trial params as numbers: log-scaled where the space is, categories by their index."""
    import numpy as np
    from optuna.distributions import CategoricalDistribution

    columns = []
    for name in names:
        distribution = trials[0].distributions[name]
        if isinstance(distribution, CategoricalDistribution):
            column = [distribution.choices.index(t.params[name]) for t in trials]
        else:
            log_scale = getattr(distribution, "log", False) or "Log" in type(distribution).__name__
            column = [math.log10(t.params[name]) if log_scale else t.params[name] for t in trials]
        columns.append(column)
    return np.array(columns, dtype=float).T


def plot_history(study, path: Path) -> None:
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState

    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED and t.value is not None]
    maximize = study.direction.name == "MAXIMIZE"
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.scatter([t.number for t in complete], [t.value for t in complete], label="complete")
    axis.scatter([t.number for t in pruned], [t.value for t in pruned], color="grey", marker="x", label="pruned (last value)")
    best, best_so_far = None, []
    for trial in complete:
        best = trial.value if best is None else (max if maximize else min)(best, trial.value)
        best_so_far.append(best)
    axis.step([t.number for t in complete], best_so_far, where="post", color="red", label="best so far")
    axis.set(xlabel="trial", ylabel="value", title=f"Optimization history of {study.study_name}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_parallel_coordinates(trials, names: List[str], path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    values = encoded_params(trials, names)
    span = values.max(0) - values.min(0)
    scaled = (values - values.min(0)) / np.where(span > 0, span, 1)
    scores = np.array([t.value for t in trials])
    colors = plt.cm.viridis((scores - scores.min()) / ((scores.max() - scores.min()) or 1))
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    for row, color in zip(scaled, colors):
        axis.plot(range(len(names)), row, color=color, alpha=0.8)
    axis.set_xticks(range(len(names)), names, rotation=20)
    axis.set_yticks([0, 1], ["low", "high"])
    axis.set_title("Parallel coordinates (colour: value, yellow is higher)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def param_importances(trials, names: List[str]) -> Dict[str, float]:
    """A random forest's impurity importances of params for the value (Optuna 2.10's crash on numpy 2)."""
    from sklearn.ensemble import RandomForestRegressor

    forest = RandomForestRegressor(n_estimators=64, random_state=0)
    forest.fit(encoded_params(trials, names), [t.value for t in trials])
    return dict(sorted(zip(names, forest.feature_importances_), key=lambda item: -item[1]))


def plot_importances(importances: Dict[str, float], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 0.5 * len(importances) + 1.5))
    axis.barh(list(importances)[::-1], list(importances.values())[::-1])
    axis.set(xlabel="importance", title="Parameter importances (random forest)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def best_experiment(study, best) -> Optional[str]:
    """The best trial's own composed config, as an experiment YAML that reproduces it."""
    run_dir = Path(best.user_attrs.get("run_dir", ""))
    config_file, hydra_file = run_dir / ".hydra" / "config.yaml", run_dir / ".hydra" / "hydra.yaml"
    if not config_file.is_file():
        log.warning("The best trial's run dir %s has no .hydra/config.yaml; no best.yaml written.", run_dir)
        return None
    config = OmegaConf.load(config_file)
    choices = OmegaConf.load(hydra_file).hydra.runtime.choices
    groups = [{f"override /{group}": choice} for group, choice in choices.items()
              if group.split("/")[0] not in NOT_EXPORTED and choice is not None]
    body = OmegaConf.to_yaml(OmegaConf.create({"defaults": groups, **{k: v for k, v in config.items() if k not in NOT_EXPORTED}}))
    params = " ".join(f"{k}={v}" for k, v in best.params.items())
    return (f"# @package _global_\n# The best trial (#{best.number}, value {best.value}) of study {study.study_name!r}:\n"
            f"# {params}\n# Its run: {run_dir}\n{body}")


def write_report(study, sweep_dir: Path, export_dir: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    from optuna.trial import TrialState

    sweep_dir = Path(sweep_dir)
    rows = trial_rows(study)
    write_table(rows, sweep_dir / "trials.csv")
    print(f"\nTrials of study {study.study_name!r} ({sweep_dir}):\n{format_table(rows)}\n", flush=True)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if not complete:
        log.warning("No trial completed; the report has only the table.")
        return
    plot_history(study, sweep_dir / "optimization_history.png")
    names = sorted(set.intersection(*(set(t.params) for t in complete)))
    if names:
        plot_parallel_coordinates(complete, names, sweep_dir / "parallel_coordinates.png")
    if names and len(complete) >= 3:
        plot_importances(param_importances(complete, names), sweep_dir / "param_importances.png")
    best = study.best_trial
    experiment = best_experiment(study, best)
    if experiment is None:
        return
    (sweep_dir / "best.yaml").write_text(experiment)
    print(f"Best trial #{best.number}: {best.value} with {best.params}", flush=True)
    if export_dir:
        target = Path(export_dir) / f"{study.study_name}_best.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(experiment)
        print(f"Run it again with: python run.py experiment={target.stem}  ({target})", flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Write the report of a finished or running runlab sweep.")
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--study", default="", help="the study name, if the sweep dir holds several")
    parser.add_argument("--export-dir", default="", help="also write <study>_best.yaml here (e.g. experiments)")
    args = parser.parse_args(argv)
    write_report(load_sweep_study(args.sweep_dir, args.study), args.sweep_dir, args.export_dir)


if __name__ == "__main__":
    main()
