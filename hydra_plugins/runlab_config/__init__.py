"""runlab's config sources, for runlab's own app only.

Hydra imports this module in every app of the environment, and calls ``RunlabSearchPath`` for
each. Only where the primary config dir is runlab's conf/ (``run.py``, ``framework.run``) does
it change anything, and then it adds what runlab's app reads:

- ``RunlabConfigSource`` (``runlab://``) reads conf/ (and experiments/, through conf/experiment)
  instead of Hydra's file source: the same files, read the same way, but a YAML syntax error is a
  ``ConfigFileError`` naming the file, line and column, which the command line prints as it prints
  every composition error (one line, exit code 1) and ``framework.run`` raises as the
  ``ConfigError`` it also is. It keeps each file it parsed, for as long as the file is unchanged:
  a sweep composes once per trial, a notebook once per ``framework.run``, and parsing the YAML
  was about a sixth of each composition.
- ``RunlabSchemaSource`` (``runlab-schema://``) holds runlab's typed schemas (framework/config.py),
  which conf/ extends by name (``- /DigitsDataConfig@_here_``). They stay out of Hydra's
  ConfigStore, which every app of the process shares.
- ``SharedConfigStore``: Hydra's copies of the ConfigStore, shared instead (see there).
- ``compose_once``: the composition Hydra makes to read the run mode is the one the run gets.
- ``interpolation_map_when_read``: Hydra's map of group choices, built per config for an
  interpolated default, is built only where a defaults list has one.

Another app sees none of it: no source, no schema, no resolver, and ``framework`` is not imported
(tests/test_neighbour.py). Only in a process that ran runlab's app too do another app's compositions
go through ``compose_once``'s wrapper, which hands them to Hydra unchanged, and skip building a
choices map that nothing reads.

``RunlabConfigSource`` extends ``hydra._internal``'s ``FileConfigSource`` (and uses the protected
``_normalize_file_name`` and ``_list_add_result`` of Hydra's ``ConfigSource``): Hydra offers no public
file source. ``compose_once`` wraps ``hydra._internal``'s ``ConfigLoaderImpl.load_configuration``, and
``interpolation_map_when_read`` its ``defaults_list._create_interpolation_map``. These
are the private APIs that are not in framework/private_apis.py, since this module may not import
``framework``; tests/test_private_apis.py pins them with the others.
"""
import copy
import importlib.util
import os
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra._internal.core_plugins.file_config_source import FileConfigSource


def runlab_conf_dir() -> Optional[str]:
    """conf/ beside the framework package, found without importing it (framework/config.py's CONF_DIR)."""
    spec = importlib.util.find_spec("framework")
    if spec is None or spec.origin is None:
        return None
    return os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))), "conf")


class RunlabSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        main = next((element for element in search_path.get_path() if element.provider == "main"), None)
        path = main.path.removeprefix("file://") if main else "pkg://"
        if "://" in path or os.path.realpath(path) != runlab_conf_dir():
            return  # another app: left as Hydra made it
        main.path = f"{RunlabConfigSource.scheme()}://{path}"
        search_path.append("runlab", f"{RunlabSchemaSource.scheme()}://")
        store = ConfigStore.instance()
        if type(store) is ConfigStore:
            store.__class__ = SharedConfigStore
        compose_once()
        interpolation_map_when_read()


def compose_once() -> None:
    """Hydra composes a command's config twice: ``get_mode`` composes it as for a multirun to read
    ``hydra.mode`` and drops it, then the run (or multirun) composes it again with ``hydra.mode=RUN``
    (or ``MULTIRUN``) added to the overrides where the config set no mode (or set RUN and ``-m`` was
    given): about 0.1-0.15 s each for
    runlab's config. The two differ only where the second refuses what the first let through (a
    sweep without ``-m``, a sweep of Hydra's own keys, a group left ``???``) and in that one
    override. So where nothing is refused, the run is handed the composition ``get_mode`` made,
    with the mode override applied as Hydra applies one; once, since Hydra changes it as it runs.
    Installed only where runlab's app runs, and acting only for loaders of runlab's search path."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    if getattr(ConfigLoaderImpl.load_configuration, "composes_once", False):
        return
    compose = ConfigLoaderImpl.load_configuration

    def load_configuration(self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        kept = self.__dict__.pop("runlab_mode_composition", None)
        if not any(element.provider == "runlab" for element in self.config_search_path.get_path()):
            return compose(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
        if kept is not None:
            (kept_name, kept_overrides, kept_shell), cfg = kept
            added = overrides[len(kept_overrides):]
            if (kept_name, kept_shell, overrides[:len(kept_overrides)]) == (config_name, from_shell, kept_overrides) \
                    and added in ([], [f"hydra.mode={run_mode.name}"]) and same_as_composed(cfg, overrides, run_mode, from_shell):
                return with_overrides(cfg, added)
        cfg = compose(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
        if not validate_sweep_overrides:  # get_mode's call, the only one that skips the sweep check
            self.runlab_mode_composition = (config_name, list(overrides), from_shell), cfg
        return cfg

    load_configuration.composes_once = True
    load_configuration.__wrapped__ = compose  # what inspect.signature reads (tests/test_private_apis.py)
    ConfigLoaderImpl.load_configuration = load_configuration


def interpolation_map_when_read() -> None:
    """For each config of the defaults tree, Hydra builds an OmegaConf map of the group choices made
    so far, which only a default written as an interpolation (``- schema: ${db}``) reads: about a
    quarter of composing runlab's config (25 ms of 98), where no default interpolates. Built only for
    a defaults list that has such an entry, the only one whose children can resolve against it; so
    every composition gives what it gave before, another app's included."""
    from hydra._internal import defaults_list

    build = defaults_list._create_interpolation_map
    if getattr(build, "when_read", False):
        return

    def create_interpolation_map(overrides, defaults, self_added):
        if not any(default.is_interpolation() for default in defaults):
            return None  # _create_defaults_tree_impl reads it only for an interpolated child
        return build(overrides, defaults, self_added)

    create_interpolation_map.when_read = True
    create_interpolation_map.__wrapped__ = build  # what inspect.signature reads (tests/test_private_apis.py)
    defaults_list._create_interpolation_map = create_interpolation_map


