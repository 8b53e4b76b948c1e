"""mergecomp: compressed data-parallel training for PyTorch.

    import mergecomp
    optimizer = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compressor="topk", memory="residual", communicator="allgather", schedule=2)

Components are looked up by name in four registries (``mergecomp.compressors``,
``.memories``, ``.communicators``, ``.schedulers``), each open to plugins.
"""
from . import backends, checkpoint, communicators, compressors, memories, schedulers
from .checkpoint import load, save
from .optimizer import DistributedOptimizer
from .plan import Group, ParamInfo, Plan

__version__ = "0.1.0"

__all__ = ["DistributedOptimizer", "Plan", "Group", "ParamInfo", "compressors", "memories",
           "communicators", "schedulers", "backends", "checkpoint", "save", "load", "__version__"]
