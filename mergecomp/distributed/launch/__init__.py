"""Who am I in the job? Rank and rendezvous discovery for every way mergecomp is launched.

Each launcher tells its processes their place through different environment variables:

============  ===================================================================
launcher      variables read
============  ===================================================================
torchrun      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
              MASTER_PORT (recognised by TORCHELASTIC_RUN_ID)
horovodrun    HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE
              (its Gloo mode).  In its MPI mode horovodrun runs ``mpirun`` and
              the processes see exactly what ``mpirun`` gives them, so they are
              reported as "mpirun"; the backend decides whether to use Horovod.
mpirun        Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
              OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE;
              MPICH / Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,
              MPI_LOCALNRANKS
spawn         :func:`spawn` below: RANK, WORLD_SIZE, LOCAL_RANK, ... and
              MERGECOMP_LAUNCHER=spawn
env           RANK and WORLD_SIZE set by any other tool (the ``env://`` convention)
single        nothing: one process, rank 0 of 1
============  ===================================================================

torch.distributed then meets over TCP at MASTER_ADDR:MASTER_PORT.  MPI and Horovod do not set
them, so when every rank is on one machine (local size == world size) MASTER_ADDR defaults to
127.0.0.1; across machines pass them explicitly, e.g. ``mpirun -x MASTER_ADDR=<host of rank 0>
-x MASTER_PORT=<port>``.  Without MASTER_PORT the port is derived from the launcher's job id
(the same number on every rank of one job, different for concurrent jobs), or 29500.

Open MPI refuses to start as root unless told to: ``mpirun --allow-run-as-root`` or
``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` (containers often run as root).

The parts: :mod:`.identity` (who am I), :mod:`.session` (joining and leaving the job),
:mod:`.local_ranks` (local ranks without a launcher).
"""
from __future__ import annotations

from .identity import (LAUNCHERS, LAUNCHER_VARIABLE, LOOPBACK, DEFAULT_PORT, LaunchInfo, detect,
                     free_port)
from .session import (TIMEOUT_VARIABLE, DEFAULT_TIMEOUT_S, RENDEZVOUS_TIMEOUT_S, SHUTDOWN_LINGER_S,
                      collective_timeout, init_distributed, RendezvousError, record_uncaught,
                      shutdown, _choose_backend, _rendezvous_error)
from .local_ranks import (SpawnedProcessError, spawn, exit_without_teardown)

# The public classes keep the package's name (in tracebacks, reprs and pickles).
for _public in (LaunchInfo, RendezvousError, SpawnedProcessError):
    _public.__module__ = __name__

__all__ = ["DEFAULT_PORT", "DEFAULT_TIMEOUT_S", "LAUNCHERS", "LAUNCHER_VARIABLE", "LOOPBACK",
           "LaunchInfo", "RENDEZVOUS_TIMEOUT_S", "RendezvousError", "SHUTDOWN_LINGER_S",
           "SpawnedProcessError", "TIMEOUT_VARIABLE", "collective_timeout", "detect",
           "exit_without_teardown", "free_port", "init_distributed", "record_uncaught", "shutdown",
           "spawn"]
