"""Cold start: whole processes, from launch to exit.

  import torch           the floor every PyTorch script pays
  hand-written 1 step    a script doing one step's job by hand: read the digits, build the MLP,
                         one AdamW step, validate, save a checkpoint
  Hydra app 1 step       the same script inside the smallest @hydra.main app (one 3-key YAML), writing
                         its checkpoint into Hydra's run dir: the floor of any Hydra app
  ... collector paused   the same app starting as runlab does (framework/startup.py): the cyclic
                         garbage collector off until the job has imported torch, then start-up frozen
  run.py max_steps=1     the same job as runlab runs it by default (TensorBoard, checkpoints, test)
  run.py --help          printing the help: needs no torch
  run.py --cfg job       printing the composed config: needs no torch

Each command runs --repeats times, the commands alternating; medians are printed with the
targets: run.py max_steps=1 at most 0.15 s over the Hydra app, --help and --cfg job at most
0.6 s. Usage: python benchmarks/startup.py [--repeats 5] (benchmarks/step_overhead.py --cold-start
prints the same table).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HAND_WRITTEN = """
import importlib.util, sys
from pathlib import Path
import numpy as np, torch, torch.nn.functional as F
digits = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
table = torch.from_numpy(np.loadtxt(digits, delimiter=",", dtype=np.float32))
x, y = (table[:, :-1] - table[:, :-1].mean()) / table[:, :-1].std(), table[:, -1].long()
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
train, val = order[540:], order[:270]
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as runlab builds it (optimizer.fused)
F.cross_entropy(model(x[train[:64]]), y[train[:64]]).backward()
optimizer.step()
with torch.no_grad():
    print("val acc", (model(x[val]).argmax(1) == y[val]).float().mean().item())
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, Path(sys.argv[1]) / "last.pt")
"""
HYDRA_CONFIG = "lr: 1.0e-3\nbatch_size: 64\nwidth: 256\n"
HYDRA_APP = """
import gc
import hydra
from hydra.core.hydra_config import HydraConfig

PAUSED = %r
if PAUSED:
    gc.disable()


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg):
    import sys
    if PAUSED:  # as runlab's execute: its imports (torch among them) are done by then
        import numpy, torch
        gc.freeze()
        gc.enable()
    sys.argv[1:] = [HydraConfig.get().runtime.output_dir]
    exec(compile(SCRIPT, "hand-written", "exec"), {"__name__": "job"})


SCRIPT = %r
main()
"""


def seconds(command) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def cold_start(repeats: int) -> None:
    """Time each command ``repeats`` times, alternating, and print the medians against the targets."""
    run = [sys.executable, "run.py"]
    with tempfile.TemporaryDirectory() as outputs:
        app = Path(outputs) / "app"
        app.mkdir()
        (app / "config.yaml").write_text(HYDRA_CONFIG)
        (app / "app.py").write_text(HYDRA_APP % (False, HAND_WRITTEN))
        (app / "paused.py").write_text(HYDRA_APP % (True, HAND_WRITTEN))
        commands = {
            "import torch": [sys.executable, "-c", "import torch"],
            "hand-written 1 step": [sys.executable, "-c", HAND_WRITTEN, outputs],
            "Hydra app 1 step": [sys.executable, str(app / "app.py"), f"hydra.run.dir={outputs}/hydra_run"],
            "... collector paused": [sys.executable, str(app / "paused.py"), f"hydra.run.dir={outputs}/paused_run"],
            "run.py max_steps=1": [*run, "trainer.max_steps=1", f"paths.output_dir={outputs}"],
            "run.py --help": [*run, "--help"],
            "run.py --cfg job": [*run, "--cfg", "job"],
        }
        times = {name: [] for name in commands}
        for _ in range(repeats):
            for name, command in commands.items():
                times[name].append(seconds(command))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"cold start, whole processes, median of {repeats}")
    for name, value in median.items():
        print(f"  {name:<20} {value:6.2f} s")
    over = median["run.py max_steps=1"] - median["Hydra app 1 step"]
    print(f"run.py max_steps=1 - Hydra app 1 step = {over:+.2f} s (target <= +0.15 s)")
    paused = median["run.py max_steps=1"] - median["... collector paused"]
    print(f"run.py max_steps=1 - the Hydra app starting as runlab does = {paused:+.2f} s")
    print(f"run.py --help {median['run.py --help']:.2f} s, --cfg job {median['run.py --cfg job']:.2f} s (target <= 0.60 s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    cold_start(parser.parse_args().repeats)


if __name__ == "__main__":
    from results import recorded

    with recorded():
        main()
