"""The Launcher plugin class; the implementation is framework.search.slurm_launcher."""
from framework.search.slurm_launcher import SlurmOrLocalLauncher

from . import config  # noqa: F401  (registers the config schemas)


class RunlabSlurmLauncher(SlurmOrLocalLauncher):
    pass