def with_overrides(cfg: Any, lines: List[str]) -> Any:
    """``cfg`` with Hydra overrides (``hydra.mode=RUN``) applied and recorded, as Hydra's composition does."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(lines), cfg)
    cfg.hydra.overrides.hydra.extend(lines)
    return cfg


def same_as_composed(cfg: Any, overrides: List[str], run_mode: Any, from_shell: bool) -> bool:
    """Whether composing for ``run_mode`` would give ``cfg``, which was composed as for a multirun
    without the sweep check: Hydra's composition differs by mode only in that check and in that a
    multirun skips a group left ``???``, where a run refuses it."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(overrides)
    if run_mode == RunMode.RUN:
        choices = OmegaConf.to_container(cfg.hydra.runtime.choices)  # a group left ??? reads as "???"
        return not any(o.is_sweep_override() for o in parsed) and "???" not in choices.values()
    try:
        ConfigLoaderImpl.validate_sweep_overrides_legal(parsed, run_mode, from_shell)
    except ConfigCompositionException:
        return False
    return True


class SharedConfigStore(ConfigStore):
    """The ConfigStore of a process that runs runlab's app: a deep copy of it is itself.

    Hydra deep-copies its config repository before each composition, and ``run.py --help`` once per
    config group it lists (about 130 times); each copy includes the whole ConfigStore, about 12 ms
    (1.5 s of --help). The copy is never used: the repository's structured source is rebuilt from
    ``ConfigStore.instance()`` when its sources are initialized, and the store hands out a copy of
    each node it loads. Only this one object changes, and only where runlab's app runs.
    """

    def __deepcopy__(self, memo: Dict[int, Any]) -> "SharedConfigStore":
        return self


class RunlabConfigSource(FileConfigSource):
    # Each file as last parsed, by its path, with the mtime and size it had. Hydra changes the
    # configs it is given (it removes their defaults lists), so every load hands out a copy.
    parsed: Dict[str, Tuple[Tuple[int, int], ConfigResult]] = {}

    @staticmethod
    def scheme() -> str:
        return "runlab"

    def load_config(self, config_path: str) -> ConfigResult:
        import yaml

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
                from hydra_plugins.runlab_config._errors import ConfigFileError

                raise ConfigFileError(describe(error)) from None
        result = self.parsed[path][1]
        return ConfigResult(config=copy.deepcopy(result.config), path=result.path, provider=result.provider,
                            header=dict(result.header))


def describe(error: Any) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return f"a config file is not valid YAML: {problem}."
    return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({problem})."


class RunlabSchemaSource(ConfigSource):
    """runlab's schemas by name (``DigitsDataConfig``), as Hydra's structured source serves the ConfigStore's."""

    # "name.yaml" -> the schema's class, and the schema as a config once a composition asked for it:
    # a run's config extends a third of the schemas, and building one takes a few milliseconds.
    classes: Dict[str, type] = {}
    nodes: Dict[str, Any] = {}

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self.load_schemas()  # Hydra builds its sources anew for each composition: a schema added since is served

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # A job's process (submitit, Ray) gets the config loader pickled, without this class's schemas.
        self.__dict__.update(state)
        self.load_schemas()

    @classmethod
    def load_schemas(cls) -> None:
        from framework.config import schemas

        cls.classes.update((f"{name}.yaml", schema) for name, schema in schemas().items())

    def __deepcopy__(self, memo: Dict[int, Any]) -> "RunlabSchemaSource":
        # Hydra deep-copies its config repository before each composition (run.py --help: once per
        # group it lists); the nodes are never changed (each load hands out a copy), so share them.
        return self

    @staticmethod
    def scheme() -> str:
        return "runlab-schema"

    def load_config(self, config_path: str) -> ConfigResult:
        from omegaconf import OmegaConf

        name = self._normalize_file_name(config_path)
        if name not in self.classes:
            raise ConfigLoadError(f"runlab has no schema {config_path}")
        if name not in self.nodes:
            self.nodes[name] = OmegaConf.structured(self.classes[name])
        return ConfigResult(config=copy.deepcopy(self.nodes[name]), path=f"{self.scheme()}://{self.path}",
                            provider=self.provider, header={"package": None})

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        prefix = config_path.strip("/")
        return prefix == "" or any(name.startswith(f"{prefix}/") for name in self.classes)

    def is_config(self, config_path: str) -> bool:
        return self._normalize_file_name(config_path.rstrip("/")) in self.classes

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        prefix = f"{config_path.strip('/')}/".lstrip("/")
        entries = {name[len(prefix):].split("/")[0] for name in self.classes if name.startswith(prefix)}
        found: List[str] = []
        for entry in entries:
            self._list_add_result(files=found, file_path=f"{prefix}{entry}", file_name=entry, results_filter=results_filter)
        return sorted(set(found))
