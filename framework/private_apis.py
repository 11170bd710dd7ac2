"""Every private API of another library that runlab relies on, and every patch it makes to one:
torch, TensorBoard, Optuna, the Hydra plugins, submitit's launcher and Ray.

The rest of runlab uses public APIs only. Each function here does a job the libraries offer
no public way to do, at the pinned versions (torch 2.14, tensorboard 2.21, optuna 2.10,
hydra-core 1.3, hydra-optuna-sweeper 1.3, hydra-ray-launcher 1.2, hydra-submitit-launcher 1.2,
ray 2.60). A patch is made in runlab's own process only, when a run needs it (a TensorBoard
logger), never on import: Hydra imports runlab's plugins in every Hydra app of the environment.
tests/test_private_apis.py pins what each one relies on, so that an upgrade that breaks one
fails a test named after it instead of a run or a sweep. The imports wait for the first call:
Hydra imports every plugin module on start-up and the trainer imports search/ on every run,
sweep or not, and Ray alone costs ~0.4 s.

Four live elsewhere: ``hydra._internal``'s ``FileConfigSource``, which runlab's config source
(hydra_plugins/runlab_config/) extends, its ``ConfigLoaderImpl.load_configuration`` and
``defaults_list._create_interpolation_map``, which that module's ``compose_once`` and
``interpolation_map_when_read`` wrap, and hydra-ray-launcher's ``_config.RayConf``, the ``ray``
block of runlab's Ray launcher schema (hydra_plugins/runlab_sweeper/config.py). Hydra imports
those plugins in every Hydra app of the environment, so they must not import ``framework``
(tests/test_neighbour.py); their pin tests are in tests/test_private_apis.py too.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Dict, List, Tuple

from hydra.core.utils import JobReturn


def uncached(study):
    """The study reading its storage directly. Optuna wraps an RDB storage in a cache that keeps
    each trial this process created as this process last wrote it, which would hide from the
    driver what the trials, in other processes, wrote (intermediate values, pruning, run dirs)."""
    study._storage = getattr(study._storage, "_backend", study._storage)
    return study


def trial_by_number(study, number: int):
    """The live ``Trial`` (report, should_prune, set_user_attr) of a trial the study already
    holds: Optuna hands one out only from ``study.ask``, for a new or an enqueued trial, never a
    running one."""
    import optuna

    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    return optuna.trial.Trial(study, trial_id)


def job_error(result: JobReturn) -> BaseException:
    """The exception a failed Hydra job raised. ``JobReturn.return_value`` re-raises it, after
    printing "Error executing job with overrides" to stderr for every failed trial."""
    return result._return_value


def parse_sweep_overrides(overrides: List[str]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """hydra-optuna-sweeper's reading of overrides: the swept ones (``choice``, ``range``,
    ``interval``, tags) as Optuna distributions, and the plain ones as values. runlab's sweeper
    takes the stock search-space syntax exactly as the stock sweeper does."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    return create_params_from_overrides(overrides)


