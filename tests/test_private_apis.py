"""What framework/private_apis.py relies on in torch, TensorBoard, Optuna, the Hydra plugins, submitit's launcher
and Ray, and what hydra_plugins/runlab_config relies on in Hydra.

One test per function there: an upgrade that changes the private behaviour fails the test
named after it. The sweeps that use them end to end are in test_search.py, test_slurm.py and
test_sweep_scheduling.py.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
import time

import optuna
import pytest
import torch
import yaml
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, LogUniformDistribution, UniformDistribution
from optuna.trial import TrialState
from torch import nn

from conftest import REPO
from framework.private_apis import (compiled_original, distribution_from_config, heartbeat_ages, job_error,
                                    one_kernel_total_norm, parse_sweep_overrides, quiet_writer_thread_errors, set_submitit_executor,
                                    summary_writer_class, trial_by_number, trial_id, uncached, zero_gradient_buckets)
from framework.model import BATCH_NORMS, MLP
from framework.search.study import rdb_storage


def test_an_uncached_study_sees_what_a_trial_process_wrote_to_a_trial_the_driver_created(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    driver = optuna.create_study(study_name="study", storage=storage)
    before = driver.ask()
    uncached(driver)
    after = driver.ask()
    for number in (before.number, after.number):  # what trial.py does in the trial's own process
        in_trial_process = trial_by_number(optuna.load_study(study_name="study", storage=storage), number)
        in_trial_process.report(0.5, step=1)
        in_trial_process.set_user_attr("pruned_at_epoch", 1)
    # Optuna's cache keeps a trial as the process that created it last wrote it: why uncached exists.
    assert before.user_attrs == {}
    assert after.user_attrs == {"pruned_at_epoch": 1}
    assert [t.intermediate_values for t in driver.trials] == [{1: 0.5}, {1: 0.5}]


def test_trial_by_number_is_the_running_trial_with_its_params_and_can_be_told(tmp_path):
    study = uncached(optuna.create_study(study_name="study", storage=f"sqlite:///{tmp_path / 'study.db'}"))
    asked = study.ask({"lr": UniformDistribution(0.0, 1.0)})
    study.ask()

    trial = trial_by_number(study, asked.number)

    assert (trial.number, trial.params) == (asked.number, asked.params)
    trial.set_user_attr("run_dir", "outputs/0")
    study.tell(trial, state=TrialState.FAIL)
    told = study.trials[asked.number]
    assert (told.state, told.user_attrs) == (TrialState.FAIL, {"run_dir": "outputs/0"})
    assert study.trials[1].state == TrialState.RUNNING


def test_heartbeat_ages_are_the_seconds_since_each_running_trials_last_heartbeat(tmp_path):
    storage = rdb_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_s=1, grace_s=3)
    study = uncached(optuna.create_study(study_name="study", storage=storage))
    beating, silent, told = study.ask(), study.ask(), study.ask()
    for trial in (beating, told):
        storage.record_heartbeat(trial_id(trial))
    study.tell(told, 0.5)
    assert trial_id(beating) == storage.get_trial_id_from_study_id_trial_number(study._study_id, beating.number)

    ages = heartbeat_ages(study)  # only RUNNING trials with a heartbeat, by number, by the database's clock
    assert list(ages) == [beating.number] and 0 <= ages[beating.number] < 2
    time.sleep(2.1)  # sqlite's clock counts whole seconds
    assert heartbeat_ages(study)[beating.number] >= 1
    assert silent.number not in heartbeat_ages(study)


def test_job_error_is_the_exception_a_failed_job_raised_without_hydras_stderr_line(capsys):
    error = ValueError("diverged")
    result = JobReturn(overrides=["lr=1"], status=JobStatus.FAILED)
    result.return_value = error

    assert job_error(result) is error
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="diverged"):
        result.return_value  # the public way: re-raises, and prints a line per failed trial
    assert "Error executing job with overrides: ['lr=1']" in capsys.readouterr().err


def test_the_stock_sweep_syntax_becomes_distributions_and_plain_values():
    space, fixed = parse_sweep_overrides(["lr=tag(log,interval(1e-4,1e-1))", "width=choice(32,64)", "seed=3"])

    assert space == {"lr": LogUniformDistribution(1e-4, 1e-1), "width": CategoricalDistribution([32, 64])}
    assert fixed == {"seed": "3"}  # as typed: the sweeper hands them on to every trial as overrides
    spec = OmegaConf.create({"type": "float", "low": 1, "high": 100, "log": True})
    assert distribution_from_config(spec) == LogUniformDistribution(1, 100)


def test_the_ray_launchers_job_start_takes_what_the_runlab_launcher_passes():
    from hydra_plugins.hydra_ray_launcher._launcher_util import launch_job_on_ray

    assert list(inspect.signature(launch_job_on_ray).parameters) == [
        "hydra_context", "ray_remote", "sweep_config", "task_function", "singleton_state"]


@pytest.mark.parametrize("token, mode", [("a-token", "token"), (None, "None")])
def test_present_ray_token_turns_token_authentication_on_only_when_a_token_exists(tmp_path, token, mode):
    # In a process of its own: Ray caches its config and the token for the whole process.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), **({"RAY_AUTH_TOKEN": token} if token else {}))
    script = ("import os; from framework.private_apis import present_ray_token; "
              "present_ray_token(); print(os.environ.get('RAY_AUTH_MODE'))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == mode


class ExecutorChosen(Exception):
    pass


def test_the_executor_set_on_a_submitit_launcher_is_the_one_its_jobs_run_on(tmp_path, monkeypatch):
    import submitit
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

    def record(cluster, **settings):
        raise ExecutorChosen(cluster, settings)

    monkeypatch.setattr(submitit, "AutoExecutor", record)
    launcher = BaseSubmititLauncher(submitit_folder=str(tmp_path), max_num_timeout=3)
    launcher.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    set_submitit_executor(launcher, "local")

    with pytest.raises(ExecutorChosen) as chosen:
        launcher.launch([["lr=1"]], initial_job_idx=0)
    # The executor, and the prefix of its own settings.
    assert chosen.value.args == ("local", {"folder": str(tmp_path), "local_max_num_timeout": 3})


# --- torch ---------------------------------------------------------------------------------

def test_the_private_ddp_api_the_out_of_memory_agreement_relies_on(tmp_path):
    """zero_gradient_buckets reads DDP's reducer: its buckets, in all-reduce order, holding zeros; the
    agreement's DDP (whichever buffer keyword this torch has) broadcasts no buffers before a forward."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from framework.parallel.distributed import OutOfMemoryAgreement

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        model = MLP([64], 10, width=512, depth=3, dropout=0.0, batch_norm=False)
        model.head.bias.requires_grad_(False)  # frozen parameters have no bucket
        buckets = zero_gradient_buckets(DistributedDataParallel(model))
        assert [bucket.index() for bucket in buckets] == list(range(len(buckets)))
        assert sum(bucket.buffer().numel() for bucket in buckets) == sum(p.numel() for p in model.parameters()
                                                                         if p.requires_grad)
        assert all(not bucket.buffer().any() for bucket in buckets)
        # The agreement averages buffers itself: its DDP broadcasts none before a forward.
        with_buffers = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        assert DistributedDataParallel(with_buffers).will_sync_module_buffers()
        assert not OutOfMemoryAgreement(with_buffers, torch.device("cpu")).wrap(with_buffers, None).will_sync_module_buffers()
    finally:
        dist.destroy_process_group()


