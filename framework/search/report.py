"""The sweep report, written to the sweep dir when a sweep ends, or on demand:

    python -m framework.search.report SWEEP_DIR [--export-dir experiments]

- ``trials.csv`` and the same table on the terminal: number, state, value (one column per
  objective when there are several), seconds, best epoch, params, error;
- ``optimization_results.yaml``, as hydra-optuna-sweeper writes it (best params and value, or
  the Pareto front's params and values);
- one objective: ``optimization_history.png``, ``parallel_coordinates.png``,
  ``param_importances.png``, and ``experiment/best.yaml``, the best trial as an experiment:
  ``python run.py --config-dir SWEEP_DIR experiment=best`` runs it again;
- several objectives: the Pareto front as a table and ``pareto_front.png``, and
  ``experiment/best_<trial>.yaml`` for each trial on it.

``--export-dir`` (``hydra.sweeper.export_dir``) also copies the experiment files there as
``<study>_best*.yaml``, e.g. into experiments/, so that ``experiment=<study>_best`` runs it.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import OmegaConf

from framework.paths import shown
from framework.search.study import STOPPED, load_sweep_study, run_trials

log = logging.getLogger(__name__)

# Groups that describe where and how a sweep ran, not the trial: left out of best.yaml.
# resume is how a trial continued its own run dir, not part of the configuration.
NOT_EXPORTED = ("hydra", "paths", "search", "launcher", "experiment", "resume")
EXPERIMENT_DIR = "experiment"  # in the sweep dir, as in conf/: python run.py --config-dir SWEEP_DIR experiment=best


def objective_names(study) -> List[str]:
    """The objectives' column names: "value", or the metrics optimized_metric listed."""
    if len(study.directions) == 1:
        return ["value"]
    names = study.user_attrs.get("objectives") or []
    return names if len(names) == len(study.directions) else [f"value{i}" for i in range(len(study.directions))]


def trial_rows(study) -> List[Dict[str, object]]:
    trials = run_trials(study)
    names = sorted({name for trial in trials for name in trial.params})
    objectives = objective_names(study)
    rows = []
    for trial in trials:
        seconds = (trial.datetime_complete - trial.datetime_start).total_seconds() if trial.datetime_complete else None
        row = {"number": trial.number, "state": trial.state.name}
        row.update(zip(objectives, trial.values or [trial.value] * len(objectives)))
        row["seconds"] = None if seconds is None else round(seconds, 1)
        row["best epoch"] = best_epoch(trial)
        row.update({name: trial.params.get(name) for name in names})
        stopped = trial.user_attrs.get(STOPPED)
        row["error"] = trial.user_attrs.get("error") or (f"stopped: {stopped}; it runs again with the sweep" if stopped else "")
        rows.append(row)
    return rows


def best_epoch(trial) -> Optional[int]:
    """The epoch of the trial's best validation, from its run's metrics.json (None before it finished)."""
    metrics = Path(trial.user_attrs.get("run_dir", "")) / "metrics.json"
    return json.loads(metrics.read_text()).get("best_epoch") if metrics.is_file() else None


