"""Start-up cost: `python run.py trainer.max_steps=1` against bare `import torch`.

Also times a hand-written script that builds the same kind of MLP and AdamW and takes one
step: torch.optim's constructors import torch._dynamo (about 1.5 s here), a cost every
PyTorch training script pays, framework or not. Each command runs --repeats times,
alternating; medians are printed. Usage: python benchmarks/startup.py [--repeats 5]
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
import torch, torch.nn.functional as F
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
F.cross_entropy(model(torch.randn(64, 1, 8, 8)), torch.randint(0, 10, (64,))).backward()
optimizer.step()
"""


def seconds(command) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as outputs:
        commands = {
            "import torch": [sys.executable, "-c", "import torch"],
            "hand-written 1 step": [sys.executable, "-c", HAND_WRITTEN],
            "run.py max_steps=1": [sys.executable, "run.py", "trainer.max_steps=1", f"paths.output_dir={outputs}"],
        }
        times = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():
                times[name].append(seconds(command))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, value in median.items():
        print(f"  {name:<20} {value:6.2f} s   +{value - median['import torch']:5.2f} s over import torch")
    print(f"run.py - import torch = {median['run.py max_steps=1'] - median['import torch']:.2f} s (target <= 1.5 s); "
          f"run.py - hand-written = {median['run.py max_steps=1'] - median['hand-written 1 step']:.2f} s")


if __name__ == "__main__":
    main()
