"""The Sweeper plugin class; the implementation is framework.search.sweeper."""
from typing import Any, List

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from . import config  # noqa: F401  (registers the config schemas)


class RunlabSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from framework.search.sweeper import StudySweeper

        self.sweeper = StudySweeper(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> None:
        from framework.errors import RunlabError, exit_with

        try:
            return self.sweeper.sweep(arguments)
        except RunlabError as error:  # Hydra would print it with a traceback
            exit_with(error)
