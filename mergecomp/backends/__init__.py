"""Collective backends: torch.distributed by default, Horovod when launched by horovodrun."""
from .base import Backend, Completed, Work


def default_backend() -> Backend:
    """The backend for the current launch: torch.distributed over the default group."""
    from .torch_dist import TorchDistributedBackend
    return TorchDistributedBackend()


__all__ = ["Backend", "Work", "Completed", "default_backend"]
