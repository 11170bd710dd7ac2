"""The Launcher plugin class; the implementation is framework.search.ray_launcher."""
from framework.search.ray_launcher import ClearRayLauncher

from . import config  # noqa: F401  (registers the config schemas)


class RunlabRayLauncher(ClearRayLauncher):
    pass
