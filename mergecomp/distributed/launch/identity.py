"""Who am I in the job: the launcher, rank, world size, local layout and rendezvous
address, read from the variables each launcher sets (see :mod:`mergecomp.distributed.launch`)."""
from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass
from typing import Mapping, Optional


LAUNCHERS = ("torchrun", "horovodrun", "mpirun", "spawn", "env", "single")
LAUNCHER_VARIABLE = "MERGECOMP_LAUNCHER"
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29500
_DERIVED_PORT_BASE, _DERIVED_PORT_SPAN = 20000, 10000  # below Linux's ephemeral range


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job and where torch.distributed meets.

    ``master_addr``/``master_port`` are None only for a single process with nothing set;
    :func:`init_distributed` then picks 127.0.0.1 and a free port.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


def detect(environ: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """Read the launcher's variables from ``environ`` (default ``os.environ``).

    Raises ValueError naming the variable and its value when they are not integers or do not
    fit together (rank >= world size, world size < 1, ...), and when a multi-machine MPI or
    Horovod job has no MASTER_ADDR.
    """
    env = dict(os.environ if environ is None else environ)
    if env.get(LAUNCHER_VARIABLE) == "spawn":
        return _from_torch_variables("spawn", env)
    if "TORCHELASTIC_RUN_ID" in env:
        return _from_torch_variables("torchrun", env)
    if "HOROVOD_RANK" in env:
        rendezvous = [env.get(f"HOROVOD_GLOO_RENDEZVOUS_{part}") for part in ("ADDR", "PORT")]
        job_id = ":".join(rendezvous) if all(rendezvous) else None
        return _from_mpi_style("horovodrun", env, "HOROVOD_RANK", "HOROVOD_SIZE",
                               "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", job_id,
                               how_to_pass="set MASTER_ADDR=<host of rank 0> and "
                                           "MASTER_PORT=<port> in the environment of horovodrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        job_id = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
        return _from_mpi_style("mpirun", env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", job_id,
                               how_to_pass="pass -x MASTER_ADDR=<host of rank 0> "
                                           "-x MASTER_PORT=<port> to mpirun")
    if "PMI_RANK" in env:
        return _from_mpi_style("mpirun", env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                               "MPI_LOCALNRANKS", env.get("PMI_KVSNAME"),
                               how_to_pass="pass -genv MASTER_ADDR <host of rank 0> "
                                           "-genv MASTER_PORT <port> to mpiexec")
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torch_variables("env", env)
    return LaunchInfo("single", 0, 1, 0, 1, env.get("MASTER_ADDR") or None,
                      _port(env, "MASTER_PORT") if env.get("MASTER_PORT") else None)


def _from_torch_variables(launcher: str, env: dict) -> LaunchInfo:
    rank = _integer(env, "RANK")
    world_size = _integer(env, "WORLD_SIZE")
    _check_rank("RANK", rank, "WORLD_SIZE", world_size)
    local_rank = _integer(env, "LOCAL_RANK", default=rank if world_size == 1 else None)
    local_world_size = _integer(env, "LOCAL_WORLD_SIZE",
                                default=world_size if local_rank == rank else None)
    _check_rank("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    addr = env.get("MASTER_ADDR") or None
    port = _port(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
    if world_size > 1 and (addr is None or port is None):
        raise ValueError(f"{launcher} launch with WORLD_SIZE={world_size} needs MASTER_ADDR and "
                         f"MASTER_PORT, got MASTER_ADDR={addr!r} MASTER_PORT={port!r}; set both "
                         f"to the host and a free port of rank 0")
    return LaunchInfo(launcher, rank, world_size, local_rank, local_world_size, addr, port)


def _from_mpi_style(launcher: str, env: dict, rank_var: str, size_var: str, local_rank_var: str,
                    local_size_var: str, job_id: Optional[str], how_to_pass: str) -> LaunchInfo:
    rank, world_size = _integer(env, rank_var), _integer(env, size_var)
    _check_rank(rank_var, rank, size_var, world_size)
    local_rank, local_size = _integer(env, local_rank_var), _integer(env, local_size_var)
    _check_rank(local_rank_var, local_rank, local_size_var, local_size)
    if local_size > world_size:
        raise ValueError(f"{local_size_var}={local_size} is larger than {size_var}={world_size}")
    addr = env.get("MASTER_ADDR") or None
    if addr is None:
        if local_size != world_size:
            raise ValueError(
                f"{launcher} started {world_size} ranks on several machines ({local_size} on "
                f"this one) and MASTER_ADDR is not set, so the ranks cannot find each other: "
                f"{how_to_pass}")
        addr = LOOPBACK
    if env.get("MASTER_PORT"):
        port = _port(env, "MASTER_PORT")
    elif job_id:
        port = _DERIVED_PORT_BASE + zlib.crc32(job_id.encode()) % _DERIVED_PORT_SPAN
    else:
        port = DEFAULT_PORT
    return LaunchInfo(launcher, rank, world_size, local_rank, local_size, addr, port)


def _integer(env: dict, name: str, default: Optional[int] = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise ValueError(f"environment variable {name} is not set; the launcher must set it "
                         f"(or set it yourself)")
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _check_rank(rank_name: str, rank: int, size_name: str, size: int) -> None:
    if size < 1:
        raise ValueError(f"{size_name} must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{rank_name}={rank} must be in [0, {size_name}={size})")


def _port(env: dict, name: str) -> int:
    port = _integer(env, name)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port in [1, 65535], got {port}")
    return port


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]
