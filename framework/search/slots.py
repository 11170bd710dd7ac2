"""How the sweeper runs trials: ``n_jobs`` in flight, each handed back as it ends."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher


class TrialSlots:
    """A launcher that runs trials concurrently and hands back each one as it ends
    (framework/search/ray_launcher.py). The sweeper keeps ``n_jobs`` of them in flight."""

    def submit(self, overrides: Sequence[str], number: int) -> Any:
        """Start the trial; returns a handle for next_finished."""
        raise NotImplementedError

    def next_finished(self, handles: List[Any]) -> Tuple[Any, JobReturn]:
        """Block until one of the trials ends; its handle and result."""
        raise NotImplementedError

    def cancel(self, handles: List[Any]) -> None:
        raise NotImplementedError


class BatchSlots(TrialSlots):
    """Any other Hydra launcher (basic, the stock Ray one, ...) through TrialSlots: the trials
    submitted so far run together in one ``launch`` call, as with Hydra's own sweepers, and are
    handed back one by one."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.pending: Dict[int, Sequence[str]] = {}
        self.returned: Dict[int, JobReturn] = {}

    def submit(self, overrides: Sequence[str], number: int) -> int:
        self.pending[number] = overrides
        return number

    def next_finished(self, handles: List[int]) -> Tuple[int, JobReturn]:
        if not self.returned:
            # launch() numbers its jobs from initial_job_idx on, and a job's number names its run dir;
            # trials re-run after a resume break the sequence, so each unbroken run of numbers is one call.
            for numbers in consecutive_runs(sorted(self.pending)):
                returns = self.launcher.launch([self.pending.pop(n) for n in numbers], initial_job_idx=numbers[0])
                self.returned.update(zip(numbers, returns))
        number = min(self.returned)
        return number, self.returned.pop(number)

    def cancel(self, handles: List[int]) -> None:
        for number in handles:
            self.pending.pop(number, None)
            self.returned.pop(number, None)


def consecutive_runs(numbers: List[int]) -> List[List[int]]:
    """[0, 1, 4, 5, 7] -> [[0, 1], [4, 5], [7]]"""
    runs: List[List[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return runs
