"""benchmarks/RESULTS.md is written by the scripts themselves: each script's ``main`` runs inside
``recorded``, which prints as usual and then appends what it printed to RESULTS.md, under the
command that ran, with the date, the commit and the machine. What is written there is what was
measured, never retyped."""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "RESULTS.md"


class Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, terminal) -> None:
        self.terminal, self.copy = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.terminal.flush()


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=BENCHMARKS, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # RESULTS.md itself changes with every recorded run: it does not make the measured code differ.
    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
               if not line.endswith(RESULTS.name)]
    return f"{head}{' with uncommitted changes' if changed else ''}"


def machine() -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), {device}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """Run the body with its output kept, then append it to RESULTS.md (only when it succeeded)."""
    tee = Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    command = shlex.join(["python", os.path.relpath(Path(sys.argv[0]).resolve(), BENCHMARKS.parent), *sys.argv[1:]])
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    section = (f"\n### `{command}`\n\n{stamp}, commit {commit()}; {machine()}.\n\n"
               f"```text\n{tee.copy.getvalue().rstrip()}\n```\n")
    with open(RESULTS, "a") as results:
        results.write(section)
    print(f"(appended to {os.path.relpath(RESULTS)})")