def distribution_from_config(spec: Any):
    """hydra-optuna-sweeper's reading of one entry of its deprecated ``search_space`` setting."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_config

    return create_optuna_distribution_from_config(spec)


def launch_job_on_ray(hydra_context, ray_remote, sweep_config, task_function, singleton_state):
    """hydra-ray-launcher's start of one job as a Ray task; returns its ObjectRef at once
    (the launcher's public ``launch`` waits for all its jobs)."""
    from hydra_plugins.hydra_ray_launcher._launcher_util import launch_job_on_ray as launch

    return launch(hydra_context, ray_remote, sweep_config, task_function, singleton_state)


def present_ray_token() -> None:
    """Make ray.init present the local token to an explicit address, as it does for a cluster it
    finds itself (address "auto"): Ray's own step then, which also refreshes the config Ray has
    already cached in this process."""
    try:
        from ray._private.authentication.authentication_token_setup import \
            maybe_enable_token_auth_if_token_available
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def set_submitit_executor(launcher, executor: str) -> None:
    """hydra-submitit-launcher picks submitit's executor ("slurm" or "local") by a class attribute,
    one per launcher class; runlab's one launcher picks it per instance."""
    launcher._EXECUTOR = executor


def trial_id(trial) -> int:
    """The storage's id of a trial (what ``record_heartbeat`` takes); Optuna 2.10 shows only its number."""
    return trial._trial_id


def heartbeat_ages(study) -> Dict[int, float]:
    """Seconds since each RUNNING trial's last heartbeat, by the database's clock, by trial number
    (trials without one left out). Optuna's only public use of them is ``fail_stale_trials``, which
    fails a stale trial; runlab takes it over instead, with its number, run dir and checkpoint."""
    from optuna.storages._rdb import models
    from optuna.trial import TrialState
    from sqlalchemy import func

    session = study._storage.scoped_session()
    try:
        now = session.execute(func.now()).scalar().replace(tzinfo=None)
        rows = (session.query(models.TrialModel.number, models.TrialHeartbeatModel.heartbeat)
                .join(models.TrialHeartbeatModel, models.TrialHeartbeatModel.trial_id == models.TrialModel.trial_id)
                .filter(models.TrialModel.study_id == study._study_id, models.TrialModel.state == TrialState.RUNNING).all())
        return {number: (now - beat.replace(tzinfo=None)).total_seconds() for number, beat in rows}
    finally:
        session.close()


# --- torch -------------------------------------------------------------------------------

def zero_gradient_buckets(model) -> List[Any]:
    """DDP's gradient buckets (``torch.distributed.GradBucket``) in the order its reducer all-reduces
    them (which DDP rebuilds after the first iteration), holding zeros: what a process that ran out
    of memory sends instead of its gradients. DDP's own join shadows buckets this way
    (``DistributedDataParallel._match_all_reduce_for_bwd_pass``)."""
    return model.reducer._get_zeros_like_grad_buckets()


def one_kernel_total_norm(grads: List[Any]) -> Any:
    """``torch.nn.utils.get_total_norm(grads)``, the same value, for plain tensors on one device of
    one dtype: one ``_foreach_norm`` (what get_total_norm itself calls where it uses foreach), then
    the norm of those. get_total_norm groups the tensors by device and dtype first, and checks each
    group's foreach support: in a training step of the digits MLP here the norm took about 70 µs
    through it and 45 µs this way (of a 1 ms step), and torch has no public norm without it."""
    import torch

    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def compiled_original(module) -> Any:
    """The module ``torch.compile`` compiled, where ``module`` is what it returned (an
    ``OptimizedModule``), else None. torch keeps it as the child ``_orig_mod`` and offers no
    public way back to it."""
    return dict(module.named_children()).get("_orig_mod")


# --- TensorBoard ---------------------------------------------------------------------------

def summary_writer_class() -> type:
    """torch's ``SummaryWriter``, imported without botocore.

    TensorBoard's file layer (``tensorboard.compat.tensorflow_stub.io.gfile``) imports botocore,
    when it is installed (hydra-ray-launcher installs it), to offer s3:// log dirs, and goes on
    without them on an ImportError. A run's log dir is always local, and the import cost 0.1-0.2 s
    of every run's start; where botocore was imported already, nothing changes."""
    absent = "botocore" not in sys.modules
    if absent:
        sys.modules["botocore"] = None  # importing it raises ImportError
    try:
        from torch.utils.tensorboard import SummaryWriter
    finally:
        if absent:
            del sys.modules["botocore"]  # code that needs it later imports it as usual
    return SummaryWriter


def quiet_writer_thread_errors() -> None:
    """TensorBoard's writer thread keeps an OSError it meets (a full disk) and raises it again at the
    writer's next call, where the run ends with its one line: the thread's own traceback, printed
    on stderr as it dies, is dropped. The thread is known by its class's module (``tensorboard.``:
    ``event_file_writer._AsyncWriterThread``). Other threads' errors, and other errors, print as
    before. Installed once per process, by the first TensorBoard logger."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__module__.startswith("tensorboard.") and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook
