"""Several processes, one run: start `jax.distributed` for the command line, and keep hosts agreeing.

    dsv-jax train ...                                        one process: nothing to start
    srun -N 4 --ntasks-per-node=8 dsv-jax train ...          SLURM: detected
    mpirun -np 16 dsv-jax train ...                          OpenMPI: detected
    dsv-jax train --coordinator HOST:PORT --num-processes N --process-id I ...
        (or the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)

jax's multi-controller runtime does the rest: every process runs the same program on its own devices,
and collectives span them all. So every decision that changes what runs (the config, a stop request)
must be the same on every process; `check_same_config` and `any_process` make sure of it.
"""

from __future__ import annotations

import hashlib
import logging
import os

import jax
import numpy as np

from dsv_jax.config import Config, ConfigError

log = logging.getLogger("dsv_jax")


def launcher() -> str | None:
    """ "slurm" or "openmpi" when this process is one task of several started by that launcher."""
    if (
        all(v in os.environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID"))
        and int(os.environ.get("SLURM_NTASKS", "1")) > 1
    ):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in os.environ and int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Start jax.distributed when this process is one of several; returns whether it did. Must run
    before anything else uses jax."""
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit:
        missing = [
            name
            for name, v in (
                ("--coordinator", coordinator),
                ("--num-processes", num_processes),
                ("--process-id", process_id),
            )
            if v is None
        ]
        if missing and not launcher():
            raise ConfigError(
                f"a multi-process run needs --coordinator, --num-processes and --process-id (or "
                f"JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); missing {missing}"
            )
        if num_processes == 1:
            return False
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id {process_id} is not in 0..{num_processes - 1}")
    elif launcher() is None:
        return False
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    log.info(
        "process %d of %d (%s); %d devices here, %d in all",
        jax.process_index(),
        jax.process_count(),
        launcher() or "explicit",
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def check_same_config(cfg: Config) -> None:
    """Stop with a clear error when the processes of a run were given different configs."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(cfg.to_json().encode()).digest()[:8], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
    differ = [i for i, row in enumerate(every) if not np.array_equal(row, every[0])]
    if differ:
        raise ConfigError(
            f"processes {differ} were given a different config than process 0 (compare each "
            "process's command line, config file and overrides); all must train the same model"
        )


def any_process(flag: bool) -> bool:
    """`flag` or-ed over all processes (a collective: every process must call it at the same point)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([int(flag)], np.int32))))


def host_copy(tree):
    """A pytree of (possibly multi-process) arrays as numpy on every process (a collective)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
