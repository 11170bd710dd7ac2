"""runlab's Hydra plugins: ``hydra/sweeper=runlab``, ``hydra/launcher=runlab_ray`` and ``runlab_slurm``.

Hydra discovers them in the ``hydra_plugins`` namespace package; the code lives in
framework/search/, this package only registers it.
"""
