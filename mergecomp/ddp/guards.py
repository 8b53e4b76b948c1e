"""What can go wrong between DDP and the hook, refused before it costs anything.

Each check here guards against a mistake DDP itself lets pass silently: a rank that never
registered the hook (its allreduce would meet this rank's compressed exchange), a layer
frozen when DDP was built and unfrozen later (DDP would not reduce it), sparse gradients (no
compressor carries them), and a model converted or moved after DDP was built (DDP's hooks
stay with the old storage, so nothing is reduced any more).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..distributed.backends import Backend
from ..runtime import gate


def check_every_rank_registered(backend: Backend, first: torch.Tensor) -> None:
    """Once, before the first exchange: fail clearly if some rank runs DDP without this hook.

    A rank without the hook sends DDP's own allreduce of its first bucket, where this rank
    would send the preflight; so the first collective of a hook rank is shaped exactly like
    that allreduce and pairs with it (:func:`mergecomp.runtime.gate.check_registered`).
    """
    gate.check_registered(
        backend, first, "allreduce", "the mergecomp DDP communication hook", "DDP's own allreduce",
        "Register the hook on every rank, with the same arguments (mergecomp.ddp.register(ddp_model, ...) "
        "or ddp_model.register_comm_hook(state, mergecomp.ddp.hook)), before the first backward.")


def check_frozen(frozen: List[Tuple[str, torch.nn.Parameter]]) -> None:
    """A parameter frozen when the state was built must not start training unseen: DDP
    reduces only the parameters that required gradients when it was built, so each rank
    would apply its own gradient to it and the ranks' models would drift apart."""
    if not any(p.requires_grad for _, p in frozen):
        return
    names = [n for n, p in frozen if p.requires_grad]
    raise RuntimeError(
        f"parameter(s) {names[:5]}{'...' if len(names) > 5 else ''} were frozen (requires_grad="
        "False) when DDP and its mergecomp hook state were built and now require gradients: DDP "
        "does not reduce them, so every rank would apply its own gradient and the ranks' models "
        "would drift apart. Build DistributedDataParallel and register the hook again after "
        "changing requires_grad (a new HookState, or this one's state_dict() loaded into it), or "
        "use mergecomp.DistributedOptimizer, which takes parameters unfrozen during training into "
        "its exchange.")


def sparse_bucket_error(index: int, names: List[str]) -> ValueError:
    """DDP put sparse gradients (``nn.Embedding(sparse=True)``) in bucket ``index``."""
    return ValueError(
        f"DDP's bucket {index} holds sparse gradients (parameter(s) {names}, e.g. "
        "nn.Embedding(sparse=True)), which the mergecomp hook cannot compress: build those "
        "layers with sparse=False, or keep DDP's own allreduce (no hook) for such a model")


def parameter_names(model: torch.nn.Module) -> Dict[int, str]:
    module = getattr(model, "module", model)
    return {id(p): name for name, p in module.named_parameters()}


def watch_conversion(model: Optional[torch.nn.Module]):
    """Register a :class:`ConversionCheck` on the module DDP wraps; returns its handle."""
    if model is None:
        return None
    module = getattr(model, "module", model)
    return module.register_forward_pre_hook(ConversionCheck(module))


def frozen_parameters(model: Optional[torch.nn.Module]) -> List[Tuple[str, torch.nn.Parameter]]:
    if model is None:
        return []
    module = getattr(model, "module", model)
    return [(name, p) for name, p in module.named_parameters() if not p.requires_grad]


def refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """Embeddings built with ``sparse=True`` make sparse gradients, which DDP puts in a bucket
    of their own and which no mergecomp compressor carries: say so before the first step."""
    module = getattr(model, "module", model)
    sparse = [f"{name}.weight" if name else "weight" for name, m in module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
              and m.weight.requires_grad]
    if sparse:
        raise ValueError(
            f"parameter(s) {sparse} get sparse gradients (nn.Embedding/EmbeddingBag with sparse=True), "
            "which the mergecomp hook cannot compress: build those layers with sparse=False, or keep "
            "DDP's own allreduce (no hook) for such a model")


class ConversionCheck:
    """A forward pre-hook: refuse a model converted or moved after DDP was built.

    ``model.to(torch.float64)`` (or to another device) after ``DistributedDataParallel`` gives
    the parameters new storage, and DDP's gradient hooks stay with the old: no bucket is
    reduced any more, the hook is never called, and each rank trains on its own gradients
    without a word.  Conversions act on the whole model, so the first and the last parameter
    are enough to see one, at two comparisons per forward.  A plain object, so a module
    that holds it still pickles.
    """

    def __init__(self, module: torch.nn.Module):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.watched = [(n, p, p.dtype, p.device) for n, p in (named[:1] + named[-1:])]

    def __call__(self, module, args) -> None:
        for name, param, dtype, device in self.watched:
            if param.dtype != dtype or param.device != device:
                raise RuntimeError(
                    f"parameter {name!r} is now {param.dtype} on {param.device}, but it was {dtype} on "
                    f"{device} when DistributedDataParallel and the mergecomp hook were built: the model "
                    "was converted or moved (model.to(...)) afterwards, and DDP no longer sees its "
                    "gradients, so each rank would train on its own. Convert or move the model first, "
                    "then build DistributedDataParallel and register the hook.")



