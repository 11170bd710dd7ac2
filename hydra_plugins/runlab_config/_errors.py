"""Imported on the first YAML error only: Hydra skips a plugin module whose name starts with _,
so no app imports framework by discovering runlab's plugins."""
from hydra.errors import ConfigCompositionException

from framework.errors import ConfigError


class ConfigFileError(ConfigError, ConfigCompositionException):
    """A config file that is not valid YAML."""
