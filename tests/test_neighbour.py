"""Installing runlab changes nothing for another Hydra app of the same environment.

Hydra imports every plugin module it finds, runlab's included, in every app. A minimal app of
someone else's (one key, written to tmp_path, outside the repository) runs twice:

- with runlab's venv python, as its user would run it where runlab is installed;
- with the same interpreter and packages but without runlab: ``python -S`` and
  ``PYTHONPATH=<the venv's site-packages>``. ``-S`` skips the site module, so no ``.pth`` file is
  read, and runlab's editable install is one (``__editable__.runlab-*.pth`` installs the finder
  that maps ``framework`` and runlab's ``hydra_plugins`` folder): neither can be imported there,
  which the app's own report confirms, while Hydra and the other plugins load as usual.

The two must agree on the app's config sources, its ConfigStore (runlab adds only its plugins'
own configs, hydra/sweeper=runlab and its launchers, which any app may select, as every plugin's)
and its ``--cfg job``; and runlab's app code must not be imported at all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

APP = '''
import importlib.util
import json
import sys

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf


def paths(tree, prefix=""):
    found = []
    for name, node in tree.items():
        found += paths(node, f"{prefix}{name}/") if isinstance(node, dict) else [(prefix + name, node.provider)]
    return found


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    print(json.dumps({
        "sources": [f"{s.provider}={s.schema}://{s.path}" for s in HydraConfig.get().runtime.config_sources],
        "store": sorted(paths(ConfigStore.instance().repo)),
        "store_class": f"{type(ConfigStore.instance()).__module__}.{type(ConfigStore.instance()).__qualname__}",
        "store_deepcopy_patched": "__deepcopy__" in vars(ConfigStore),
        "framework_imported": any(name == "framework" or name.startswith("framework.") for name in sys.modules),
        "runlab_resolvers": [name for name in ("runlab.cwd", "runlab.new_dir", "runlab.study_dir", "runlab.help") if OmegaConf.has_resolver(name)],
        "runlab_installed": importlib.util.find_spec("framework") is not None,
        "search_path_plugins": sorted(plugin.__module__ for plugin in Plugins.instance().discover(SearchPathPlugin)),
        "greeting": cfg.greeting,
    }))


main()
'''

CONFIG = "greeting: hello\nnested:\n  size: 3\n"


def write_app(folder: Path) -> Path:
    (folder / "conf").mkdir(parents=True)
    (folder / "conf" / "config.yaml").write_text(CONFIG)
    (folder / "app.py").write_text(APP)
    return folder / "app.py"


def run(tmp_path: Path, *args: str, with_runlab: bool) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HYDRA"))}
    if with_runlab:
        command = [sys.executable, "app.py", *args]
    else:
        env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
        command = [sys.executable, "-S", "app.py", *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Error importing" not in done.stderr, done.stderr  # a plugin Hydra could not load
    return done.stdout


def report(tmp_path: Path, with_runlab: bool) -> dict:
    return json.loads(run(tmp_path, "hydra.run.dir=out", with_runlab=with_runlab).strip().splitlines()[-1])


def test_another_hydra_app_sees_nothing_of_runlab(tmp_path):
    write_app(tmp_path)
    with_runlab, without = report(tmp_path, with_runlab=True), report(tmp_path, with_runlab=False)

    # The two runs differ in what they should: runlab is installed in one only.
    assert with_runlab["runlab_installed"] and "hydra_plugins.runlab_config" in with_runlab["search_path_plugins"]
    assert not without["runlab_installed"] and "hydra_plugins.runlab_config" not in without["search_path_plugins"]

    assert with_runlab["sources"] == without["sources"] == [
        "hydra=pkg://hydra.conf", f"main=file://{tmp_path / 'conf'}", "schema=structured://"]
    assert not with_runlab["framework_imported"]
    assert with_runlab["runlab_resolvers"] == []
    assert with_runlab["store_class"] == "hydra.core.config_store.ConfigStore"
    assert not with_runlab["store_deepcopy_patched"]

    added = {path for path, _ in with_runlab["store"]} - {path for path, _ in without["store"]}
    assert added == {"hydra/sweeper/runlab.yaml", "hydra/sweeper/pruner/median.yaml",
                     "hydra/sweeper/pruner/successive_halving.yaml", "hydra/sweeper/pruner/hyperband.yaml",
                     "hydra/launcher/runlab_ray.yaml", "hydra/launcher/runlab_slurm.yaml"}
    assert [entry for entry in with_runlab["store"] if entry[0] not in added] == without["store"]
    assert with_runlab["greeting"] == without["greeting"] == "hello"


def test_another_hydra_apps_config_prints_the_same(tmp_path):
    write_app(tmp_path)
    printed = run(tmp_path, "--cfg", "job", with_runlab=True)
    assert printed == run(tmp_path, "--cfg", "job", with_runlab=False)
    assert printed.strip() == CONFIG.strip()
