"""hydra-ray-launcher's local launcher (``launcher=ray_local``), made safe for sweeps.

Over the stock one it: starts a local instance of its own unless given an address (plain
ray.init joins the cluster ``ray start`` last started here), joins a cluster with token
authentication (Ray 2.60's default) with the local token and says so in one line when the
cluster refuses it, never passes ``object_store_memory`` when connecting to an existing
cluster (Ray refuses it there), turns a Ray that cannot start into one clear error, turns a
trial whose worker died into a failed trial instead of a dead sweep, and hands each trial
back as it ends, so runlab's sweeper refills a slot at once (``TrialSlots``).
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra_plugins.hydra_ray_launcher.ray_launcher import RayLauncher
from omegaconf import OmegaConf, open_dict

from framework.errors import SweepError, exit_with
from framework.private_apis import launch_job_on_ray, present_ray_token
from framework.search.slots import TrialSlots

log = logging.getLogger(__name__)

# A small object store is enough (trials return one float) and fits small machines and CI.
LOCAL_OBJECT_STORE_BYTES = 78643200
# A GCS call every cluster answers at once, with UNAUTHENTICATED when it refuses the token (the
# first call ray.init makes).
GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
# The reaper of this driver's local Ray instance: held for the driver's lifetime, since dropping it
# would close the pipe that tells the reaper the driver is gone.
REAPER: List[subprocess.Popen] = []


class RayStartError(SweepError):
    """Ray could not start or join its cluster: no trial can run."""


def check_reachable(address: str) -> None:
    """Ray retries an unreachable head for minutes, silently; fail in seconds with the reason instead."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local": Ray finds the cluster itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as error:
        raise RayStartError(f"The Ray cluster at {address} cannot be reached ({error}); check "
                            "hydra.launcher.ray.init.address and that `ray start --head` runs there.") from None


def cluster_token() -> Optional[str]:
    """The token Ray would present, from where Ray looks for it: RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token (`ray get-auth-token` prints it)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None


def check_token_accepted(address: str, token: Optional[str]) -> None:
    """Ask the cluster's GCS once; a cluster that refuses the token would otherwise make ray.init
    retry for ~20 s and then fail without saying why."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(GCS_PROBE)(b"", metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAUTHENTICATED:
                return  # not an answer about the token: ray.init reports whatever else is wrong
            where = "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else \
                (os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token")
            found = f"the token in {where}" if token else "no token (RAY_AUTH_TOKEN, ~/.ray/auth_token)"
            raise RayStartError(f"The Ray cluster at {address} uses token authentication and refused {found}; "
                                "run `ray get-auth-token` on its head node and set RAY_AUTH_TOKEN to what it "
                                "prints.") from None


def join_cluster(init: dict) -> None:
    address = str(init["address"])
    check_reachable(address)
    init.pop("object_store_memory", None)  # Ray rejects it when joining a running cluster
    if address.startswith("ray://") or ":" not in address:
        return  # Ray Client, or "auto": Ray handles these itself
    check_token_accepted(address, cluster_token())
    # `ray start --head` turns token authentication on whenever a token exists (a local ray.init
    # writes one to ~/.ray), but ray.init presents the token only when it finds the cluster itself
    # (address "auto"); for an explicit address, do what it does then.
    present_ray_token()


def start_reaper() -> None:
    """Have the local Ray instance's processes end with this driver, a killed one included (reaper.py).
    The pipe's other end closes when this process exits; the reaper runs in a session of its own, out of
    reach of the terminal's signals, which are the driver's to handle, and holds none of the driver's
    output streams (a caller reading them to their end would wait for it)."""
    script = Path(__file__).with_name("reaper.py")
    REAPER.append(subprocess.Popen([sys.executable, str(script), str(os.getpid())], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))


def start_ray(init: dict) -> None:
    import ray

    if ray.is_initialized():
        return
    if init.get("address") not in (None, "local"):
        join_cluster(init)
    else:
        # No address (hydra-ray-launcher's default) or "local": a new instance for this sweep. Given no
        # address, ray.init would join whatever cluster `ray start` last started on this machine.
        init["address"] = "local"
        init.setdefault("object_store_memory", LOCAL_OBJECT_STORE_BYTES)
        start_reaper()
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # Ray runs workers at nice 15 by default; trials are the work, not background chores, and
    # on a shared machine a niced trial gets a fraction of its core.
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(**init)
    except Exception as error:
        where = "a local Ray instance" if init["address"] == "local" else f"the cluster at {init['address']}"
        raise RayStartError(f"Ray could not start {where} ({type(error).__name__}: {error}). Check that the address "
                            "is reachable, that /tmp has space, and the hydra.launcher.ray.init options; "
                            "or run the trials without Ray (drop launcher=ray_local).") from None


class ClearRayLauncher(RayLauncher, TrialSlots):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Hydra's interface (the basic sweeper with launcher=ray_local): all jobs at once."""
        try:
            runs = [self.submit(overrides, idx) for idx, overrides in enumerate(job_overrides, start=initial_job_idx)]
        except RayStartError as error:  # here no runlab sweeper turns it into its one line
            exit_with(error)
        return [self.result(run) for run in runs]

    def submit(self, overrides: Sequence[str], number: int):
        setup_globals()
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        start_ray(OmegaConf.to_container(self.ray_cfg.init, resolve=True))
        log.info("\t#%d : %s", number, " ".join(filter_overrides(overrides)))
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"job_id_for_{number}"
            sweep_config.hydra.job.num = number
        return launch_job_on_ray(self.hydra_context, self.ray_cfg.remote, sweep_config, self.task_function,
                                 Singleton.get_state())

    def next_finished(self, handles: List[Any]) -> Tuple[Any, JobReturn]:
        import ray

        (done,), _ = ray.wait(handles, num_returns=1)
        return done, self.result(done)

    def cancel(self, handles: List[Any]) -> None:
        import ray

        for handle in handles:
            ray.cancel(handle, force=True)

    @staticmethod
    def result(run) -> JobReturn:
        import ray

        try:
            return ray.get(run)
        except ray.exceptions.RayError as error:  # the worker died (killed, out of memory) or failed to start
            failed = JobReturn()
            failed.return_value, failed.status = error, JobStatus.FAILED
            return failed
