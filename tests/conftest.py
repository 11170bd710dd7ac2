"""Shared fixtures: compose the real config (conf/ plus experiments/), shrink it, write to tmp_path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

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
        metrics = run([*base, f"paths.output_dir={tmp_path / 'outputs'}", *overrides], run_dir=str(run_dir))
        return metrics, run_dir

    return _train


@pytest.fixture
def cli(tmp_path):
    """Run ``python run.py ARGS`` in a subprocess with outputs under tmp_path."""

    def _cli(*args: str, timeout: float = 240, env: Dict[str, str] | None = None) -> subprocess.CompletedProcess:
        command = [sys.executable, str(REPO / "run.py"), *args, f"paths.output_dir={tmp_path / 'outputs'}"]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})

    return _cli


def read_metrics(run_dir: Path) -> Dict[str, float]:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def composed(*overrides: str):
    return compose(list(overrides))


def write_csv_without_label(path: Path) -> Path:
    path.write_text("a,b,target\n1,2,0\n3,4,1\n")
    return path
