"""The rank-0 progress bar: loss, validation metric and throughput; a widget in a notebook, off
when stderr is not a terminal."""
from __future__ import annotations

import sys
from typing import Mapping

from tqdm.auto import tqdm


class ProgressBar:
    def __init__(self, total_steps: int, enabled: bool, initial: int = 0):
        # disable=None: off when stderr is not a terminal (CI, log files); tqdm.auto draws a widget in a notebook.
        self.bar = tqdm(total=total_steps, initial=initial, disable=None if enabled else True,
                        unit="step", dynamic_ncols=True, file=sys.stderr, leave=False)

    def advance(self) -> None:
        self.bar.update()

    def show(self, values: Mapping[str, float]) -> None:
        if not self.bar.disable:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)

    def close(self, finished: bool = False) -> None:
        if finished:  # an early stop is a normal end: a notebook's bar would turn red short of its total
            self.bar.total = self.bar.n
        self.bar.close()
