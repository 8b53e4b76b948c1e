"""mergecomp: compressed data-parallel training for PyTorch.

    import mergecomp
    optimizer = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.01),
        memory="residual", communicator="allgather", schedule=2)
    # or, keeping DistributedDataParallel: mergecomp.ddp.register(ddp_model, compressor="topk")

Components are looked up by name in four registries (``mergecomp.compressors``,
``.memories``, ``.communicators``, ``.schedulers``), each open to plugins.
"""
from . import checkpoint, communicators, compressors, memories, schedulers
from . import planning  # noqa: F401  (registers the optimal and auto schedulers)
from .checkpoint import load, save
from .optimizer import DistributedOptimizer
# The DDP hook is part of the public face (``mergecomp.ddp.register`` after ``import
# mergecomp``); it imports nothing the optimizer does not already, so it costs little.
from . import ddp  # noqa: E402
from . import fsdp  # noqa: E402  (FSDP2: mergecomp.fsdp.register after fully_shard)
from .plan import Group, ParamInfo, Plan
from .distributed import backends, launch
from .runtime.agreement import NonFiniteGradient, NonFiniteParameters, RanksDisagree
from .distributed.watchdog import CollectiveError, CollectiveTimeout, PeerLost
from .steplog import StepLog
from .runtime.controller import DriftController, DriftReading
from .lowcomm import DiLoCo  # noqa: E402  (low-communication: docs/low-communication.md)

__version__ = "0.1.0"

__all__ = ["DistributedOptimizer", "StepLog", "Plan", "Group", "ParamInfo", "compressors", "memories",
           "communicators", "schedulers", "backends", "ddp", "fsdp", "checkpoint", "save", "load", "launch", "NonFiniteGradient", "NonFiniteParameters", "RanksDisagree", "CollectiveError",
           "CollectiveTimeout", "PeerLost", "__version__"]
__all__ += ["DiLoCo", "lowcomm", "DriftController", "DriftReading"]
