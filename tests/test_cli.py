"""The command line as a user types it: help, config printing, sweeps and one-line errors."""
import gc
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import aids_on_path, one_line_error, write_csv_without_label
from docs_pages import typed_as_shown
from framework.config import CONF_DIR
from framework.entry import HydraReportsAgain, cli as cli_entry, run
from framework.errors import CheckpointError, ConfigError

QUICK = ["trainer.max_steps=2", "trainer.progress_bar=false", "logger=none", "model.width=16"]


def test_help_lists_the_config_groups(cli):
    result = cli("--help")
    assert result.returncode == 0
    for group in ("data:", "model:", "optimizer:", "parallel:", "logger:", "experiment:"):
        assert group in result.stdout, group
    assert "digits_cnn" in result.stdout


def test_cfg_job_prints_the_resolved_config(cli):
    result = cli("--cfg", "job", "--resolve", "lr=0.005", "experiment=digits_cnn")
    assert result.returncode == 0
    assert "lr: 0.005" in result.stdout and "framework.model.CNN" in result.stdout and "name: digits_cnn" in result.stdout


def imported_by(result) -> set:
    assert result.returncode == 0, result.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", ["--help", "--cfg job"])
def test_printing_help_or_the_config_imports_no_torch(user, args):
    # Both answer in a fraction of a second only while they leave these unimported.
    imported = imported_by(user.run(f"python -X importtime run.py {args}"))
    assert "hydra" in imported and not imported & {"torch", "tensorboard", "optuna", "ray"}


def test_a_default_run_imports_neither_torchmetrics_nor_torchvision(user):
    # torchmetrics imports torchvision, torch._dynamo, scipy.signal and matplotlib: about 2.8 s of every start.
    imported = imported_by(user.run("python -X importtime run.py trainer.max_steps=1 trainer.progress_bar=false"))
    assert "torch" in imported and not imported & {"torchmetrics", "torchvision", "scipy.signal", "matplotlib"}


# docs/config.md's refused value, which tests/test_readme.py leaves to the test below.
DOCS_REFUSED = """$ python run.py lr=-1
runlab: error: lr=-1.0 is invalid; the learning rate must be a positive number.
$ echo $?
2"""


def test_a_bad_value_stops_with_one_line_and_exit_code_2(user):
    (typed,) = typed_as_shown(user, DOCS_REFUSED, "docs/config.md")
    line = one_line_error(typed)
    assert "lr=-1.0 is invalid" in line and "positive" in line


def test_the_command_line_leaves_hydra_full_error_as_it_found_it(monkeypatch):
    # As after --cfg job or --help, where no callback hands reporting back to Hydra. (cli is a process's entry
    # point: here it leaves pytest's garbage collector alone, test_a_run_from_python_... checks why.)
    monkeypatch.setattr("framework.entry.pause_collector", lambda: None)
    seen = []
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    cli_entry(lambda: seen.append(os.environ.get("HYDRA_FULL_ERROR")))
    assert seen == ["1"] and "HYDRA_FULL_ERROR" not in os.environ
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    cli_entry(lambda: None)
    assert os.environ["HYDRA_FULL_ERROR"] == "0"
    # A user's own 1 stays set for the whole run: the first callback hands back only what runlab set.
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    cli_entry(lambda: HydraReportsAgain().on_run_start(None) or seen.append(os.environ.get("HYDRA_FULL_ERROR")))
    assert seen[-1] == "1"