def test_the_compiled_original_is_the_module_torch_compile_was_given():
    module = nn.Linear(2, 2)
    assert compiled_original(torch.compile(module)) is module
    assert compiled_original(module) is None


def test_the_one_kernel_total_norm_is_get_total_norms_value_to_the_bit():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * scale for shape, scale in (((256, 64), 1e-3), ((256,), 1.0), ((10, 256), 1e3))]
    assert torch.equal(one_kernel_total_norm(grads), torch.nn.utils.get_total_norm(grads))
    grads[1][3] = float("inf")  # what the non-finite check reads it for
    assert one_kernel_total_norm(grads).isinf()
    grads[0][0, 0] = float("nan")
    assert one_kernel_total_norm(grads).isnan()


def test_the_public_batch_norms_are_all_of_torchs():
    """Not private, but standing for one: framework/model.py's BATCH_NORMS replaces nn.modules.batchnorm._BatchNorm."""
    batch_norms = {c for c in vars(nn).values() if isinstance(c, type) and issubclass(c, nn.modules.batchnorm._BatchNorm)}
    assert batch_norms == set(BATCH_NORMS)


# --- TensorBoard ---------------------------------------------------------------------------

def test_tensorboards_file_layer_imports_botocore_where_it_is_installed():
    """What summary_writer_class keeps out of a run's start: the module torch's SummaryWriter writes
    through imports botocore where it is importable (were it not, the block would be dead). That the
    writer imports without it, and botocore later as usual: test_logging.py."""
    pytest.importorskip("botocore")
    script = "import sys, tensorboard.summary.writer.event_file_writer; assert 'botocore' in sys.modules"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_tensorboards_writer_thread_is_told_by_its_module_and_only_its_os_errors_are_quieted(tmp_path, monkeypatch):
    passed_on = []
    monkeypatch.setattr(threading, "excepthook", passed_on.append)
    quiet_writer_thread_errors()
    before = set(threading.enumerate())
    writer = summary_writer_class()(log_dir=str(tmp_path))
    try:
        started = set(threading.enumerate()) - before
    finally:
        writer.close()
    (thread,) = [t for t in started if type(t).__module__.startswith("tensorboard.")]  # what the hook tells it by

    def failed(thread: threading.Thread, error: type) -> threading.ExceptHookArgs:
        return threading.ExceptHookArgs([error, error(), None, thread])

    for args in (failed(thread, OSError), failed(thread, ValueError), failed(threading.Thread(), OSError)):
        threading.excepthook(args)
    assert [args.exc_type for args in passed_on] == [ValueError, OSError]


