"""A process of runlab's own starts without the cyclic garbage collector's passes over its imports.

Importing torch, Hydra's plugins and the rest of a run's start-up makes over half a million objects
that live as long as the process. While they are made, the collector walks all of them again
whenever they have grown by a quarter. On this project's 2-core machine, in alternating runs, a
one-step ``python run.py trainer.max_steps=1`` took 4.1-4.7 s with it and 3.1-3.5 s without, a
5-step ``parallel=ddp`` run 6.4-7.5 s against 5.3-6.2 s (benchmarks/step_overhead.py --cold-start).

So the command line (``framework.entry.cli``) and each ddp worker pause the collector, and resume it
where the task begins (``framework.entry.execute``; a worker, once it joined the group) after moving
everything made so far into the permanent generation (``gc.freeze``), which later passes skip. The
run's own objects (model, data, optimizer, Trainer) come after, and are collected as usual. What
start-up left as cyclic garbage (Hydra's intermediate configs: about thirty thousand objects here)
stays frozen with the rest. ``framework.run`` in a notebook leaves the caller's collector alone.
"""
from __future__ import annotations

import gc

# Whether this process paused the collector (and its set-up has not resumed it yet).
_paused = [False]


def pause_collector() -> None:
    """At the start of a process of runlab's own: the command line, a ddp worker."""
    _paused[0] = True
    gc.disable()


def resume_collector() -> None:
    """Where a run's set-up begins: what exists now is frozen, and the collector runs again."""
    if _paused[0]:
        _paused[0] = False
        gc.freeze()
        gc.enable()