def test_a_corrupt_checkpoint_stops_with_one_line(cli, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    line = one_line_error(cli(f"resume={bad}", *QUICK))
    assert "is not a checkpoint file: it is a text file (it starts with 'garbage')" in line


def test_a_command_line_hydra_cannot_compose_ends_in_one_line_before_any_work(user, cli):
    # (A misspelt key in an experiment: test_schemas.py; a YAML syntax error: test_faults.py.)
    typed = {("trainer.max_epoch=3",): "trainer.max_epoch is not a key of trainer; its keys are: max_epochs, max_steps,",
             ("modle=mlp",): "modle is not a key of the config; its keys are: task, name, seed, lr,",
             ("model.width=abc",): "model.width=abc (Value 'abc' of type 'str' could not be converted to Integer)",
             ("model=transformer",): "Could not find 'model/transformer' Available options in 'model': char_lm cnn",
             ("-m", "trainer.max_epoch=3", "lr=1e-3,1e-2"): "trainer.max_epoch is not a key of trainer;",
             # A swept value, composed only by the job that takes it: checked before the sweep makes its dir.
             ("-m", "model.width=64,abc"): "model.width=abc (Value 'abc' of type 'str' could not be converted to Integer)"}
    for args, message in typed.items():
        result = cli(*args)
        assert result.stderr.strip() == one_line_error(result) and message in result.stderr, (args, result.stderr)
    assert not user.outputs.exists()
    # A user's own HYDRA_FULL_ERROR=1 still gets Hydra's whole traceback.
    result = cli("trainer.max_epoch=3", env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 1 and "Traceback" in result.stderr and "runlab:" not in result.stderr


@pytest.mark.parametrize("overrides, message", [
    (["lr=-0.1"], "lr=-0.1 is invalid; the learning rate must be a positive number"),
    (["batch_size=0"], "batch_size=0 is invalid; it must be a positive integer"),
    (["optimized_metric=val/rmse"], "optimized_metric='val/rmse' is not allowed; choose one of"),
    (["checkpoint.monitor=test/acc"], "checkpoint.monitor='test/acc' is not a metric of every epoch of this run; "
                                      "choose one of train/loss, val/loss, val/acc, val/acc_top5, val/f1."),
    (["data=csv", "data.path=/nonexistent/train.csv"], "data.path='/nonexistent/train.csv' does not exist"),
    (["data=csv", "data.path=/tmp"], "data.path='/tmp' is a directory; give the path of your file."),
    (["trainer.precision=16"], "trainer.precision='16' is not allowed; choose one of 32, bf16, fp16"),
    (["data.loader=fast"], "data.loader='fast' is not allowed; choose one of auto, memory, dataloader."),
    (["data.root=images"], "data.root is not a key of data=digits; its keys are: batch_size,"),
    (["logger=csv", "logger.log_graph=false"], "logger.log_graph is not a key of logger=csv; it has none to set."),
    (["data=csv"], "data.path is empty; data=csv needs it: add data.path=VALUE to the command."),
    (["model._target_=torch.nn.Nope"], "model._target_='torch.nn.Nope' cannot be imported"),
    (["batch_size=100000"], "batch_size=100000 is larger than the 1257 training samples"),
])
def test_bad_values_are_refused_before_any_work(train, overrides, message):
    with pytest.raises(ConfigError) as error:
        train(*overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("group", ["data", "objective", "model", "optimizer", "scheduler", "logger", "parallel"])
def test_every_option_extends_its_own_schema_and_names_its_builder(group):
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from conftest import REPO, composed
    from framework.config import LOADER_KEYS, OPTIONS

    assert sorted(OPTIONS[group]) == sorted(path.stem for path in (REPO / "conf" / group).glob("*.yaml"))
    for name, schema in OPTIONS[group].items():
        if f"{group}={name}" == "data=custom":  # the user's own keys: untyped, with the loader's
            node = composed("data=custom", "data._target_=framework.data.digits")[group]
            assert OmegaConf.get_type(node) is dict and LOADER_KEYS <= set(node)
            continue
        if f"{group}={name}" == "model=custom":  # the user's own keys: untyped, checked against the signature
            node = composed("model=custom", "model._target_=usermodels.TinyNet")[group]
            assert OmegaConf.get_type(node) is dict and set(node) == {"_target_"}
            continue
        node = composed(f"{group}={name}")[group]
        assert OmegaConf.get_type(node) is schema and schema.option == f"{group}={name}"
        assert callable(get_object(node._target_))


def test_a_closed_set_reads_as_its_string():
    from conftest import composed

    cfg = composed("trainer.precision=32", "task=train")
    assert cfg.trainer.precision == "32" and f"{cfg.trainer.precision}" == str(cfg.trainer.precision) == "32"
    assert {"train": 1}[cfg.task] == 1


def test_a_csv_without_the_label_column_names_its_columns(train, tmp_path):
    path = write_csv_without_label(tmp_path / "nolabel.csv")
    with pytest.raises(ConfigError, match=r"data.label_column='label' is not a column .* its columns are: a, b, target"):
        train("data=csv", f"data.path={path}")


def test_a_foreign_checkpoint_is_refused_for_resume(train, tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(1)}}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a runlab checkpoint"):
        train(f"resume={tmp_path / 'foreign.pt'}")


def test_a_config_file_is_parsed_once_until_it_changes(tmp_path):
    """The config source keeps what it parsed (a sweep composes once per trial): each load hands out its own copy,
    and a file edited between two compositions (a notebook's next framework.run) is read anew."""
    from hydra_plugins.runlab_config import RunlabConfigSource

    source = RunlabConfigSource(provider="main", path=str(tmp_path))
    (tmp_path / "exp.yaml").write_text("defaults:\n  - _self_\nlr: 0.1\n")
    first = source.load_config("exp")
    del first.config["defaults"]  # as Hydra does with every config it is given
    assert source.load_config("exp").config == {"defaults": ["_self_"], "lr": 0.1}
    (tmp_path / "exp.yaml").write_text("defaults:\n  - _self_\nlr: 0.25\n")
    assert source.load_config("exp").config.lr == 0.25


def compose_as_the_command_line(*args: str):
    """What ``python run.py ARGS`` composes, step by step as Hydra does: ``get_mode``, then the run
    (or multirun) with the mode Hydra adds; returns (the composition get_mode kept, the run's, the
    run's overrides and mode)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    multirun = args[0] == "-m"
    overrides = list(args[1:] if multirun else args)
    hydra = Hydra.create_main_hydra2("run", create_config_search_path(str(CONF_DIR)))
    mode = hydra.get_mode("config", overrides)
    kept = hydra.config_loader.__dict__.get("runlab_mode_composition", (None, None))[1]
    if mode is None:  # what Hydra's _run_app adds
        mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        overrides.append(f"hydra.mode={mode.name}")
    return kept, hydra.compose_config("config", overrides, run_mode=mode), overrides, mode


@pytest.mark.parametrize("args", [("trainer.max_steps=1",), ("experiment=digits_cnn", "lr=0.01"),
                                  ("-m", "lr=1e-3,1e-2"), ("search=grid",)])
def test_a_command_composes_its_config_once_and_runs_what_composing_anew_gives(args):
    """Hydra composes for get_mode, drops it and composes again for the run: the run gets get_mode's
    composition instead (compose_once), the same config a composition of its own gives."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    try:
        kept, ran, overrides, mode = compose_as_the_command_line(*args)
        GlobalHydra.instance().clear()
        anew = Hydra.create_main_hydra2("run", create_config_search_path(str(CONF_DIR))).compose_config(
            "config", overrides, run_mode=mode)
    finally:
        GlobalHydra.instance().clear()
    assert ran is kept
    assert OmegaConf.to_container(ran) == OmegaConf.to_container(anew)
    assert ran.hydra.overrides.hydra == anew.hydra.overrides.hydra and ran.hydra.mode == anew.hydra.mode == mode


def test_a_default_written_as_an_interpolation_still_resolves_once_runlab_composed(tmp_path):
    """Hydra's map of group choices is built only for a defaults list with an interpolated entry
    (interpolation_map_when_read): another app's such default, composed in the same process after
    runlab's config, resolves against the choices made before it."""
    from hydra import compose, initialize_config_dir
    from hydra._internal import defaults_list

    from framework.entry import compose as compose_runlab

    compose_runlab(["trainer.max_steps=1"])
    assert getattr(defaults_list._create_interpolation_map, "when_read", False)
    for path, text in {"config.yaml": "defaults:\n  - db: mysql\n  - schema: ${db}\n  - _self_\n",
                       "db/mysql.yaml": "driver: mysql\n", "schema/mysql.yaml": "tables: 3\n",
                       "schema/sqlite.yaml": "tables: 1\n", "db/sqlite.yaml": "driver: sqlite\n"}.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        assert OmegaConf.to_container(compose("config")) == {"db": {"driver": "mysql"}, "schema": {"tables": 3}}
        assert compose("config", overrides=["db=sqlite"]).schema.tables == 1


@pytest.mark.parametrize("args, refusal", [(("lr=1e-3,1e-2",), "Ambiguous value for argument 'lr=1e-3,1e-2'"),
                                           (("-m", "hydra.job.chdir=true,false"), "Sweeping over Hydra's configuration"),
                                           (("experiment=no_model",), "You must specify 'model'")])
def test_what_only_the_runs_composition_refuses_is_still_refused(args, refusal, tmp_path):
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "no_model.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: ???\n")
    try:
        with pytest.raises(ConfigCompositionException, match=refusal):
            compose_as_the_command_line(*args, f"hydra.searchpath=[file://{tmp_path}]")
    finally:
        GlobalHydra.instance().clear()


def test_a_run_refused_from_python_leaves_nothing_behind(tmp_path):
    # As on the command line (test_faults.py): framework.run's own run dir goes with the refusal.
    with pytest.raises(ConfigError, match="lr=-1.0 is invalid"):
        run(["lr=-1", f"paths.output_dir={tmp_path / 'outputs'}"])
    assert not (tmp_path / "outputs").exists()


# --- start-up without the cyclic garbage collector (framework/startup.py) -------------------------

@pytest.mark.timeout(240)
def test_a_sweep_its_job_and_each_ddp_worker_run_with_the_collector_on_and_start_up_frozen(user, tmp_path):
    # The sweep's driver as it starts (before any job: its trials may run elsewhere, on Ray or SLURM), a job in
    # its process, then a ddp job's two workers, each as it builds the model: usermodels.CollectorProbe*.
    probe = tmp_path / "probe"
    done = user.run("python run.py -m parallel=none,ddp model=custom model._target_=usermodels.CollectorProbe "
                    "+hydra.callbacks.collector_probe._target_=usermodels.CollectorProbeAtSweepStart "
                    "trainer.max_steps=1 logger=none trainer.progress_bar=false",
                    env={**aids_on_path(user), "COLLECTOR_PROBE": str(probe)})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [line.split() for line in probe.read_text().splitlines()]
    assert [where for *_, where in seen] == ["sweep", "model", "model", "model"]
    assert len({pid for pid, *_ in seen}) == 3  # the driver's (sweep, the first job), each worker's
    assert all(enabled == "True" and int(frozen) > 100_000 for _, enabled, frozen, _ in seen), seen


@pytest.mark.parametrize("enabled", [True, False])  # a notebook's own choice
def test_a_run_from_python_leaves_the_callers_collector_as_it_was(train, enabled):
    was = gc.isenabled()
    gc.enable() if enabled else gc.disable()
    try:
        frozen = gc.get_freeze_count()
        train("trainer.max_steps=1")
        assert gc.isenabled() == enabled and gc.get_freeze_count() <= frozen  # frozen objects may die meanwhile
    finally:
        gc.enable() if was else gc.disable()