def best_trial(study):
    """The best complete trial, or None when no trial completed or the study has several objectives."""
    from optuna.trial import TrialState

    if len(study.directions) > 1 or not any(t.state == TrialState.COMPLETE for t in study.trials):
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
    """One line per trial across its params (each axis scaled to its own range, labelled with the
    values at its ends), coloured by the trial's value on the colour bar."""
    import matplotlib.pyplot as plt
    import numpy as np

    values = encoded_params(trials, names)
    low, span = values.min(0), values.max(0) - values.min(0)
    scaled = (values - low) / np.where(span > 0, span, 1)
    scores = np.array([t.value for t in trials])
    norm = plt.Normalize(scores.min(), scores.max())
    figure, axis = plt.subplots(figsize=(max(6, 1.8 * len(names)), 4.5))
    for row, score in zip(scaled, scores):
        axis.plot(range(len(names)), row, color=plt.cm.viridis(norm(score)), alpha=0.8)
    for index, name in enumerate(names):  # each axis's ends, as the values the trials had
        lowest, highest = (trials[int(pick(values[:, index]))] for pick in (np.argmin, np.argmax))
        axis.annotate(cell(lowest.params[name]), (index, 0), textcoords="offset points", xytext=(3, -12), fontsize=8)
        axis.annotate(cell(highest.params[name]), (index, 1), textcoords="offset points", xytext=(3, 4), fontsize=8)
    axis.set_xticks(range(len(names)), names, rotation=20)
    axis.set_yticks([])
    figure.colorbar(plt.cm.ScalarMappable(norm=norm, cmap="viridis"), ax=axis, label="value")
    axis.set_title("Parallel coordinates (each axis from its lowest to its highest value)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def param_importances(trials, names: List[str]) -> Dict[str, float]:
    """A random forest's impurity importances of params for the value (Optuna 2.10's crash on numpy 2)."""
    from sklearn.ensemble import RandomForestRegressor

    forest = RandomForestRegressor(n_estimators=64, random_state=0)
    forest.fit(encoded_params(trials, names), [t.value for t in trials])
    return dict(sorted(zip(names, forest.feature_importances_), key=lambda item: -item[1]))


FEW_TRIALS = 10  # below this, a forest's importances are mostly noise


def plot_importances(importances: Dict[str, float], trials: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 0.5 * len(importances) + 1.5))
    axis.barh(list(importances)[::-1], list(importances.values())[::-1])
    title = f"Parameter importances (random forest, {trials} trials)"
    if trials < FEW_TRIALS:
        title += f"\nfewer than {FEW_TRIALS} trials: read as a rough hint"
    axis.set(xlabel="importance", title=title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def best_experiment(study, best) -> Optional[str]:
    """The trial's own composed config, as an experiment YAML that reproduces it."""
    run_dir = Path(best.user_attrs.get("run_dir", ""))
    config_file, hydra_file = run_dir / ".hydra" / "config.yaml", run_dir / ".hydra" / "hydra.yaml"
    if not config_file.is_file():
        log.warning("Trial %d's run dir %s has no .hydra/config.yaml; no experiment file written for it.",
                    best.number, run_dir)
        return None
    config = OmegaConf.load(config_file)
    choices = OmegaConf.load(hydra_file).hydra.runtime.choices
    groups = [{f"override /{group}": choice} for group, choice in choices.items()
              if group.split("/")[0] not in NOT_EXPORTED and choice is not None]
    body = OmegaConf.to_yaml(OmegaConf.create({"defaults": groups, **{k: v for k, v in config.items() if k not in NOT_EXPORTED}}))
    params = " ".join(f"{k}={v}" for k, v in best.params.items())
    value = best.values if len(best.values or []) > 1 else best.value
    return (f"# @package _global_\n# Trial #{best.number} (value {value}) of study {study.study_name!r}:\n"
            f"# {params}\n# Its run: {run_dir}\n{body}")


def optimization_results(study) -> Optional[Dict[str, object]]:
    """What hydra-optuna-sweeper writes to optimization_results.yaml; None before a trial completed."""
    from optuna.trial import TrialState

    if not any(t.state == TrialState.COMPLETE for t in study.trials):
        return None
    if len(study.directions) == 1:
        best = study.best_trial
        return {"name": "optuna", "best_params": best.params, "best_value": best.value}
    return {"name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in study.best_trials]}


def plot_pareto_front(study, front, path: Path) -> None:
    """Every complete trial and the front, one panel per pair of objectives."""
    import itertools

    import matplotlib.pyplot as plt
    from optuna.trial import TrialState

    names = objective_names(study)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    pairs = list(itertools.combinations(range(len(names)), 2))
    figure, axes = plt.subplots(1, len(pairs), figsize=(5 * len(pairs), 4), squeeze=False)
    for axis, (i, j) in zip(axes[0], pairs):
        axis.scatter([t.values[i] for t in complete], [t.values[j] for t in complete], color="grey", label="trial")
        axis.scatter([t.values[i] for t in front], [t.values[j] for t in front], color="red", label="Pareto front")
        for trial in front:
            axis.annotate(f"#{trial.number}", (trial.values[i], trial.values[j]), fontsize=8)
        axis.set(xlabel=f"{names[i]} ({study.directions[i].name.lower()})",
                 ylabel=f"{names[j]} ({study.directions[j].name.lower()})")
        axis.legend()
    figure.suptitle(f"Pareto front of {study.study_name}")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_single_objective(study, sweep_dir: Path) -> List[str]:
    """The plots of a study with one objective; returns their file names."""
    from optuna.trial import TrialState

    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    plot_history(study, sweep_dir / "optimization_history.png")
    plots = ["optimization_history.png"]
    names = sorted(set.intersection(*(set(t.params) for t in complete)))
    if names:
        plot_parallel_coordinates(complete, names, sweep_dir / "parallel_coordinates.png")
        plots.append("parallel_coordinates.png")
    if names and len(complete) >= 3:
        plot_importances(param_importances(complete, names), len(complete), sweep_dir / "param_importances.png")
        plots.append("param_importances.png")
    return plots


def write_experiments(study, trials: Dict[str, object], sweep_dir: Path, export_dir: str) -> None:
    """Each trial (by file name) as an experiment in SWEEP_DIR/experiment/, and in export_dir if given."""
    for name, trial in trials.items():
        experiment = best_experiment(study, trial)
        if experiment is None:
            continue
        target = sweep_dir / EXPERIMENT_DIR / f"{name}.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(experiment)
        print(f"Trial #{trial.number} as an experiment: python run.py --config-dir {shown(sweep_dir)} experiment={name}",
              flush=True)
        if export_dir:
            exported = Path(export_dir) / f"{study.study_name}_{name}.yaml"
            exported.parent.mkdir(parents=True, exist_ok=True)
            exported.write_text(experiment)
            print(f"  also: python run.py experiment={exported.stem}  ({exported})", flush=True)


def write_report(study, sweep_dir: Path, export_dir: str = "", experiments: bool = True) -> None:
    """The report; ``experiments``: also the best trials as runlab experiments (not for other Hydra apps)."""
    import matplotlib

    matplotlib.use("Agg")

    sweep_dir = Path(sweep_dir)
    rows = trial_rows(study)
    write_table(rows, sweep_dir / "trials.csv")
    print(f"\nTrials of study {study.study_name!r} ({sweep_dir}):\n{format_table(rows)}\n", flush=True)
    results = optimization_results(study)
    if results is None:
        log.warning("No trial completed; the report has only the table.")
        return
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
    if len(study.directions) == 1:
        plots = plot_single_objective(study, sweep_dir)
        print(f"Plots in {shown(sweep_dir)}: {', '.join(plots)}", flush=True)
        best = study.best_trial
        run_dir = best.user_attrs.get("run_dir")
        print(f"Best trial #{best.number}: {best.value} with {best.params}"
              + (f"; its run dir: {shown(Path(run_dir))}" if run_dir else ""), flush=True)
        if experiments:
            write_experiments(study, {"best": best}, sweep_dir, export_dir)
        return
    front = sorted(study.best_trials, key=lambda t: t.number)
    numbers = {t.number for t in front}
    print(f"Pareto front ({len(front)} trials):\n{format_table([r for r in rows if r['number'] in numbers])}\n", flush=True)
    plot_pareto_front(study, front, sweep_dir / "pareto_front.png")
    print(f"Plot in {shown(sweep_dir)}: pareto_front.png", flush=True)
    if experiments:
        write_experiments(study, {f"best_{t.number}": t for t in front}, sweep_dir, export_dir)


def main(argv: Optional[List[str]] = None) -> None:
    from framework.search.study import STUDY_FILE
    from framework.search.summary import summarize

    parser = argparse.ArgumentParser(description="Write the report of a finished or running multirun: a runlab "
                                                 "study's, or any multirun dir's table of jobs.")
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--study", default="", help="the study name, if the sweep dir holds several")
    parser.add_argument("--export-dir", default="", help="also write <study>_best.yaml here (e.g. experiments)")
    args = parser.parse_args(argv)
    if not (args.sweep_dir / STUDY_FILE).is_file():  # a basic sweeper's multirun: no study, a dir per job
        summarize(args.sweep_dir)
        return
    write_report(load_sweep_study(args.sweep_dir, args.study), args.sweep_dir, args.export_dir)


if __name__ == "__main__":
    main()
