"""runlab's command line starts without the cyclic garbage collector's passes over its imports.

Importing torch, Hydra's plugins and the rest of a run's start-up makes over half a million objects
that live as long as the process. While they are made, the collector walks all of them again
whenever they have grown by a quarter. On this project's 2-core machine (benchmarks/RESULTS.md,
2026-12-07), alternating runs of the command itself: a one-step ``python run.py
trainer.max_steps=1`` took 4.1-4.7 s with it and 3.1-3.5 s without, a 5-step ``parallel=ddp`` run
6.4-7.5 s against 5.3-6.2 s.

So the command line (``framework.entry.cli``, the process's entry point) pauses the collector, and
start-up ends where the task begins (``framework.entry.execute``), or where a sweep begins (its
driver may run no trial itself: Ray, SLURM), or when the command ends (``--help``). There
everything made so far moves into the permanent generation (``gc.freeze``), which later passes
skip, and the collector runs again. A ddp worker, whose imports come while it unpickles its task,
pauses from its first line and freezes once it joined the group. The run's own objects (model,
data, optimizer, Trainer) come after, and are collected as usual. What start-up left as cyclic
garbage (Hydra's intermediate configs: about thirty thousand objects here) stays frozen with the
rest. ``framework.run`` in a notebook leaves the caller's collector alone.
"""
from __future__ import annotations

import gc

# Whether the collector ran before pause_collector, while start-up has not ended; None outside start-up.
_was_enabled = None


def pause_collector() -> None:
    """At the start of a process of runlab's own: the command line, a ddp worker."""
    global _was_enabled
    _was_enabled = gc.isenabled()
    gc.disable()


def freeze_start_up() -> None:
    """Start-up has ended: what exists now is frozen, and the collector runs again if it ran before."""
    global _was_enabled
    if _was_enabled is None:  # never paused (framework.run), or start-up already ended
        return
    gc.freeze()
    if _was_enabled:
        gc.enable()
    _was_enabled = None
