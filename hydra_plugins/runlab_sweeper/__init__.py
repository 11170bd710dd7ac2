"""runlab's Hydra plugins: ``hydra/sweeper=runlab`` and ``hydra/launcher=runlab_ray``.

Hydra discovers them in the ``hydra_plugins`` namespace package; the code lives in
framework/search/, this package only registers it.
"""
