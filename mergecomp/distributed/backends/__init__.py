"""Collective backends: torch.distributed by default, Horovod when launched by horovodrun.

``MERGECOMP_BACKEND`` overrides the choice: ``torch`` keeps torch.distributed under
horovodrun; ``horovod`` picks Horovod under any launcher (needed for horovodrun's MPI mode,
whose processes see only mpirun's variables and cannot be told from a plain mpirun job).
"""
import os
from typing import Mapping, Optional

from ..launch import detect
from .base import Backend, Completed, Work
from .torch_dist import TorchDistributedBackend

BACKEND_VARIABLE = "MERGECOMP_BACKEND"
BACKENDS = ("torch", "horovod")


def backend_kind(environ: Optional[Mapping[str, str]] = None) -> str:
    """``"torch"`` or ``"horovod"``: what :func:`default_backend` builds for this launch."""
    env = os.environ if environ is None else environ
    asked = env.get(BACKEND_VARIABLE, "").strip().lower()
    if asked:
        if asked not in BACKENDS:
            raise ValueError(f"{BACKEND_VARIABLE} must be one of {list(BACKENDS)}, got "
                             f"{env[BACKEND_VARIABLE]!r}; unset it to choose from the launcher")
        return asked
    return "horovod" if detect(env).launcher == "horovodrun" else "torch"


def default_backend() -> Backend:
    """The backend for the current launch.

    Horovod when the process was started by horovodrun (HOROVOD_RANK is set) or
    MERGECOMP_BACKEND=horovod — failing right away, with install advice, if
    ``horovod.torch`` cannot be imported — otherwise torch.distributed over the default group.
    """
    kind = backend_kind()
    if kind == "horovod":
        from .horovod import HorovodBackend
        why = (f"{BACKEND_VARIABLE}=horovod is set" if os.environ.get(BACKEND_VARIABLE)
               else f"this process was started by horovodrun (HOROVOD_RANK="
                    f"{os.environ.get('HOROVOD_RANK')})")
        return HorovodBackend(why=why)
    return TorchDistributedBackend()


__all__ = ["Backend", "Work", "Completed", "default_backend", "backend_kind", "BACKEND_VARIABLE"]
