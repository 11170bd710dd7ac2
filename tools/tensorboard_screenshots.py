"""Screenshots of TensorBoard as a person first sees it, for a run and for a sweep (a look, not a test).

    python tools/tensorboard_screenshots.py [--out outputs/tensorboard_screenshots] [--epochs 8] [--trials 3]

Trains the default experiment for a few epochs and runs a small random search (both into
OUT/outputs), starts TensorBoard on loopback for each, and saves a headless-Chromium screenshot
of each tab as it opens (TIME SERIES, where TensorBoard lands, then SCALARS, CUSTOM SCALARS,
IMAGES, GRAPHS and HPARAMS) as OUT/<run|sweep>_<tab>.png. Without Chromium (Debian's package:
apt-get install chromium) it says so and takes none.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
TABS = ["timeseries", "scalars", "custom_scalars", "images", "graphs", "hparams"]
# Headless on a machine without a display or network: no GPU, no sandbox (root), no background
# connections (refused here, many at a time), a fresh profile each time.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1440,900"]


def train(out: Path, *overrides: str) -> None:
    subprocess.run([sys.executable, "run.py", f"paths.output_dir={out / 'outputs'}", "trainer.progress_bar=false",
                    *overrides], cwd=REPO, check=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(logdir: Path, log: Path) -> tuple:
    """TensorBoard on loopback for ``logdir``, once it lists the runs; returns (process, url)."""
    port = free_port()
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                                    "--host", "127.0.0.1", "--port", str(port)], stdout=output, stderr=output)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            with urllib.request.urlopen(f"{url}/data/runs", timeout=2) as response:
                if json.load(response):
                    return process, url
        except OSError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError(f"TensorBoard did not list the runs of {logdir} within 60 s; see {log}.")


def screenshot(chromium: str, url: str, path: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        # The virtual time budget lets the page's scripts fetch and draw before the picture is taken.
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                        f"--screenshot={path}", url], check=True, capture_output=True, timeout=120)


def look(chromium: str, logdir: Path, out: Path, prefix: str) -> List[Path]:
    process, url = serve(logdir, out / f"{prefix}_tensorboard.log")
    try:
        shots = []
        for tab in TABS:
            path = out / f"{prefix}_{tab}.png"
            # forceSVG: TensorBoard draws charts as SVG, not WebGL in a worker, whose curves a headless
            # screenshot sometimes catches before they are drawn; what the charts show is the same.
            screenshot(chromium, f"{url}/?forceSVG=true#{tab}", path)
            shots.append(path)
        return shots
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "tensorboard_screenshots")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out / "outputs", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    train(out, f"trainer.max_epochs={args.epochs}")
    train(out, "search=random", f"hydra.sweeper.n_trials={args.trials}", f"trainer.max_epochs={args.epochs}",
          f"hydra.sweeper.export_dir={out}")  # the best trial's YAML stays out of experiments/
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("Chromium is not installed (Debian: apt-get install chromium); no screenshots taken.")
        return
    run_dir = next((out / "outputs" / "train").glob("20*"))
    sweep_dir = out / "outputs" / "train" / "multirun" / "train_random"
    for prefix, logdir in (("run", run_dir), ("sweep", sweep_dir)):
        for path in look(chromium, logdir, out, prefix):
            print(path)


if __name__ == "__main__":
    main()
