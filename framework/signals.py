"""SIGINT and SIGTERM during a training run: stop cleanly at a step boundary, not mid-write.

While the training loop runs, a signal only sets a request; the loop honours it after the
current step (under ddp, all ranks at the same step: ``Environment.agree``), writes
``last.pt`` and raises ``Interrupted``, so ``resume=auto`` continues exactly where it
stopped. Outside the loop (set-up, the final test), or on a second signal, ``Interrupted``
is raised at once. Only the main thread can own signal handlers; elsewhere (a notebook's
worker thread) signals keep their default behaviour.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional

from framework.errors import Interrupted, signal_name

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.deferring = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        if self.deferring and self.signum is None:
            self.signum = signum
            return
        raise Interrupted(signum, f"stopped by {signal_name(signum)} outside the training steps (set-up or the "
                                  "final test); the checkpoints written so far are kept.")

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Own SIGINT and SIGTERM for the duration (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals only set the request while the loop runs; the loop decides where to stop."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
