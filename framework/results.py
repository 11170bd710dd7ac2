"""What ``framework.run`` and ``framework.sweep`` return: the numbers, and where the files are."""
from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

Row = Dict[str, Any]


@dataclass(frozen=True, eq=False)
class RunResult(Mapping):
    """A finished run: its final metrics (``result["val/acc"]`` reads them as the dict did), its run
    dir, and its best and last checkpoints (None when not written)."""

    metrics: Dict[str, float]
    run_dir: Path
    best_checkpoint: Optional[Path]
    last_checkpoint: Optional[Path]

    @classmethod
    def of(cls, metrics: Dict[str, float], run_dir: Path) -> "RunResult":
        from framework.checkpoint import written_checkpoint

        return cls(metrics, run_dir, written_checkpoint(run_dir, "best"), written_checkpoint(run_dir, "last"))

    def __getitem__(self, name: str) -> float:
        return self.metrics[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={self.metrics[name]:.4g}" for name in ("val/acc", "val/loss", "test/acc")
                          if isinstance(self.metrics.get(name), float))
        return f"RunResult({shown}, run_dir={str(self.run_dir)!r}, best_checkpoint={_str(self.best_checkpoint)})"


@dataclass(frozen=True, eq=False)
class SweepResult(Sequence):
    """A finished sweep: its trials table (one dict per trial, as in trials.csv; ``result[0]``,
    ``len(result)``), its sweep dir, and the best trial's run dir and checkpoint."""

    rows: List[Row]
    sweep_dir: Path
    best_run_dir: Optional[Path]

    @classmethod
    def of(cls, study, sweep_dir: Path) -> "SweepResult":
        from framework.search.report import best_trial, trial_rows

        best = best_trial(study)
        return cls(trial_rows(study), Path(sweep_dir), Path(best.user_attrs["run_dir"]) if best else None)

    @property
    def best_checkpoint(self) -> Optional[Path]:
        from framework.checkpoint import written_checkpoint

        return written_checkpoint(self.best_run_dir, "best") if self.best_run_dir else None

    def __getitem__(self, index):
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        from framework.search.report import format_table

        return format_table(self.rows)

    def __repr__(self) -> str:
        return f"SweepResult({len(self.rows)} trials, sweep_dir={str(self.sweep_dir)!r}, best_run_dir={_str(self.best_run_dir)})"

    def _repr_html_(self) -> str:
        """The trials table, as a notebook shows it."""
        from framework.search.report import cell

        columns = list(self.rows[0]) if self.rows else ["number"]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(row[c]))}</td>" for c in columns) + "</tr>"
                       for row in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><p>{html.escape(str(self.sweep_dir))}</p>"


def _str(path: Optional[Path]) -> str:
    return repr(str(path)) if path else "None"
