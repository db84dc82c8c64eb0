"""Multi-process start-up: `jax.distributed.initialize` from flags or the environment, else nothing.

k3jax adds no transport of its own. Each host (or each GPU) runs one Python process; every process
calls `maybe_initialize()` before touching any device, after which `jax.devices()` lists the devices
of all processes, `k3jax.parallel.sharding.make_mesh` builds one global mesh over them, and XLA
inserts the collectives (NCCL on GPU). Every process must run the same jitted steps in the same order.

Where the settings come from, first match wins:
  1. arguments (the trainer's --coordinator_address / --num_processes / --process_id flags);
  2. environment variables JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES,
     JAX_PROCESS_ID (and optionally JAX_LOCAL_DEVICE_IDS, read by JAX itself);
  3. a launcher JAX detects by itself, when it started more than one process:
     SLURM (`srun`: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID;
     one process per task, and with one task per GPU JAX gives each process its own GPU), or
     Open MPI (`mpirun`: OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE / _RANK);
  4. K3JAX_DISTRIBUTED=auto forces a plain `jax.distributed.initialize()` (JAX's own detection:
     Kubernetes JobSet / indexed Job, which needs `pip install jax[k8s]` and RBAC to list pods;
     Cloud TPU; mpi4py); K3JAX_DISTRIBUTED=off skips everything.
Otherwise (one process) this is a no-op.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import jax

ENV_SWITCH = "K3JAX_DISTRIBUTED"
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")


def _env_int(name: str) -> Optional[int]:
  value = os.environ.get(name)
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def detected_launcher() -> Optional[str]:
  """'slurm' or 'ompi' when that launcher started more than one process, else None."""
  if all(v in os.environ for v in _SLURM_VARS) and (_env_int("SLURM_NTASKS") or 1) > 1:
    return "slurm"
  if "OMPI_MCA_orte_hnp_uri" in os.environ and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "ompi"
  return None


def maybe_initialize(coordinator_address: Optional[str] = None,
                     num_processes: Optional[int] = None,
                     process_id: Optional[int] = None,
                     local_device_ids: Optional[Union[int, Sequence[int]]] = None,
                     initialization_timeout: int = 300) -> bool:
  """Initialises the JAX distributed system when this is a multi-process run.

  Must run before any JAX computation or device query (JAX raises otherwise).

  Args:
    coordinator_address: 'host:port' of process 0, reachable from every process.
    num_processes: total number of processes; 1 (or unset with nothing detected) means no-op.
    process_id: this process's index in [0, num_processes).
    local_device_ids: devices this process owns (default: JAX's choice; one GPU per process under
      SLURM / Open MPI with one task per GPU, all local GPUs otherwise).
    initialization_timeout: seconds to wait for the other processes.

  Returns:
    True when this call initialised the distributed system; False for a single process or when
    it was already initialised.

  Raises:
    ValueError: inconsistent settings (e.g. a process_id without num_processes, process_id out of
      range, or an unknown K3JAX_DISTRIBUTED value), naming the setting.
  """
  switch = os.environ.get(ENV_SWITCH, "").strip().lower()
  if switch not in ("", "auto", "off"):
    raise ValueError(f"{ENV_SWITCH}={switch!r} is not allowed: '' (detect), 'auto' or 'off'")
  if switch == "off" or jax.distributed.is_initialized():
    return False

  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None:
    num_processes = _env_int("JAX_NUM_PROCESSES")
  if process_id is None:
    process_id = _env_int("JAX_PROCESS_ID")

  if num_processes is not None:
    if num_processes < 1:
      raise ValueError(f"num_processes={num_processes} must be >= 1")
    if process_id is not None and not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if num_processes == 1:
      return False
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)
    return True
  if process_id is not None:
    raise ValueError(f"process_id={process_id} given without num_processes; set both (flags or "
                     "JAX_NUM_PROCESSES / JAX_PROCESS_ID)")

  if detected_launcher() is not None or switch == "auto":
    # JAX reads the launcher's variables itself; an explicit coordinator address overrides its
    # choice (e.g. a specific network interface).
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)
    return True
  if coordinator_address is not None:
    raise ValueError(f"coordinator_address={coordinator_address!r} given but the number of "
                     "processes is unknown; set num_processes (flag or JAX_NUM_PROCESSES)")
  return False


def describe() -> str:
  """One line for the log: process index/count and local/global device counts."""
  return (f"process {jax.process_index()} of {jax.process_count()}; "
          f"{jax.local_device_count()} local of {jax.device_count()} devices "
          f"({jax.devices()[0].platform})")
