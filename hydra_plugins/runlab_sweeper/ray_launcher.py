"""The Launcher plugin class. Its implementation, framework.search.ray_launcher, is imported when
Hydra builds the launcher, not when it discovers the plugin (in every app of the environment)."""
from typing import Any, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher


class RunlabRayLauncher(Launcher):
    def __init__(self, **settings: Any) -> None:
        from framework.search.ray_launcher import ClearRayLauncher

        self.launcher = ClearRayLauncher(**settings)

    def setup(self, **context: Any) -> None:
        self.launcher.setup(**context)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        return self.launcher.launch(job_overrides, initial_job_idx)
