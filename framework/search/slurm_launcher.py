"""hydra-submitit-launcher's SLURM launcher (``launcher=slurm``), with a local mode.

``hydra.launcher.cluster=local`` runs the very same jobs (and the same config) with submitit's
local executor, as processes on this machine: a way to try a SLURM config before submitting it,
and how the tests run it. Each job is a run, or a sweep's trial; with ``tasks_per_node`` > 1 and
``parallel=ddp`` each task is one rank of the run (framework/parallel/distributed.py). A job
SLURM preempts or times out is requeued by submitit (its checkpoint() resubmits the same job),
and ``resume=auto`` (set by conf/launcher/slurm.yaml) continues it from its own last.pt.
"""
from __future__ import annotations

import shutil
from typing import Any, Sequence

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf

from framework.errors import ConfigError, SweepError, exit_with
from framework.private_apis import set_submitit_executor

CLUSTERS = ("slurm", "local")
# What submitit's local executor takes of the SLURM settings: the shared ones, and requeues.
LOCAL_KEYS = set(OmegaConf.structured(BaseQueueConf).keys()) | {"max_num_timeout"}


class SlurmOrLocalLauncher(BaseSubmititLauncher):
    def __init__(self, cluster: str = "slurm", **params: Any) -> None:
        if cluster not in CLUSTERS:  # in Hydra's machinery, which would print a traceback
            exit_with(ConfigError(f"hydra.launcher.cluster={cluster!r} is not allowed; choose slurm, or local to run "
                                  "the jobs as processes on this machine."))
        if cluster == "local":  # submitit's local executor makes the folder as named, %j and all: one folder for all
            params = {k: v.replace("/%j", "") if k == "submitit_folder" else v for k, v in params.items() if k in LOCAL_KEYS}
        super().__init__(**params)
        self.cluster = cluster
        set_submitit_executor(self, cluster)  # also the prefix of submitit's executor-specific settings

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """submitit's launch, with what a user can act on in one line (in Hydra's machinery, hence exit_with)."""
        from submitit.core.utils import FailedJobError, UncompletedJobError

        if self.cluster == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
            exit_with(ConfigError("launcher=slurm submits with SLURM's sbatch and srun, which are not on PATH here; run "
                                  "it on a login node of your cluster, or run the jobs on this machine with "
                                  "hydra.launcher.cluster=local."))
        try:
            return super().launch(job_overrides, initial_job_idx)
        except (FailedJobError, UncompletedJobError) as error:  # sbatch refused the jobs, or one died without a result
            first = (str(error).strip().splitlines() or [""])[0]
            exit_with(SweepError(f"submitit could not run the jobs ({type(error).__name__}: {first}); their logs are in "
                                 f"{self.params['submitit_folder'].replace('%j', '<job id>')}."))