# --- what runlab's own Hydra plugins use (they may not import framework) ---------------------------

def test_hydras_file_source_reads_a_yaml_and_lets_its_syntax_error_through(tmp_path):
    from hydra._internal.core_plugins.file_config_source import FileConfigSource

    (tmp_path / "group").mkdir()
    (tmp_path / "group" / "good.yaml").write_text("# @package _global_\nkey: 1\n")
    (tmp_path / "group" / "bad.yaml").write_text("key: [1\n")
    source = FileConfigSource(provider="test", path=str(tmp_path))
    assert source._normalize_file_name("group/good") == "group/good.yaml"
    result = source.load_config("group/good")
    assert result.config == {"key": 1} and result.header["package"] == "_global_"
    with pytest.raises(yaml.YAMLError):  # RunlabConfigSource turns it into one line naming file, line and column
        source.load_config("group/bad")
    found = []
    source._list_add_result(files=found, file_path="group/good.yaml", file_name="good.yaml", results_filter=None)
    assert found == ["good"]


def test_hydra_ray_launchers_ray_block_is_the_schema_runlab_ray_extends():
    from hydra_plugins.hydra_ray_launcher._config import RayConf

    from hydra_plugins.runlab_sweeper.config import RunlabRayLauncherConf

    ray = OmegaConf.structured(RunlabRayLauncherConf).ray
    assert {"init", "remote"} <= set(OmegaConf.structured(RayConf)) and ray == OmegaConf.structured(RayConf)


def test_what_compose_once_relies_on_in_hydras_config_loader():
    """hydra_plugins/runlab_config's compose_once: the loader's call, the mode override Hydra's _run_app
    adds, and the loader's own override application and sweep check (the end-to-end case: test_cli.py)."""
    from hydra._internal import utils
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from hydra.types import RunMode

    from hydra._internal.hydra import Hydra

    assert list(inspect.signature(ConfigLoaderImpl.load_configuration).parameters) == [  # Hydra's (__wrapped__)
        "self", "config_name", "overrides", "run_mode", "from_shell", "validate_sweep_overrides"]
    assert "validate_sweep_overrides=False" in inspect.getsource(Hydra.get_mode)  # how compose_once knows its call
    for mode in ("RUN", "MULTIRUN"):
        assert f'overrides.extend(["hydra.mode={mode}"])' in inspect.getsource(utils._run_app)
    # The mode reaches the composition in two places only: the sweep check and skip_missing.
    composition = inspect.getsource(ConfigLoaderImpl._load_configuration_impl)
    assert composition.count("run_mode") == 4 and "skip_missing=run_mode == RunMode.MULTIRUN" in composition
    cfg = OmegaConf.create({"hydra": {"mode": None}})
    ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(["hydra.mode=RUN"]), cfg)
    assert cfg.hydra.mode == "RUN"
    with pytest.raises(ConfigCompositionException, match="Sweeping over Hydra's configuration"):
        ConfigLoaderImpl.validate_sweep_overrides_legal(OverridesParser.create().parse_overrides(["hydra.verbose=true,false"]),
                                                        RunMode.MULTIRUN, from_shell=True)


def test_what_interpolation_map_when_read_relies_on_in_hydras_defaults_tree():
    """hydra_plugins/runlab_config's interpolation_map_when_read: the map's builder and the one place
    it is read, for children that are interpolated defaults (the end-to-end case: test_cli.py)."""
    from hydra._internal import defaults_list

    assert list(inspect.signature(defaults_list._create_interpolation_map).parameters) == [  # Hydra's (__wrapped__)
        "overrides", "defaults_list", "self_added"]
    assert inspect.getsource(defaults_list).count("_create_interpolation_map(") == 2  # defined, and called once:
    tree = inspect.getsource(defaults_list._create_defaults_tree_impl)
    assert "known_choices = _create_interpolation_map(overrides, defaults_list, self_added)" in tree
    assert tree.count("known_choices") == 2 and "dd.is_interpolation():\n            dd.resolve_interpolation(known_choices)" in tree
    assert "if d.is_interpolation():\n                    children.append(d)" in tree  # its only interpolated children
