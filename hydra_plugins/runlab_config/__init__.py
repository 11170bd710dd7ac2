"""runlab's config files as Hydra reads them: a YAML syntax error becomes one line.

Hydra reads conf/ (and experiments/, through conf/experiment) with its file config source,
which lets a YAML error escape with a 60-line traceback. ``RunlabSearchPath`` points the
main config dir at ``RunlabConfigSource`` instead: the same files, read the same way, but a
syntax error is a ``ConfigFileError`` naming the file, line and column. On the command line
Hydra prints it as it prints every composition error (one line, exit code 1); from
``framework.run`` it is raised as the ``ConfigError`` it also is.

It also keeps each file it parsed, for as long as the file is unchanged: ``run.py`` composes
twice (Hydra's ``get_mode``, then the run) and a notebook once per ``framework.run``, and
parsing the YAML was about a sixth of each composition. And it keeps Hydra from copying its
ConfigStore on every composition (``share_config_store``).
"""
import copy
import os
from typing import Dict, Optional, Tuple

import yaml
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from hydra.plugins.config_source import ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra._internal.core_plugins.file_config_source import FileConfigSource

from framework.errors import ConfigError


class ConfigFileError(ConfigError, ConfigCompositionException):
    """A config file that is not valid YAML."""


class RunlabConfigSource(FileConfigSource):
    # Each file as last parsed, by its path, with the mtime and size it had. Hydra changes the
    # configs it is given (it removes their defaults lists), so every load hands out a copy.
    parsed: Dict[str, Tuple[Tuple[int, int], ConfigResult]] = {}

    @staticmethod
    def scheme() -> str:
        return "runlab"

    def load_config(self, config_path: str) -> ConfigResult:
        path = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        try:
            stat = os.stat(path)
        except OSError:
            return super().load_config(config_path)  # Hydra's own error for a missing file
        version = (stat.st_mtime_ns, stat.st_size)
        if self.parsed.get(path, (None,))[0] != version:
            try:
                self.parsed[path] = version, super().load_config(config_path)
            except yaml.YAMLError as error:
                raise ConfigFileError(describe(error)) from None
        result = self.parsed[path][1]
        return ConfigResult(config=copy.deepcopy(result.config), path=result.path, provider=result.provider,
                            header=dict(result.header))


def describe(error: yaml.YAMLError) -> str:
    mark: Optional[yaml.Mark] = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return f"a config file is not valid YAML: {problem}."
    return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({problem})."


class RunlabSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for element in search_path.get_path():
            if element.provider == "main" and ("://" not in element.path or element.path.startswith("file://")):
                element.path = f"{RunlabConfigSource.scheme()}://{element.path.removeprefix('file://')}"


def share_config_store() -> None:
    """Make a deep copy of the ConfigStore the store itself.

    Hydra deep-copies its config repository before each composition, and ``run.py --help`` once
    per config group it lists (about 130 times); each copy includes every schema in the
    ConfigStore, 20-60 ms apiece. The copy is never used: the repository's structured source is
    rebuilt from ``ConfigStore.instance()`` when its sources are initialized, and the store hands
    out a copy of each node it loads. Sharing the singleton changes no result.
    """
    ConfigStore.__deepcopy__ = lambda store, memo: store


share_config_store()
