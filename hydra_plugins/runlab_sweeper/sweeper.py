"""The Sweeper plugin class; the implementation, framework.search.sweeper, is imported when Hydra builds
the sweeper, not when it discovers the plugin (in every app of the environment)."""
from typing import Any, Dict, List

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


INSTANTIATED = ("sampler", "pruner")  # Hydra built these already


def checked(settings: Dict[str, Any]) -> Dict[str, Any]:
    """The settings, type-checked against RunlabSweeperConf (the config is stored untyped, see
    config.py), with its defaults for the keys deleted with ~ (~hydra.sweeper.params: no space)."""
    from framework.errors import ConfigError
    from hydra_plugins.runlab_sweeper.config import RunlabSweeperConf

    schema = OmegaConf.structured(RunlabSweeperConf)
    try:
        merged = OmegaConf.merge(schema, {key: value for key, value in settings.items() if key not in INSTANTIATED})
    except OmegaConfBaseException as error:
        raise ConfigError(f"hydra.sweeper.{error.full_key}={error.value!r} is invalid: "
                          f"{str(error).splitlines()[0].rstrip('.')}.") from None
    values = {key: merged[key] for key in schema if key not in ("_target_", "defaults", *INSTANTIATED)}
    return {**values, **{key: settings.get(key) for key in INSTANTIATED}}


class RunlabSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from framework.errors import ConfigError, exit_with
        from framework.search.sweeper import StudySweeper

        try:
            self.sweeper = StudySweeper(**checked(settings))
        except ConfigError as error:  # Hydra would print it with a traceback
            exit_with(error)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> None:
        from framework.errors import RunlabError, exit_with

        try:
            return self.sweeper.sweep(arguments)
        except RunlabError as error:  # Hydra would print it with a traceback
            exit_with(error)
